"""``python -m bench.reliability``: replica faults, Redis outages and fuzzing
(:mod:`testkit.scenarios.reliability`); merges its sections into
``bench/results/reliability.json``."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench.soak import merge_reliability
from testkit.scenarios.reliability import scenario


def main() -> None:

    ap = argparse.ArgumentParser()
    ap.add_argument("--fuzz-examples", type=int, default=25)
    ap.add_argument(
        "--only",
        choices=["faults", "outage", "fuzz"],
        nargs="+",
        default=["faults", "outage", "fuzz"],
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="reliability-") as d:
        result = asyncio.run(
            scenario(
                Path(d),
                fuzz_examples=args.fuzz_examples,
                faults="faults" in args.only,
                outage="outage" in args.only,
                fuzzing="fuzz" in args.only,
            )
        )
    for section, value in result.items():
        merge_reliability(section, value)
    print(
        json.dumps(
            {
                k: {kk: vv for kk, vv in v.items() if "tail" not in kk and kk != "outcomes"}
                for k, v in result.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
