"""TRL's ``GRPOTrainer``, unmodified, training through the pool (``trl==1.16.0``).

Generation goes through the router, policy updates go to the updater; nothing of TRL is patched.
Two public TRL extension points carry it (docs: guides/trainers.md says why these and not
TRL's vLLM server mode, whose weight sync needs CUDA and a single server)::

    from trl import GRPOConfig, GRPOTrainer
    from rolloutpool.integrations.trl import PoolLink

    link = PoolLink("http://127.0.0.1:8000", "http://127.0.0.1:8300", admin_token=TOKEN,
                    checkpoint_dir="/abs/ckpts", push_every=1)
    trainer = GRPOTrainer(
        model=model,                         # the trainer's own copy of the policy
        reward_funcs=link.reward(my_reward), # optional: staleness metrics, drop stale samples
        args=GRPOConfig(..., use_vllm=False),
        train_dataset=dataset,
        rollout_func=link.rollout_func,      # generation: the router
        callbacks=[link.callback],           # policy updates: the updater
    )
    trainer.train()
    link.close()

**Generation** (:meth:`PoolLink.rollout_func`, TRL's ``rollout_func`` hook, called in the training
thread; it blocks until every completion is back). TRL hands over each process's prompt slice, in
which each prompt appears ``num_generations`` times in a row (TRL's sampler repeats it). Every run
of identical prompts — one GRPO group — is one ``POST /inference/v1/generate`` with ``n`` = the
run's length, so **a group is one rollout, bound to one committed generation**, and its baseline
compares samples of one policy (the router charges it ``n`` slots of its replica's capacity; a group
larger than any replica's capacity is refused, 400 ``too_many_sequences``). Groups go out
concurrently (``concurrency``), so the router spreads them over the replicas. vLLM's per-token
``weight_versions`` spans on that endpoint are checked twice: by the router (I7: a contradiction is
refused with 502) and here (every choice must carry exactly one span naming the bound label;
anything else raises :class:`ProvenanceError`: it would be a pool bug). Replicas older than vLLM
0.32 (e.g. 0.26 on GPUs) report no spans: a choice without the field is unchecked
(:attr:`Sample.spans` None) and the router's binding alone says which generation produced it; such
answers are accepted only with ``require_spans=False``. An answer the pool refuses — 503 (no
admissible replica, binding ended by a drain deadline), 502, 504 or a transport error — delivered
nothing, so it is retried (new rollout) until ``retry_s``; it is counted in
:attr:`PoolLink.refused`. Other statuses raise :class:`PoolRolloutError`. Sampling settings are the
trainer's (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_completion_length``) plus ``sampling`` (e.g. ``{"ignore_eos": True}``).

**What the trainer sees per sample.** Besides ``prompt_ids``, ``completion_ids`` and the sampler's
``logprobs``, the hook returns, one per sample, ``rollout_generation`` (the generation number),
``rollout_policy_step`` (the trainer step whose weights that generation carries, read from
its label ``<run>-step<N>``; None for a generation this run did not push), ``rollout_id``,
``rollout_label`` and ``rollout_replica``. TRL forwards
extra fields to every reward function as keyword arguments. :meth:`PoolLink.reward` wraps a
reward function: it logs ``pool/generation`` and ``pool/policy_lag_steps`` (mean and max; lag =
current step - ``rollout_policy_step``) through TRL's ``log_metric``, adds a ``generation``
column to TRL's completions table, and with ``max_lag_steps`` drops samples older than that
(their reward becomes None; TRL gives such samples advantage 0, so they add no gradient). Every
sample is also kept in :attr:`PoolLink.samples`. TRL's own importance-sampling correction
against the sampler's logprobs exists only on its ``use_vllm`` path, which this hook replaces.

**Policy updates** (:attr:`PoolLink.callback`, a ``TrainerCallback``; acts on the main process
only). At ``on_train_begin`` (``sync_on_start``) it pushes the trainer's initial weights, so the
pool serves exactly the trainer's policy; without it, the pool's published generation is taken
to be the trainer's starting weights. Every ``push_every`` optimizer steps it saves the model
(safetensors, plus the tokenizer) to ``checkpoint_dir/<run>/step-NNNNNN`` (saving onto an existing
directory fails, so a committed checkpoint is never overwritten), computes the validation probe
from the trainer's own weights (:func:`updater.probe.probe_from_model`; from the saved checkpoint
when the model is not on CPU) and pushes it with the label ``<run>-step<N>``; the updater drains
and reloads the replicas one at a time while the others keep serving. ``run`` is random per link
unless given: with several training processes, give every process's link the same ``run`` (only
the main process pushes; every process reads policy steps from the labels). ``wait=True``
blocks the step until every replica serves the new generation (the next step's samples are
on-policy); ``wait=False`` returns at once and waits for the previous update only before the next
push (at most one in flight). The time the training
loop stood still for each update is :attr:`Update.stall_s`.

**From GPU memory** (``weights_from="gpu_memory"``, the trainer on the replicas' GPU or node
and the pool's transport ``ipc_direct``): instead of saving first, the callback stages the
model's weights on its GPU (:meth:`updater.client.UpdaterClient.push_module`: one
device-to-device copy, :attr:`Update.staging_copy_s`) and returns; the checkpoint is written
*from the staged copy* in the background and confirmed (fsynced) before the update is
submitted, the probe computed from it, and the replicas copy the weights from the staged copy
over CUDA IPC. That checkpoint is the generation's recovery source when the staged copy is gone.
With ``wait=False`` up to two updates are in flight (one rolling, the next queued behind it in
the updater), so a push waits only while the older of the two earlier pushes has not ended, and
the stall per update is the staging copy plus that wait, if any; three staged copies are kept
(the latest published one, the one rolling, the one queued: three times the weights' bytes on
the trainer's GPU). With ``wait=True`` one is in flight and two copies are kept. A failed update
raises
:class:`updater.client.UpdateFailed` from the callback, which stops training; the pool keeps
serving the last committed generation and the checkpoint stays on disk.

Thread safety: one :class:`PoolLink` per trainer; ``rollout_func`` and the callback run in the
training thread; the generation requests run on the link's own thread pool. ``close()`` releases
the HTTP clients and the pool; checkpoints are left on disk (the updater's recovery reloads the
latest one; delete old runs yourself).
"""

from __future__ import annotations

import functools
import importlib.metadata
import shutil
import statistics
import threading
import time
import uuid
import warnings
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from pool.errors import RolloutPoolError
from rolloutpool.integrations.trl_records import Sample, Staged, Submitted, Update
from updater.client import UpdaterClient
from updater.probe import probe_from_checkpoint, probe_from_model

try:
    from transformers import TrainerCallback
    from trl.data_utils import is_conversational
except ImportError as e:
    raise ImportError(
        "rolloutpool.integrations.trl needs TRL: pip install 'rolloutpool[trl]' (trl==1.16.0)"
    ) from e

TRL_VERSION = "1.16.0"
if importlib.metadata.version("trl") != TRL_VERSION:
    warnings.warn(
        f"rolloutpool.integrations.trl is tested with trl=={TRL_VERSION}; found "
        f"{importlib.metadata.version('trl')} (rollout_func is experimental in TRL)",
        RuntimeWarning,
        stacklevel=2,
    )

GENERATE = "/inference/v1/generate"
_NO_SPANS = " (replicas before vLLM 0.32 report none: PoolLink(require_spans=False))"
RETRY_STATUSES = frozenset({502, 503, 504})
RewardFunc = Callable[..., list[float | None]]  # TRL's own type for a reward function


class PoolRolloutError(RolloutPoolError):
    """The router answered a generation request with a status that is not retried."""

    code = "pool_rollout_error"


class ProvenanceError(RolloutPoolError):
    """A delivered completion's ``weight_versions`` spans do not name its bound generation."""

    code = "provenance_error"


@dataclass
class _Group:
    info: dict[str, Any]
    completions: list[list[int]]
    logprobs: list[list[float | None]]
    spans: list[tuple[str, ...] | None]


def _runs(prompts: Sequence[Any]) -> list[tuple[int, int]]:
    """(start, length) of each run of equal consecutive prompts."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _error_code(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return f"http_{r.status_code}"
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else f"http_{r.status_code}"


class PoolLink:
    """Connects one ``GRPOTrainer`` to a pool (see the module docstring for the contracts).

    ``router_url`` / ``api_key``: where rollouts go; ``updater_url`` / ``admin_token``: where
    checkpoints go; ``checkpoint_dir``: where they are written (the updater reads them from
    there); ``push_every``, ``wait``, ``sync_on_start``: the update policy; ``sampling``: extra
    vLLM sampling parameters; ``concurrency``: generation requests in flight; ``retry_s``: how
    long a refused rollout is retried; ``timeout_s``: one generation request;
    ``update_timeout_s``: one rolling update; ``probe``: keyword arguments of
    :func:`~updater.probe.probe_from_model`; ``run``: names labels and checkpoint directories;
    ``weights_from``: ``"checkpoint"`` (saved, then pushed) or ``"gpu_memory"`` (module
    docstring).
    """

    def __init__(
        self,
        router_url: str,
        updater_url: str,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        checkpoint_dir: str | Path,
        push_every: int = 1,
        wait: bool = True,
        sync_on_start: bool = True,
        sampling: dict[str, Any] | None = None,
        concurrency: int = 8,
        retry_s: float = 300.0,
        timeout_s: float = 600.0,
        update_timeout_s: float = 600.0,
        probe: dict[str, Any] | None = None,
        run: str | None = None,
        require_spans: bool = True,
        weights_from: Literal["checkpoint", "gpu_memory"] = "checkpoint",
    ) -> None:
        if push_every < 1:
            raise ValueError(f"push_every must be >= 1, got {push_every}")
        if weights_from not in ("checkpoint", "gpu_memory"):
            raise ValueError(f"weights_from must be checkpoint or gpu_memory, not {weights_from!r}")
        self.weights_from = weights_from
        self.run = run or f"trl-{uuid.uuid4().hex[:8]}"
        self.checkpoint_dir = Path(checkpoint_dir).resolve() / self.run
        self.push_every = push_every
        self.wait = wait
        self.sync_on_start = sync_on_start
        self.sampling = dict(sampling or {})
        self.retry_s = retry_s
        self.require_spans = require_spans
        self.update_timeout_s = update_timeout_s
        # The demo's settings: a near-uniform tiny policy has small top-1 margins; fp32 vLLM vs
        # fp32 torch differ by ~1e-5, far below 2e-3.
        self.probe = {"n_tokens": 4, "margin": 2e-3, "tries": 512, **(probe or {})}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=router_url, headers=headers, timeout=timeout_s)
        self._updater = UpdaterClient(updater_url, admin_token)
        self._threads = ThreadPoolExecutor(concurrency, thread_name_prefix="pool-rollout")
        self._lock = threading.Lock()
        self._base: tuple[str, int] | None = None  # (label, step) without sync_on_start
        # the updates in flight, oldest first: a submitted update (its record, when it was
        # pushed) or, weights_from="gpu_memory", a push still in the background
        self._flight: deque[Submitted | Staged] = deque()
        self.samples: list[Sample] = []
        self.updates: list[Update] = []
        self.refused: Counter[str] = Counter()  # retried answers by error code
        self.callback = _PoolCallback(self)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._http.close()
        self._updater.close()

    # ------------------------------------------------------------------ generation

    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func``: one completion per entry of ``prompts``, in order."""
        prompt_ids = self._tokenize(prompts, trainer)
        sampling = self._sampling(trainer.args)
        step = int(trainer.state.global_step)
        runs = _runs(prompts)
        groups = list(
            self._threads.map(lambda r: self._generate(prompt_ids[r[0]], r[1], sampling), runs)
        )
        out: dict[str, list[Any]] = {
            k: []
            for k in (
                "prompt_ids",
                "completion_ids",
                "logprobs",
                "rollout_generation",
                "rollout_policy_step",
                "rollout_id",
                "rollout_label",
                "rollout_replica",
            )
        }
        for (start, _), group in zip(runs, groups, strict=True):
            info = group.info
            generation = int(info["generation"])
            policy_step = self.policy_step(info["label"])
            choices = zip(group.completions, group.logprobs, group.spans, strict=True)
            for comp, lps, spans in choices:
                out["prompt_ids"].append(prompt_ids[start])
                out["completion_ids"].append(comp)
                out["logprobs"].append(lps)
                out["rollout_generation"].append(generation)
                out["rollout_policy_step"].append(policy_step)
                out["rollout_id"].append(info["id"])
                out["rollout_label"].append(info["label"])
                out["rollout_replica"].append(info["replica"])
                self.samples.append(
                    Sample(
                        step=step,
                        rollout_id=info["id"],
                        generation=generation,
                        label=info["label"],
                        replica=info["replica"],
                        identity_digest=info["identity_digest"],
                        policy_step=policy_step,
                        spans=spans,
                        completion_tokens=len(comp),
                    )
                )
        return out

    @staticmethod
    def _tokenize(prompts: list[Any], trainer: Any) -> list[list[int]]:
        """Token ids the way ``GRPOTrainer`` tokenizes prompts for its own generation."""
        pc = trainer.processing_class
        if is_conversational({"prompt": prompts[0]}):
            out = pc.apply_chat_template(
                conversation=prompts,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(trainer.args.chat_template_kwargs or {}),
            )
        else:
            out = pc(text=prompts)
        return [list(map(int, ids)) for ids in out["input_ids"]]

    def _sampling(self, args: Any) -> dict[str, Any]:
        return {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": 0.0 if args.min_p is None else args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "max_tokens": args.max_completion_length,
            "logprobs": 0,
            # vLLM's RequestOutputKind.FINAL_ONLY: the answer holds all n completions. vLLM 0.32+
            # sets it on this endpoint itself; 0.26 does not, and its answer to n > 1 then
            # carries only the completions of the last engine step
            "output_kind": 2,
            **self.sampling,
        }

    def _generate(self, prompt_ids: list[int], n: int, sampling: dict[str, Any]) -> _Group:
        """One rollout of ``n`` completions; retried while the pool refuses (see module doc)."""
        body = {"token_ids": prompt_ids, "sampling_params": {**sampling, "n": n}}
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                r = self._http.post(GENERATE, json=body)
            except httpx.TransportError as e:
                if time.monotonic() >= deadline:
                    raise
                self._count_refused(type(e).__name__)
                time.sleep(0.5)
                continue
            if r.status_code == 200:
                return self._parse(r.json(), n, self.require_spans)
            if r.status_code not in RETRY_STATUSES or time.monotonic() >= deadline:
                raise PoolRolloutError(
                    f"router answered {r.status_code} to {GENERATE}: {r.text[:500]}",
                    status=r.status_code,
                    error_code=_error_code(r),
                )
            self._count_refused(_error_code(r))
            time.sleep(min(float(r.headers.get("Retry-After", "0.2")), 5.0))

    def _count_refused(self, code: str) -> None:
        with self._lock:
            self.refused[code] += 1

    @staticmethod
    def _parse(data: dict[str, Any], n: int, require_spans: bool) -> _Group:
        info = data["rollout"]
        choices = sorted(data["choices"], key=lambda c: int(c["index"]))
        if len(choices) != n:
            raise PoolRolloutError(
                f"rollout {info['id']}: asked for {n} completions, got {len(choices)}",
                rollout_id=info["id"],
            )
        group = _Group(info=info, completions=[], logprobs=[], spans=[])
        for c in choices:
            tokens = [int(t) for t in c["token_ids"]]
            raw = c.get("weight_versions")
            spans = None
            if raw is not None or require_spans:
                spans = tuple(str(s["version"]) for s in raw or [])
            if spans is not None and spans != (info["label"],) and (spans or tokens):
                hint = "" if raw is not None else _NO_SPANS
                raise ProvenanceError(
                    f"rollout {info['id']} is bound to {info['label']!r} (generation "
                    f"{info['generation']}) but choice {c['index']} reports weight versions "
                    f"{list(spans)!r}{hint}",
                    rollout_id=info["id"],
                )
            content = (c.get("logprobs") or {}).get("content") or []
            lps = [e.get("logprob") for e in content] if content else [None] * len(tokens)
            group.completions.append(tokens)
            group.logprobs.append(lps)
            group.spans.append(spans)
        return group

    def policy_step(self, label: str) -> int | None:
        """The trainer step whose weights the generation labelled ``label`` carries, if this run
        pushed it (labels are ``<run>-step<N>``), or it is the pool's starting generation."""
        if self._base is not None and label == self._base[0]:
            return self._base[1]
        prefix = f"{self.run}-step"
        tail = label[len(prefix) :]
        return int(tail) if label.startswith(prefix) and tail.isdigit() else None

    # ------------------------------------------------------------------ rewards

    def reward(self, fn: RewardFunc, *, max_lag_steps: int | None = None) -> RewardFunc:
        """``fn`` with the pool's per-sample provenance logged (and stale samples dropped).

        The wrapper passes every keyword TRL gives it on to ``fn`` (so ``fn`` sees
        ``rollout_generation``, ``rollout_policy_step``, ... too) and keeps ``fn``'s name, which
        TRL uses to name the reward in its logs. With ``max_lag_steps``, a sample whose policy
        lag exceeds it, or is unknown, gets reward None.
        """

        @functools.wraps(fn)
        def scored(**kw: Any) -> list[float | None]:
            rewards: list[float | None] = list(fn(**kw))
            gens: list[int] = kw["rollout_generation"]
            step = int(kw["trainer_state"].global_step)
            lags = [None if p is None else step - p for p in kw["rollout_policy_step"]]
            known = [lag for lag in lags if lag is not None]
            log_metric = kw["log_metric"]
            log_metric("pool/generation", statistics.fmean(gens))
            if known:
                log_metric("pool/policy_lag_steps", statistics.fmean(known))
                log_metric("pool/policy_lag_steps_max", float(max(known)))
            kw["log_extra"]("generation", list(gens))
            if max_lag_steps is not None:
                stale = [lag is None or lag > max_lag_steps for lag in lags]
                rewards = [None if s else r for r, s in zip(rewards, stale, strict=True)]
                log_metric("pool/dropped_stale", sum(stale) / max(1, len(stale)))
            return rewards

        return scored

    # ------------------------------------------------------------------ updates

    def _start(self, model: Any, processing_class: Any, step: int) -> None:
        """Make the pool serve the trainer's starting weights and remember their generation."""
        if self.sync_on_start:
            self._push(model, processing_class, step)
            self._settle()
            return
        latest = self._http.get("/v1/pool").json().get("latest")
        if latest is not None:
            self._base = (str(latest["label"]), step)

    def _overlap(self) -> int:
        """Updates that may stay in flight while the next one is pushed (module docstring)."""
        return 1 if self.weights_from == "gpu_memory" and not self.wait else 0

    def _push(self, model: Any, processing_class: Any, step: int) -> None:
        t0 = time.monotonic()
        self._settle(keep=self._overlap())
        if self.weights_from == "gpu_memory":
            self._push_from_memory(model, processing_class, step, t0)
            return
        ckpt = self._save(model, processing_class, step)
        if next(model.parameters()).device.type == "cpu":
            probe = probe_from_model(model, seed=step, **self.probe)
        else:
            probe = probe_from_checkpoint(ckpt, seed=step, **self.probe)
        rec = self._updater.push(
            ckpt, probe=probe, step=step, label=f"{self.run}-step{step}", trainer_run=self.run
        )
        self._flight.append(Submitted(rec, time.monotonic()))
        self.updates.append(Update.of(rec, step, ckpt, stall_s=0.0))
        if self.wait:
            self._settle()
        self.updates[-1] = replace(self.updates[-1], stall_s=time.monotonic() - t0)

    def _push_from_memory(self, model: Any, processing_class: Any, step: int, t0: float) -> None:
        """Stage ``model`` and leave the rest to the background (module docstring)."""

        def save_extra(d: Path) -> None:
            model.config.save_pretrained(str(d))
            if processing_class is not None:
                processing_class.save_pretrained(str(d))

        staged = self._updater.push_module(
            model,
            self.checkpoint_dir / f"step-{step:06d}",
            probe=functools.partial(probe_from_checkpoint, seed=step, **self.probe),
            step=step,
            label=f"{self.run}-step{step}",
            trainer_run=self.run,
            save_extra=save_extra,
            slots=2 + self._overlap(),
        )
        self._flight.append(Staged(staged, step, t0, time.monotonic() - t0))
        if self.wait:
            self._settle()
            self.updates[-1] = replace(self.updates[-1], stall_s=time.monotonic() - t0)

    def _settle(self, keep: int = 0) -> None:
        """Wait, oldest first, until at most ``keep`` updates are in flight; raises
        UpdateFailed for one that did not succeed."""
        while len(self._flight) > keep:
            self._finish(self._flight.popleft())

    def _finish(self, flight: Submitted | Staged) -> None:
        """Wait for one update in flight to end and record how it rolled."""
        if isinstance(flight, Staged):
            staged = flight.push
            rec = staged.record(timeout_s=self.update_timeout_s)
            self.updates.append(
                Update.of(
                    rec,
                    flight.step,
                    staged.checkpoint,
                    stall_s=flight.stall_s,
                    staging_copy_s=staged.stall_s,
                )
            )
            flight = Submitted(rec, flight.pushed_at)
        rec = flight.record
        done = self._updater.wait(rec["id"], timeout_s=self.update_timeout_s)
        windows = {
            rid: float(r["window_s"])
            for rid, r in done["replicas"].items()
            if r.get("window_s") is not None
        }
        for i, u in enumerate(self.updates):
            if u.update_id == rec["id"]:
                rolled = time.monotonic() - flight.pushed_at
                self.updates[i] = replace(u, rolled_s=rolled, windows_s=windows)

    def _save(self, model: Any, processing_class: Any, step: int) -> Path:
        out = self.checkpoint_dir / f"step-{step:06d}"
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        if processing_class is not None:
            processing_class.save_pretrained(str(tmp))
        tmp.rename(out)
        return out


class _PoolCallback(TrainerCallback):
    """Pushes the trainer's weights to the updater (main process only)."""

    def __init__(self, link: PoolLink) -> None:
        self.link = link

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self.link._start(kw["model"], kw.get("processing_class"), int(state.global_step))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        step = int(state.global_step)
        if state.is_world_process_zero and step % self.link.push_every == 0:
            self.link._push(kw["model"], kw.get("processing_class"), step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self.link._settle()
