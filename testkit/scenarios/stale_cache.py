"""Stale-cache proof: the hazard RolloutPool exists for, reproduced on real vLLM CPU servers.

    .venv/bin/python -m bench.stale_cache     # ~1-2 min; bench/results/stale_cache_cpu.json

Two servers with identical flags (same :class:`~pool.launcher.ReplicaSpec` except model, port,
core and work dir): **X** starts on random checkpoint A (seed 1), the reference server **R** on
checkpoint B (seed 2). R gives B's reference greedy output (``ignore_eos``, 16 tokens) for LONG
(300 token ids: two full 128-token KV blocks, i.e. 256 cacheable tokens) and SHORT (8 ids, never
cacheable). A's reference is X's own output, taken first thing, before anything touched X.

1. **Unsafe path** on X: LONG once (+0 hits), LONG again (+256 hits: the cache is filled), then
   ``/collective_rpc reload_weights`` to B with no pause and no cache reset, then LONG again.
   Measured: ``stale_hits`` (delta of ``vllm:prefix_cache_hits_total``; every hit is a KV block
   computed under A, since nothing else touched LONG after the reload) and whether the output
   ``matches_reference`` (R's output for B). SHORT is checked too: it equals B, so the weights
   did change and the cache alone is to blame. X is then restored to A the proper way (pause,
   reload A, reset caches, resume) and checked against A's reference.
2. **Pool path** on X: registered in a real Redis store, bootstrapped READY on g0 (A) by
   :meth:`CycleRunner.bootstrap`, LONG warmed both the way the router sends it (admitted through
   the store, ``cache_salt`` = the generation label ``g0``) and without a salt, each verified by a
   repeat (+256). Then :meth:`CycleRunner.run` to g1 = B. After READY, LONG is sent salted with
   ``g1`` (admitted through the store, as a router would) and unsalted: both must get 0 hits and
   produce R's output. A salted repeat then gets +256 hits again: fresh B blocks, legitimate.
3. **Bad checkpoints**, each through :meth:`CycleRunner.run` against X while READY on g1: a
   missing path, wrong shapes (MLP 512), wrong dtype (bf16 copy), and identity mismatches (declared
   manifest digest, checkpoint URI, content hash not matching the files). Each must be refused by
   preflight (``CycleError`` with outcome ``refused``) with no state transition in the journal;
   afterwards X must be alive, unpaused, labelled g1, READY on g1 in the store, admissible, and
   produce B's reference output for LONG and SHORT. ``engines_poisoned`` counts engines that died
   or whose output no longer matches.

**Probe choice.** Both cycles validate on SHORT, not LONG: the cycle's probe runs with
``cache_salt`` = the new label, so a LONG probe would itself fill the cache for (LONG, ``g1``) with
fresh B blocks, and the post-READY salted LONG would then show +256 *legitimate* hits, making the
stale-hit measurement meaningless. The g0 probe expects A's output as measured on X before any
change (X was started on A); the g1 probe expects R's output for B.

Note: vLLM 0.32's ``/pause`` clears the prefix cache by default, so the pool path has three
independent protections (pause clears, the cycle's checked ``/reset_prefix_cache``, and the
per-generation salt); the unsafe path has none of them.

:func:`run_scenario` is the importable core (``tests/integration/test_stale_cache.py`` calls it
on servers it starts itself); :func:`make_specs` and :func:`start_servers` build and start the
pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pool.checkpoint import content_hash, read_manifest
from pool.engine import VllmEngine
from pool.launcher import LocalReplica, ReplicaSpec
from pool.records import ReplicaReport
from pool.settings import StoreSettings
from pool.store import Admission, RedisStore
from pool.types import BindingState, Generation, ReplicaState, WeightIdentity
from rolloutpool.local.models import ensure_model
from updater.cycle import (
    CycleError,
    CycleRunner,
    Deadlines,
    Probe,
    ReplicaHandle,
    UpdateTarget,
)
from updater.transports.reload import ReloadTransport

__all__ = [
    "GEN_TOKENS",
    "LONG",
    "SHORT",
    "Checkpoints",
    "make_specs",
    "run_scenario",
    "start_servers",
    "stop_servers",
]

#: 300 prompt token ids (regular ids 300..1999, no special token after the BOS): two full
#: 128-token KV blocks, so 256 tokens can be served from the prefix cache.
LONG: tuple[int, ...] = (0, *[(i * 53) % 1700 + 300 for i in range(299)])
LONG_FORMULA = "[0] + [(i * 53) % 1700 + 300 for i in range(299)]"
#: 8 prompt token ids: shorter than one block, never served from the prefix cache.
SHORT: tuple[int, ...] = (0, 412, 877, 1290, 655, 301, 1999, 730)
GEN_TOKENS = 16
REPLICA_ID = "x"
REQUEST_TIMEOUT_S = 120.0
#: Spec fields that may differ between X and R; everything else (every vLLM flag) must be equal.
#: ``name`` only names the work dir and log messages; it is not passed to vLLM.
PER_SERVER_FIELDS = frozenset({"model", "port", "cpu_bind", "work_dir", "name"})


@dataclass(frozen=True)
class Checkpoints:
    """Absolute checkpoint directories of the tiny models the scenario uses."""

    a: Path  # random, seed 1: X starts on it (g0)
    b: Path  # random, seed 2, same manifest: R serves it; g1
    wide: Path  # seed 1, intermediate_size 512: wrong shapes
    bf16: Path  # seed 1 in bfloat16: wrong dtypes

    @classmethod
    def ensure(cls, cache_root: Path | None = None) -> Checkpoints:
        """Build (or reuse from the model cache) the four checkpoints; blocks a few seconds."""
        return cls(
            a=ensure_model("random", cache_root, seed=1),
            b=ensure_model("random", cache_root, seed=2),
            wide=ensure_model("random", cache_root, seed=1, intermediate_size=512),
            bf16=ensure_model("random", cache_root, seed=1, dtype="bfloat16"),
        )


def make_specs(
    ckpts: Checkpoints, work_root: Path, *, startup_timeout_s: float = 420.0
) -> tuple[ReplicaSpec, ReplicaSpec]:
    """Specs of X (checkpoint A, core 0) and R (checkpoint B, core 1) with identical flags:
    the launcher defaults (float32, eager, 64 MiB KV cache, prefix caching, max len 512)."""
    shared: dict[str, Any] = {"startup_timeout_s": startup_timeout_s}
    x = ReplicaSpec(model=ckpts.a, name="stale-x", cpu_bind="0", work_dir=work_root / "x", **shared)
    r = ReplicaSpec(model=ckpts.b, name="stale-r", cpu_bind="1", work_dir=work_root / "r", **shared)
    return x, r


async def start_servers(
    x_spec: ReplicaSpec, r_spec: ReplicaSpec
) -> tuple[LocalReplica, LocalReplica]:
    """Start X and R concurrently (each waits until a real completion works); all or nothing."""
    x, r = LocalReplica(x_spec), LocalReplica(r_spec)
    results = await asyncio.gather(x.start(), r.start(), return_exceptions=True)
    failures = [e for e in results if isinstance(e, BaseException)]
    if failures:
        await stop_servers(x, r)
        raise failures[0]
    return x, r


async def stop_servers(*replicas: LocalReplica) -> None:
    await asyncio.gather(*(rep.stop() for rep in replicas), return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# Flags


def shared_flags(x: ReplicaSpec, r: ReplicaSpec) -> dict[str, Any]:
    """The spec fields and vLLM CLI flags X and R share; ``ValueError`` if they differ."""
    fx = x.model_dump(mode="json", exclude=set(PER_SERVER_FIELDS))
    fr = r.model_dump(mode="json", exclude=set(PER_SERVER_FIELDS))
    if fx != fr:
        diff = {k: (fx.get(k), fr.get(k)) for k in fx.keys() | fr.keys() if fx.get(k) != fr.get(k)}
        raise ValueError(f"X and R must be launched with identical flags; they differ: {diff}")
    return {"spec": fx, "cli": _cli_flags(x)}


def _cli_flags(spec: ReplicaSpec) -> list[str]:
    """The server's argv after the module name, with the per-server values elided."""
    argv, _ = spec.command(0, Path("/work"), Path("/rpc"))
    args = argv[3:]  # python -m vllm.entrypoints...
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            out.append("<per-server>")
            skip = False
            continue
        out.append(a)
        skip = a in ("--model", "--port")
    return out


async def block_size(url: str) -> int | None:
    """The KV block size from ``vllm:cache_config_info`` (None if not reported)."""
    async with httpx.AsyncClient(timeout=30.0) as c:
        r = await c.get(f"{url}/metrics")
    m = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', r.text)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# Measured requests


@dataclass(frozen=True)
class Shot:
    """One greedy completion and the prefix-cache counters it moved (in tokens)."""

    tokens: tuple[int, ...]
    hits: int
    queries: int
    ms: float


async def shot(engine: VllmEngine, prompt: tuple[int, ...], *, salt: str | None = None) -> Shot:
    """Greedy ``GEN_TOKENS`` tokens of ``prompt`` with the prefix-cache hit delta it caused.

    The counters are scraped before and after; the after-scrape is repeated (up to 5 s) until
    this request's queries show up, so a late metrics update cannot hide hits. The engine must
    serve nothing else meanwhile (it does not, in this scenario).
    """
    before = await engine.metrics()
    t0 = time.monotonic()
    out = await engine.complete(
        list(prompt),
        max_tokens=GEN_TOKENS,
        temperature=0.0,
        cache_salt=salt,
        timeout_s=REQUEST_TIMEOUT_S,
    )
    ms = (time.monotonic() - t0) * 1000
    deadline = time.monotonic() + 5.0
    while True:
        after = await engine.metrics()
        if after.prefix_cache_queries > before.prefix_cache_queries or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return Shot(
        out,
        after.prefix_cache_hits - before.prefix_cache_hits,
        after.prefix_cache_queries - before.prefix_cache_queries,
        ms,
    )


async def routed(
    store: RedisStore, engine: VllmEngine, rollout_id: str, prompt: tuple[int, ...]
) -> tuple[Shot, Admission]:
    """One rollout the way the router sends it: admit (I1), ``cache_salt`` = the bound label,
    release. Raises ``AdmissionRefused`` if the replica is not admissible."""
    adm = await store.admit(rollout_id, REPLICA_ID)
    try:
        s = await shot(engine, prompt, salt=adm.label)
    except BaseException:
        await store.release(rollout_id, REPLICA_ID, BindingState.ABORTED, reason="error")
        raise
    await store.release(
        rollout_id, REPLICA_ID, prompt_tokens=len(prompt), completion_tokens=len(s.tokens)
    )
    return s, adm


def identity_of(path: Path, step: int, **overrides: Any) -> WeightIdentity:
    """The identity a trainer would declare for ``path`` (content hash included)."""
    fields: dict[str, Any] = {
        "manifest_digest": read_manifest(path).digest,
        "checkpoint_uri": str(path),
        "trainer_run": "stale-cache",
        "step": step,
        "content_hash": content_hash(path),
    }
    fields.update(overrides)
    return WeightIdentity.model_validate(fields)


def _head(tokens: tuple[int, ...], n: int = 8) -> list[int]:
    return list(tokens[:n])


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


class ScenarioError(RuntimeError):
    """A step the scenario relies on did not behave (not a measured outcome)."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ScenarioError(what)


# ---------------------------------------------------------------------------------------------
# The scenario


async def run_scenario(
    x: LocalReplica,
    r: LocalReplica,
    ckpts: Checkpoints,
    redis_url: str,
    *,
    scratch: Path | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """Run the unsafe path, the pool path and the bad checkpoints on started servers X (on A,
    untouched so far) and R (on B). Returns the result document (without bench metadata).

    Leaves X READY on g1 (B) in the store namespace (a fresh one by default) and both servers
    running; the caller stops them. ``scratch`` is where the missing checkpoint path points
    (default: a temp dir name that is never created). Raises :class:`ScenarioError` if a step
    the measurement relies on misbehaves (e.g. A and B give equal outputs).
    """
    t_start = time.monotonic()
    flags = shared_flags(x.spec, r.spec)
    _require(
        x.spec.model == ckpts.a and r.spec.model == ckpts.b,
        "X must be started on checkpoint A and R on checkpoint B",
    )
    flags["block_size"] = await block_size(x.url)
    timings: dict[str, Any] = {
        "server_start_s": {"x": _round(x.startup_s), "r": _round(r.startup_s)}
    }
    ex = VllmEngine(x.url, timeout=REQUEST_TIMEOUT_S)
    er = VllmEngine(r.url, timeout=REQUEST_TIMEOUT_S)
    try:
        await ex.bootstrap()
        await er.bootstrap()

        # References: B from the independent server R; A from X before anything changed it.
        ref_b_long, ref_b_short = await shot(er, LONG), await shot(er, SHORT)
        ref_a_long, ref_a_short = await shot(ex, LONG), await shot(ex, SHORT)
        _require(
            ref_b_long.hits == 0 and ref_a_long.hits == 0,
            f"reference runs must be uncached: hits {ref_a_long.hits}, {ref_b_long.hits}",
        )
        _require(
            ref_a_long.tokens != ref_b_long.tokens and ref_a_short.tokens != ref_b_short.tokens,
            "A and B must be distinguishable by their outputs",
        )
        refs = {"a": ref_a_long.tokens, "b": ref_b_long.tokens}

        unsafe = await _unsafe_path(ex, ckpts, refs, ref_b_short.tokens, timings)
        store = RedisStore.connect(
            StoreSettings(url=redis_url, namespace=namespace or f"stale{uuid.uuid4().hex[:10]}")
        )
        lease = store.updater_lease("bench-stale-cache")
        token = await lease.acquire(blocking_timeout_s=30)
        keep = asyncio.create_task(lease.keep_alive())
        try:
            runner = CycleRunner(
                store, lease, ReloadTransport(), deadlines=Deadlines(transfer_s=60.0)
            )
            handle = ReplicaHandle(REPLICA_ID, ex, read_manifest(ckpts.a))
            await store.register_replica(REPLICA_ID, x.url, token)
            pool = await _pool_path(
                store, runner, handle, ckpts, refs, ref_a_short.tokens, ref_b_short.tokens, timings
            )
            missing = (scratch or Path(tempfile.gettempdir())) / f"missing-{uuid.uuid4().hex[:8]}"
            bad = await _bad_checkpoints(
                store, runner, handle, x, ckpts, missing, refs["b"], ref_b_short.tokens, timings
            )
        finally:
            keep.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await keep
            with contextlib.suppress(Exception):
                await lease.release()
            await store.close()
    finally:
        await ex.aclose()
        await er.aclose()
    timings["scenario_s"] = round(time.monotonic() - t_start, 2)

    verdict = {
        "unsafe_shows_hazard": unsafe["stale_hits"] > 0 and not unsafe["matches_reference"],
        "pool_safe": pool["stale_hits"] == 0
        and pool["stale_hits_unsalted"] == 0
        and pool["matches_reference"]
        and pool["matches_reference_unsalted"],
        "all_bad_refused": bad["refused"] == bad["tried"] and bad["tried"] > 0,
        "none_poisoned": bad["engines_poisoned"] == 0,
    }
    verdict["ok"] = all(verdict.values())
    return {
        "unsafe": unsafe,
        "pool": pool,
        "bad_checkpoints": bad,
        "verdict": verdict,
        "timings": timings,
        "prompt_tokens": {
            "long": len(LONG),
            "long_ids": LONG_FORMULA,
            "long_cacheable": (len(LONG) - 1) // 128 * 128,
            "short": len(SHORT),
            "short_ids": list(SHORT),
            "max_tokens": GEN_TOKENS,
            "sampling": "greedy (temperature 0), ignore_eos",
        },
        "references": {
            "a_long_head": _head(ref_a_long.tokens),
            "b_long_head": _head(ref_b_long.tokens),
            "a_source": "X itself, first request after start (on checkpoint A, uncached)",
            "b_source": "R, a fresh server on checkpoint B with identical flags (uncached)",
        },
        "flags": flags,
        "checkpoints": {k: str(v) for k, v in vars(ckpts).items()},
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


async def _unsafe_path(
    ex: VllmEngine,
    ckpts: Checkpoints,
    refs: dict[str, tuple[int, ...]],
    ref_b_short: tuple[int, ...],
    timings: dict[str, Any],
) -> dict[str, Any]:
    """Fill the cache under A, reload B with no pause and no reset, measure; restore A."""
    fill = await shot(ex, LONG)  # the reference run was the first; this repeat must hit
    _require(fill.hits > 0, f"LONG repeat on A got no prefix-cache hits ({fill})")
    rpc = await ex.collective_rpc(
        "reload_weights", {"weights_path": str(ckpts.b)}, timeout_s=REQUEST_TIMEOUT_S
    )
    _require(
        list(rpc.results) == [None] * len(rpc.results) and len(rpc.results) > 0,
        f"reload_weights(B) failed: {rpc.results}",
    )
    after = await shot(ex, LONG)
    short = await shot(ex, SHORT)
    timings["unsafe_reload_ms"] = _ms(rpc.elapsed_s)

    # Restore A properly so X can be reused: pause, reload A, reset caches, resume.
    t0 = time.monotonic()
    await ex.pause("wait", timeout_s=REQUEST_TIMEOUT_S)
    back = await ex.collective_rpc(
        "reload_weights", {"weights_path": str(ckpts.a)}, timeout_s=REQUEST_TIMEOUT_S
    )
    reset = await ex.reset_caches()
    await ex.resume()
    timings["restore_ms"] = _ms(time.monotonic() - t0)
    _require(
        all(v is None for v in back.results) and reset.prefix,
        f"restoring A failed: reload {back.results}, reset {reset}",
    )
    restored = await shot(ex, LONG)
    _require(
        restored.hits == 0 and restored.tokens == refs["a"],
        f"X not restored to A: hits {restored.hits}, tokens {_head(restored.tokens)}",
    )
    return {
        "stale_hits": after.hits,
        "matches_reference": after.tokens == refs["b"],
        "matches_checkpoint_a": after.tokens == refs["a"],
        "fill_hits": fill.hits,
        "fill_matches_a": fill.tokens == refs["a"],
        "short_matches_reference": short.tokens == ref_b_short,
        "long_head": _head(after.tokens),
        "restored_to_a": True,
        "restored_hits": restored.hits,
    }


async def _pool_path(
    store: RedisStore,
    runner: CycleRunner,
    handle: ReplicaHandle,
    ckpts: Checkpoints,
    refs: dict[str, tuple[int, ...]],
    ref_a_short: tuple[int, ...],
    ref_b_short: tuple[int, ...],
    timings: dict[str, Any],
) -> dict[str, Any]:
    """Bootstrap g0 (A), warm LONG salted and unsalted, cycle to g1 (B), measure."""
    g0, g1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")
    id_a, id_b = identity_of(ckpts.a, 0), identity_of(ckpts.b, 1)
    boot = await runner.bootstrap(handle, g0, id_a, Probe(SHORT, ref_a_short), checkpoint=None)
    timings["bootstrap"] = boot.model_dump(mode="json")

    # Warm the prefix cache on g0: as the router sends it (salt = label), and unsalted.
    warm_salted = [await routed(store, handle.engine, f"warm-salted-{i}", LONG) for i in (1, 2)]
    warm_plain = [await shot(handle.engine, LONG) for _ in (1, 2)]
    salt_g0 = warm_salted[0][1].label
    _require(salt_g0 == "g0", f"admission on g0 bound label {salt_g0!r}")
    _require(
        warm_salted[1][0].hits > 0 and warm_plain[1].hits > 0,
        "warming LONG on g0 did not fill the prefix cache",
    )
    _require(
        all(s.tokens == refs["a"] for s, _ in warm_salted)
        and all(s.tokens == refs["a"] for s in warm_plain),
        "X on g0 does not produce A's output for LONG",
    )

    target = UpdateTarget(g1, id_b, ckpts.b, Probe(SHORT, ref_b_short))
    t0 = time.monotonic()
    report = await runner.run(handle, target)
    timings["cycle_total_s"] = round(time.monotonic() - t0, 3)
    timings["cycle"] = report.model_dump(mode="json")
    rec = await store.replica(REPLICA_ID)
    _require(
        (rec.state, rec.generation, rec.label) == (ReplicaState.READY, 1, "g1"),
        f"after the cycle X is {rec.state} on {rec.generation}/{rec.label}",
    )

    salted, adm = await routed(store, handle.engine, "after-salted", LONG)
    plain = await shot(handle.engine, LONG)
    again, _ = await routed(store, handle.engine, "after-salted-again", LONG)
    return {
        "stale_hits": salted.hits,
        "matches_reference": salted.tokens == refs["b"],
        "stale_hits_unsalted": plain.hits,
        "matches_reference_unsalted": plain.tokens == refs["b"],
        "salt": adm.label,
        "warm_hits": {"salted_g0": warm_salted[1][0].hits, "unsalted": warm_plain[1].hits},
        "fresh_hits_after": again.hits,
        "fresh_repeat_matches_reference": again.tokens == refs["b"],
        "probe": "SHORT (a LONG probe would fill (LONG, g1) with fresh blocks itself)",
        "cycle_outcome": report.outcome,
        "engine_label": (await handle.engine.weight_label()).label,
    }


async def _bad_checkpoints(
    store: RedisStore,
    runner: CycleRunner,
    handle: ReplicaHandle,
    x: LocalReplica,
    ckpts: Checkpoints,
    missing: Path,
    ref_long: tuple[int, ...],
    ref_short: tuple[int, ...],
    timings: dict[str, Any],
) -> dict[str, Any]:
    """Try each bad checkpoint through CycleRunner.run while X is READY on g1."""
    cur = handle.lc.generation
    _require(cur is not None, "X has no generation")
    assert cur is not None
    a_digest = read_manifest(ckpts.a).digest
    cases: list[tuple[str, Path, WeightIdentity]] = [
        (
            "missing_path",
            missing,
            WeightIdentity(manifest_digest=a_digest, checkpoint_uri=str(missing), step=2),
        ),
        ("wrong_shapes", ckpts.wide, identity_of(ckpts.wide, 2)),
        ("wrong_dtype", ckpts.bf16, identity_of(ckpts.bf16, 2)),
        (
            "identity_manifest_digest",
            ckpts.a,
            identity_of(ckpts.a, 2, manifest_digest="sha256:" + "0" * 64),
        ),
        ("identity_checkpoint_uri", ckpts.a, identity_of(ckpts.a, 2, checkpoint_uri=str(ckpts.b))),
        (
            "identity_content_hash",
            ckpts.a,
            identity_of(ckpts.a, 2, content_hash=content_hash(ckpts.b)),
        ),
    ]
    details: list[dict[str, Any]] = []
    refusal_ms: dict[str, float] = {}
    for i, (name, path, ident) in enumerate(cases):
        gen = Generation(number=cur.number + 1, label=f"g{cur.number + 1}")
        target = UpdateTarget(gen, ident, path, Probe(SHORT, ref_short))
        journal_before = len(await store.journal())
        t0 = time.monotonic()
        try:
            report: ReplicaReport = await runner.run(handle, target)
            outcome, reason = str(report.outcome), "accepted"
        except CycleError as e:
            outcome, reason = str(e.report.outcome), e.report.reason
        except Exception as e:  # not expected: record it, the checks below still run
            outcome, reason = "error", f"{type(e).__name__}: {e}"
        refusal_ms[name] = _ms(time.monotonic() - t0)
        transitions = [
            e for e in (await store.journal())[journal_before:] if e.type == "transition"
        ]
        alive = x.alive and await handle.engine.health()
        d: dict[str, Any] = {
            "case": name,
            "path": str(path),
            "outcome": outcome,
            "refused": outcome == "refused" and not transitions,
            "reason": reason[:400],
            "transitions": len(transitions),
            "engine_alive": alive,
        }
        if alive:
            rec = await store.replica(REPLICA_ID)
            d["state_after"], d["generation_after"] = str(rec.state), rec.generation
            d["paused_after"] = await handle.engine.is_paused()
            d["label_after"] = (await handle.engine.weight_label()).label
            try:
                long_, adm = await routed(store, handle.engine, f"after-bad-{i}", LONG)
                d["admitted_on"] = adm.label
                short_ = await shot(handle.engine, SHORT)
                d["output_matches"] = long_.tokens == ref_long and short_.tokens == ref_short
            except Exception as e:
                d["output_matches"] = False
                d["check_error"] = f"{type(e).__name__}: {e}"[:400]
            d["still_ready_on_old"] = (
                d["state_after"] == ReplicaState.READY
                and d["generation_after"] == cur.number
                and d["label_after"] == cur.label
                and not d["paused_after"]
            )
        else:
            d["output_matches"] = False
            d["still_ready_on_old"] = False
        d["poisoned"] = not alive or not d["output_matches"]
        details.append(d)
    timings["refusal_ms"] = refusal_ms
    return {
        "tried": len(details),
        "refused": sum(d["refused"] for d in details),
        "engines_poisoned": sum(d["poisoned"] for d in details),
        "still_ready_on_old": sum(d["still_ready_on_old"] for d in details),
        "details": details,
    }
