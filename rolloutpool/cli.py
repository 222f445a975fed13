"""``rolloutpool`` — up | status | push | demo.

* ``up [--config pool.yaml] [--provider local|ray] [--ray-address ADDR]``: start the embedded
  pool (local redis-server, N vLLM CPU replicas as local processes or Ray actors, updater,
  router) and serve until Ctrl-C.
* ``status [--router URL]``: replicas, states, generations and active rollouts.
* ``push CHECKPOINT [--updater URL --token T --step N --label L]``: compute the validation probe
  from the checkpoint (transformers, CPU) and push it; waits for the rolling update unless
  ``--no-wait``.
* ``demo``: bring up the embedded pool and run a tiny RL loop through it (see
  :mod:`rolloutpool.demo`); writes ``bench/results/demo.json`` and ``demo.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from rolloutpool.embedded import EmbeddedPool, PoolConfig


def _config(path: Path | None, **overrides: Any) -> PoolConfig:
    """The YAML at ``path`` (if any) with the command line's ``overrides`` (None: not given)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(path.read_text()) or {}
    if overrides.get("provider") is not None:
        data["provider"] = overrides["provider"]
    if overrides.get("ray_address") is not None:
        data.setdefault("ray", {})["address"] = overrides["ray_address"]
    return PoolConfig(**data)


async def _up(config: PoolConfig) -> None:
    pool = EmbeddedPool(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await pool.start()
        print("pool is up; Ctrl-C stops it", flush=True)
        await stop.wait()
    finally:
        print("stopping ...", flush=True)
        await pool.stop()


def _status(router: str) -> int:
    try:
        pool = httpx.get(f"{router}/v1/pool", timeout=5).json()
    except httpx.HTTPError as e:
        print(f"cannot reach the router at {router}: {e}", file=sys.stderr)
        return 2
    latest = pool.get("latest") or {}
    print(f"published generation: {latest.get('generation', '-')} ({latest.get('label', '-')})")
    print(f"{'replica':<12} {'state':<13} {'gen':>4} {'label':<10} {'active':>6}  url")
    for r in pool.get("replicas", []):
        gen = "-" if r.get("generation") is None else r["generation"]
        print(
            f"{r['replica_id']:<12} {r['state']:<13} {gen:>4} {r.get('label') or '-':<10} "
            f"{r.get('active', 0):>6}  {r.get('url', '')}"
        )
    return 0


def _push(args: argparse.Namespace) -> int:
    from updater.client import UpdateFailed, UpdaterAPIError, UpdaterClient
    from updater.probe import probe_from_checkpoint

    ckpt = Path(args.checkpoint).resolve()
    print(f"computing the validation probe of {ckpt} ...", flush=True)
    probe = probe_from_checkpoint(ckpt, margin=args.margin)
    with UpdaterClient(args.updater, args.token) as client:
        try:
            rec = client.push(ckpt, probe=probe, step=args.step, label=args.label)
            print(f"queued {rec['id']}: generation {rec['generation']} ({rec['label']})")
            if not args.no_wait:
                rec = client.wait(rec["id"], timeout_s=args.timeout)
                print(json.dumps(rec, indent=2))
        except (UpdaterAPIError, UpdateFailed) as e:
            print(f"push failed: {e}", file=sys.stderr)
            return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rolloutpool import demo
    from rolloutpool.results import write

    config = _config(args.config)
    if args.config is None:
        config = config.model_copy(
            update={
                "model_init_std": 0.02,  # a near-uniform policy: room to learn
                "fresh": True,  # every demo starts from generation 0
                "workdir": config.workdir.parent / "demo",
                "router_port": args.router_port,
                "updater_port": args.updater_port,
            }
        )
    cfg = demo.DemoConfig(steps=args.steps, push_every=args.push_every)
    results = Path(args.results)
    result = asyncio.run(demo.run(cfg, config, results))
    write("demo", result, results)
    ok = result["cross_generation"] == 0 and result["reward_last"] > result["reward_first"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rolloutpool", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the embedded pool and serve until Ctrl-C")
    up.add_argument("--config", type=Path)
    up.add_argument("--provider", choices=["local", "ray"], help="who runs the replicas")
    up.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS / auto)")
    st = sub.add_parser("status", help="show replicas and generations")
    st.add_argument(
        "--router", default=os.environ.get("ROLLOUTPOOL_ROUTER", "http://127.0.0.1:8000")
    )
    pu = sub.add_parser("push", help="push a checkpoint to the updater")
    pu.add_argument("checkpoint")
    pu.add_argument(
        "--updater", default=os.environ.get("ROLLOUTPOOL_UPDATER", "http://127.0.0.1:8300")
    )
    pu.add_argument("--token", default=os.environ.get("ROLLOUTPOOL_ADMIN_TOKEN"))
    pu.add_argument("--step", type=int)
    pu.add_argument("--label")
    pu.add_argument("--margin", type=float, default=2e-3)
    pu.add_argument("--timeout", type=float, default=600.0)
    pu.add_argument("--no-wait", action="store_true")
    de = sub.add_parser("demo", help="embedded pool + a tiny RL loop through it")
    de.add_argument("--config", type=Path)
    de.add_argument("--steps", type=int, default=30)
    de.add_argument("--push-every", type=int, default=2)
    de.add_argument("--router-port", type=int, default=0)
    de.add_argument("--updater-port", type=int, default=0)
    de.add_argument("--results", default=str(Path.cwd() / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.cmd == "up":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(
                _up(_config(args.config, provider=args.provider, ray_address=args.ray_address))
            )
        code = 0
    elif args.cmd == "status":
        code = _status(args.router)
    elif args.cmd == "push":
        code = _push(args)
    else:
        code = _demo(args)
    sys.exit(code)


if __name__ == "__main__":
    main()
