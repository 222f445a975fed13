"""``python -m bench.stale_cache``: the stale-cache proof on real vLLM CPU servers
(:mod:`testkit.scenarios.stale_cache`); writes ``bench/results/stale_cache_cpu.json``."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._meta import write
from pool.paths import default_cache_root
from testkit.redis_server import RedisServer
from testkit.scenarios.stale_cache import (
    Checkpoints,
    make_specs,
    run_scenario,
    start_servers,
    stop_servers,
)

# ---------------------------------------------------------------------------------------------
# CLI


def summary(result: dict[str, Any]) -> str:
    u, p, b, t = result["unsafe"], result["pool"], result["bad_checkpoints"], result["timings"]
    lines = [
        f"unsafe reload (no pause, no reset): stale_hits={u['stale_hits']} "
        f"matches_reference={u['matches_reference']} (matches A: {u['matches_checkpoint_a']}; "
        f"SHORT = B: {u['short_matches_reference']}); reload {t['unsafe_reload_ms']} ms",
        f"pool cycle g0->g1: stale_hits={p['stale_hits']} (salt {p['salt']}) "
        f"unsalted={p['stale_hits_unsalted']} matches_reference={p['matches_reference']}/"
        f"{p['matches_reference_unsalted']}; fresh repeat hits {p['fresh_hits_after']}; "
        f"cycle {t['cycle_total_s']} s, window {t['cycle']['window_s']} s",
        f"bad checkpoints: tried={b['tried']} refused={b['refused']} "
        f"poisoned={b['engines_poisoned']} ("
        + ", ".join(f"{d['case']}: {d['outcome']}" for d in b["details"])
        + ")",
        f"servers started in {t['server_start_s']} s; verdict ok={result['verdict']['ok']}",
    ]
    return "\n".join(lines)


async def _amain(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    ckpts = await asyncio.to_thread(Checkpoints.ensure)
    root = default_cache_root() / "bench"
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stale-cache-", dir=root))
    ok = False
    try:
        with RedisServer(work / "redis") as redis:
            x_spec, r_spec = make_specs(ckpts, work)
            x, r = await start_servers(x_spec, r_spec)
            try:
                result = await run_scenario(x, r, ckpts, redis.url, scratch=work)
            finally:
                await stop_servers(x, r)
        result["timings"]["total_s"] = round(time.monotonic() - t0, 2)
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work dir (server logs) kept: {work}", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.stale_cache", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--keep", action="store_true", help="keep the work dir (server logs)")
    ap.add_argument("--no-write", action="store_true", help="do not write the result file")
    args = ap.parse_args(argv)
    result = asyncio.run(_amain(args))
    if not args.no_write:
        write("stale_cache_cpu", result)
    print(summary(result))
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
