"""``python -m testkit.standin``: serve N stand-in replicas from this process until SIGINT/TERM.

Prints one URL per line once every replica listens (and writes them as JSON to ``--urls-file``
with the admin URL), then serves. Example::

    python -m testkit.standin --count 128 --base-port 9000 --admin-port 8999 \\
        --request-tps 200 --replica-tps 2000 --transfer-s 0.5 --urls-file /tmp/standins.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import signal
import sys
from pathlib import Path

from testkit.standin.engine import TimeModel
from testkit.standin.fleet import StandinFleet
from testkit.standin.process import new_event_loop
from testkit.standin.server import ReplicaConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m testkit.standin", description=__doc__)
    ap.add_argument("--count", type=int, default=1, help="number of replicas")
    ap.add_argument("--base-port", type=int, default=0, help="replica i listens on base+i (0: any)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--admin-port", type=int, default=None, help="admin endpoint port (0: any)")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: tiny A)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--version", default="0.32.0", help="the vLLM version to pretend to be")
    ap.add_argument("--chat-template", type=Path, default=None, help="a Jinja template file")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--request-tps", type=float, default=None, help="tokens/s per request")
    ap.add_argument("--replica-tps", type=float, default=None, help="tokens/s per replica")
    ap.add_argument("--transfer-s", type=float, default=0.0, help="reload_weights seconds")
    ap.add_argument("--startup-s", type=float, default=0.0, help="(re)start seconds")
    ap.add_argument(
        "--stream-per-token", action="store_true", help="one SSE event per token, as vLLM"
    )
    ap.add_argument("--uvloop", action="store_true", help="serve on uvloop if it is installed")
    ap.add_argument("--urls-file", type=Path, default=None)
    return ap.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    if args.model is None:
        from rolloutpool.local.models import ensure_model

        args.model = ensure_model("random", seed=1)
    template = args.chat_template.read_text() if args.chat_template else None
    time = TimeModel(
        request_tokens_per_s=args.request_tps,
        replica_tokens_per_s=args.replica_tps,
        transfer_s=args.transfer_s,
        startup_s=args.startup_s,
    )
    configs = [
        ReplicaConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            version=args.version,
            host=args.host,
            port=args.base_port + i if args.base_port else 0,
            max_model_len=args.max_model_len,
            chat_template=template,
            time=time,
            stream_per_token=args.stream_per_token,
        )
        for i in range(args.count)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with StandinFleet(admin_port=args.admin_port, admin_host=args.host) as fleet:
        await fleet.add_many(configs)
        if args.urls_file is not None:
            doc = {"urls": fleet.urls, "admin": fleet.admin_url, "model": configs[0].model_name}
            args.urls_file.write_text(json.dumps(doc, indent=1))
        print("\n".join(fleet.urls), flush=True)
        if fleet.admin_url:
            print(f"admin {fleet.admin_url}", file=sys.stderr, flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # many replicas, many sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args = parse_args(argv)
    with asyncio.Runner(loop_factory=new_event_loop if args.uvloop else None) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
