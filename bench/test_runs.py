"""``python -m bench.test_runs [--loaded] [--commit REV] [--times N]``: the README's test command
on a clean clone, timed, appended to ``bench/results/test_runs.json``.

Each run clones the repository and checks out ``REV`` (default ``HEAD``, resolved once when the
command starts, so commits made meanwhile do not change what ``--times N`` consecutive runs
test) in a fresh directory (so the run installs its own
``.venv``, as CI does), runs ``bash scripts/test.sh`` there and records ``{commit, rc,
seconds, loaded}``. With ``--loaded`` the machine is kept busy meanwhile by ``stress-ng --cpu
<cores>`` (Debian's ``stress-ng``, installed if missing): every core saturated beside the suite,
which is what a test that depends on timing or load does not survive.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._meta import RESULTS, write

REPO = Path(__file__).resolve().parent.parent
COMMAND = "bash scripts/test.sh"


def _stress(cores: int) -> subprocess.Popen[bytes]:
    if shutil.which("stress-ng") is None:
        subprocess.run(["apt-get", "install", "-y", "-qq", "stress-ng"], check=True)
    return subprocess.Popen(
        ["stress-ng", "--cpu", str(cores), "--timeout", "7200s", "--quiet"],
        start_new_session=True,
    )


def run_once(commit: str, loaded: bool, log: Path) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="test-run-") as d:
        clone = Path(d) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        stress = _stress(cores) if loaded else None
        t0 = time.monotonic()
        try:
            with log.open("wb") as out:
                rc = subprocess.run(
                    ["bash", "scripts/test.sh"], cwd=clone, stdout=out, stderr=subprocess.STDOUT
                ).returncode
        finally:
            if stress is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(stress.pid, 9)
                stress.wait()
        seconds = round(time.monotonic() - t0, 1)
    return {
        "commit": commit,
        "rc": rc,
        "seconds": seconds,
        "loaded": loaded,
        "load": f"stress-ng --cpu {cores}" if loaded else None,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "log_tail": log.read_text(errors="replace").splitlines()[-3:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.test_runs")
    ap.add_argument("--loaded", action="store_true", help="saturate every core meanwhile")
    ap.add_argument("--log", type=Path, default=Path("/tmp/test_run.log"))
    ap.add_argument("--commit", default="HEAD", help="the revision to test (default HEAD)")
    ap.add_argument("--times", type=int, default=1, help="runs one after another (logs -1, -2..)")
    args = ap.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", args.commit], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    path = RESULTS / "test_runs.json"
    for i in range(args.times):
        log = args.log if args.times == 1 else args.log.with_stem(f"{args.log.stem}-{i + 1}")
        run = run_once(commit, args.loaded, log)
        print(json.dumps(run, indent=1), flush=True)
        old = json.loads(path.read_text()) if path.exists() else {}  # as it is now
        write(
            "test_runs",
            {
                **old,  # sections other runs and measurements wrote (``diagnostics``) stay
                "test_command": COMMAND,
                "on": "a clean clone of the commit (its own .venv installed by the command, "
                "as in CI)",
                "load_used": "stress-ng --cpu <cores> for the whole run (runs with loaded=true)",
                "goal_s": 1800,
                "runs": [*old.get("runs", []), run],
            },
        )


if __name__ == "__main__":
    main()
