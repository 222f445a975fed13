"""Where RolloutPool's router spends its CPU per request: py-spy on the running router.

:func:`profile` loads the router alone (non-streamed requests to the instant stand-in, closed loop
at ``concurrency``) while ``py-spy record --format raw`` samples it (it pauses the router for
each sample, so stacks are whole; ``--nonblocking`` left a quarter of them without their root).
Only on-CPU samples count (py-spy leaves out idle threads), so a sample is CPU time. Each sample
is attributed twice:

* a **phase**: the innermost frame of the stack that names a step of the request path
  (:data:`PHASES`: the ADMIT round trip, RELEASE, the body, the upstream call, ...); samples
  under no such frame are Redis commands in redis-py's own tasks, aiohttp's server machinery
  or the bare event loop;
* a **mechanism**: the library of the innermost frame that is not event-loop plumbing
  (redis-py, json, aiohttp client/server, prometheus_client, uuid, the router's own lines, ...).

Shares times the router's CPU per request (``/proc``, same window) give microseconds per
request. py-spy samples Python frames only: time in C extensions (aiohttp's HTTP parser, the
json C accelerator, hiredis) counts toward the Python frame that called them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._proc import CpuMeter

ADMIT = "admit: choose a replica + the ADMIT round trip"
FORWARD = "forward: upstream body (JSON) + aiohttp client request (incl. its writer task)"
RELEASE = "release: the RELEASE round trip (before the answer is delivered)"
PHASES: dict[str, str] = {
    "RedisStore.admit": ADMIT,
    "Admitter._admit_one": ADMIT,
    "Admitter.admit": ADMIT,
    "RedisStore.release": RELEASE,
    "Bindings.end": RELEASE,
    "Bindings.release": RELEASE,
    "RedisStore.touch": "lease renewer (background)",
    "Bindings.renew_forever": "lease renewer (background)",
    "Bindings.renewing": "lease renewer bookkeeping (per request)",
    "ReplicaView._load": "cached replica view refresh (every 0.25 s)",
    "RedisStore.replicas": "cached replica view refresh (every 0.25 s)",
    "RedisStore.latest": "cached replica view refresh (every 0.25 s)",
    "RedisStore.reap_expired": "reaper (background)",
    "read_json_object": "read + parse the client's JSON body",
    "new_rollout_id": "uuid4 rollout id",
    "Constraints.from_headers": "constraints + affinity key",
    "affinity_key": "constraints + affinity key",
    "ReplicaCatalog.info": "replica catalog lookup",
    "_whole": "answer: parse the upstream JSON, check, add rollout, serialize",
    "forward": FORWARD,
    "ClientRequest.write_bytes": FORWARD,
    "ResponseHandler.data_received": "aiohttp client: read + parse the upstream answer",
    "RequestHandler.data_received": "aiohttp server: read + parse the client's HTTP request",
    "RequestHandler.finish_response": "aiohttp server: write the answer to the client",
    "Timings.header": "Server-Timing header",
    "run_settled": "handler and settlement (own code)",
    "handle_inference": "handler and settlement (own code)",
    "timing_middleware.<locals>.timing": "middlewares (errors, timing metric, auth, rate limit)",
    "error_middleware.<locals>.middleware": "middlewares (errors, timing metric, auth, rate limit)",
}
OUTSIDE = "aiohttp server + event loop, no request step on the stack (dispatch, scheduling)"
REDIS_TASK = (
    "Redis commands in redis-py's own tasks (asyncio.wait_for on 3.11 runs the send in a new "
    "task) and the group-commit pipelines of ADMIT and RELEASE (pool.store.batch), the view "
    "refresh, the renewer: which request is not on the stack"
)
PARTIAL = "stack without its root (py-spy could not unwind it whole): unattributed"
LOOP = "event loop (uvloop's C code or asyncio: scheduling, epoll, socket calls)"
PLUMBING = (
    "asyncio/",
    "selectors.py",
    "contextlib.py",
    "typing.py",
    "<frozen",
    "_weakrefset",
    "aiohttp/web.py",
    "router/__main__.py",
    "pool/web/server.py",
)
SYSCALL_LEAVES = (
    "_SelectorSocketTransport.write",
    "_SelectorSocketTransport._read_ready__data_received",
    "EpollSelector.select",
    "socket.send",
    "socket.recv",
)
MECHANISMS = (
    ("redis/", "redis-py (commands, connection, parsing)"),
    ("json/", "json (encode/decode)"),
    ("aiohttp/client", "aiohttp client (upstream)"),
    ("aiohttp/connector", "aiohttp client (upstream)"),
    ("aiohttp/", "aiohttp (server, HTTP writer, streams)"),
    ("prometheus_client/", "prometheus_client metrics"),
    ("logging/", "logging"),
    ("uuid", "uuid"),
    ("pydantic", "pydantic"),
    ("multidict", "yarl/multidict"),
    ("yarl", "yarl/multidict"),
    ("router/", "router code (own lines)"),
    ("pool/", "pool code (own lines)"),
)


def _frame(f: str) -> tuple[str, str]:
    """``"func (file:line)"`` -> ``(func, file)``."""
    func, _, loc = f.rpartition(" (")
    return func, loc.rsplit(":", 1)[0]


def _phase(frames: list[tuple[str, str]]) -> str:
    for func, _ in reversed(frames):
        if func in PHASES:
            return PHASES[func]
    if any(file.startswith("redis/") for _, file in frames):
        return REDIS_TASK
    if not frames[0][1].startswith("<frozen runpy>"):
        return PARTIAL
    return OUTSIDE


def _library(file: str) -> str:
    for prefix, name in MECHANISMS:
        if file.startswith(prefix):
            return name
    return Path(file).name


def _mechanism(frames: list[tuple[str, str]]) -> str:
    """The library of the innermost frame that is not event-loop or stdlib plumbing."""
    for _, file in reversed(frames):
        if not file.startswith(PLUMBING):
            return _library(file)
    return LOOP


def analyse(raw: str, cpu_ms_per_request: float) -> dict[str, Any]:
    """Shares of phases and mechanisms in py-spy ``--format raw`` output."""
    phases: Counter[str] = Counter()
    mechs: Counter[str] = Counter()
    by_phase: dict[str, Counter[str]] = {}
    leaves: Counter[str] = Counter()
    syscalls: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        phase, mech = _phase(frames), _mechanism(frames)
        if frames[-1][0] in SYSCALL_LEAVES:
            syscalls[mech] += n
        phases[phase] += n
        mechs[mech] += n
        by_phase.setdefault(phase, Counter())[mech] += n
        leaves[f"{frames[-1][0]} ({frames[-1][1]})"] += n
        total += n
    if not total:
        return {"samples": 0}

    def share(n: int) -> float:
        return round(n / total, 4)

    def us(n: int) -> float:
        return round(n / total * cpu_ms_per_request * 1000, 1)

    return {
        "samples": total,
        "by_phase": [
            {
                "phase": p,
                "share": share(n),
                "us_per_request": us(n),
                "mechanisms": {m: share(k) for m, k in by_phase[p].most_common(4)},
            }
            for p, n in phases.most_common()
        ],
        "by_mechanism": [
            {"mechanism": m, "share": share(n), "us_per_request": us(n)}
            for m, n in mechs.most_common()
        ],
        "socket_syscalls": {
            "share": share(sum(syscalls.values())),
            "us_per_request": us(sum(syscalls.values())),
            "by_caller": {m: share(k) for m, k in syscalls.most_common()},
        },
        "top_leaf_functions": [{"frame": f, "share": share(n)} for f, n in leaves.most_common(15)],
    }


async def profile(
    load: Callable[[], Awaitable[tuple[int, float]]],
    pid: int,
    pyspy: Path,
    meter: CpuMeter,
    work: Path,
    concurrency: int,
    duration_s: float,
) -> dict[str, Any]:
    """Profile the router (``pid``) while ``load()`` runs (it returns (requests, seconds))."""
    out_file = work / "router.pyspy.raw"
    log = await asyncio.to_thread((work / "py-spy.log").open, "wb")
    spy = await asyncio.create_subprocess_exec(
        str(pyspy),
        "record",
        "-p", str(pid),
        "--rate", "250",
        "--duration", str(round(duration_s + 2)),
        "--format", "raw",
        "-o", str(out_file),
        stdout=log,
        stderr=log,
    )  # fmt: skip
    await asyncio.sleep(1.0)  # attached
    a = meter.snap()
    requests, _ = await load()
    w = CpuMeter.window(a, meter.snap())
    await spy.wait()
    cpu_ms = w["cpu_s"]["rolloutpool"] / requests * 1000
    raw = await asyncio.to_thread(out_file.read_text) if out_file.exists() else ""
    return {
        "how": f"py-spy record --rate 250 --format raw on python -m router while "
        f"its only load was {concurrency} concurrent non-streamed requests to the stand-in "
        f"(closed loop, {duration_s:g} s); on-CPU samples only. Attribution: phase = innermost "
        "frame that names a request step (bench/_router_profile.py PHASES); mechanism = "
        "library of the innermost frame that is not asyncio plumbing; socket_syscalls = "
        "samples whose leaf is a socket send/recv or epoll call. us_per_request = share x the "
        "router's CPU per request (/proc, same window).",
        "concurrency": concurrency,
        "requests": requests,
        "requests_per_s": round(requests / w["wall_s"], 1),
        "router_cpu_ms_per_request": round(cpu_ms, 3),
        "cpu": w,
        "py_spy_exit_code": spy.returncode,
        **analyse(raw, cpu_ms),
    }
