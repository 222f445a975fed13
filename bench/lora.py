"""``python -m bench.lora``: LoRA generations (:mod:`testkit.scenarios.lora`) on 2 real vLLM CPU
replicas, then the same policies as merged full-weight pushes to replicas of the same base (a
rolling, drained update each); writes ``bench/results/lora.json``. Each run alternates a steady
phase and an update phase ``--rounds`` times (5 by default: 2 pushes a round).

Top-level fields: ``updates``, ``throughput_through_updates_over_steady``,
``push_to_all_admitting_s`` (the worst push of those without ``lora_checksums``, the
product's default; ``push_to_all_admitting_median_s``; the same of the pushes with it, which
alternate with them: ``push_to_all_admitting_with_checksums_s`` and its median; and
``observed_push_to_all_admitting_s`` as a poller saw it: :func:`testkit.scenarios.lora.push`),
``cross_generation``,
``stale_prefix_hits_across_adapters`` (all of the LoRA run) and
``full_weight_throughput_over_steady`` (the full-weight run); ``lora`` and ``full_weight``
hold both runs whole.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from bench._meta import write
from testkit.scenarios.lora import Params, scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--gap-s", type=float, default=2.0, help="seconds between pushes")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--rounds", type=int, default=5, help="steady and update phases alternate this many times"
    )
    ap.add_argument("--no-full-weight", action="store_true", help="skip the comparison run")
    args = ap.parse_args()
    runs: dict[str, Any] = {}
    for mode in ("lora",) if args.no_full_weight else ("lora", "weights"):
        p = Params(
            mode=mode,
            updates=args.updates,
            gap_s=args.gap_s,
            steady_s=args.updates // args.rounds * args.gap_s,  # as long as an update phase
            concurrency=args.concurrency,
            rounds=args.rounds,
        )
        with tempfile.TemporaryDirectory(prefix=f"lora-{mode}-") as d:
            runs[mode] = asyncio.run(scenario(p, Path(d)))
        print(mode, {k: v for k, v in runs[mode].items() if not isinstance(v, dict | list)})
    lora = runs["lora"]
    full = runs.get("weights")
    pushes = list(zip(lora["push_to_all_admitting_s_each"], lora["checksums_each"], strict=True))
    plain = [s for s, on in pushes if not on and s is not None]
    checked = [s for s, on in pushes if on and s is not None]
    result = {
        "updates": lora["updates"],
        "throughput_through_updates_over_steady": lora["throughput_through_updates_over_steady"],
        "throughput_over_steady_by_round": lora["throughput_over_steady_by_round"],
        "push_to_all_admitting_s": max(plain, default=None),
        "push_to_all_admitting_median_s": median(plain) if plain else None,
        "push_to_all_admitting_with_checksums_s": max(checked, default=None),
        "push_to_all_admitting_with_checksums_median_s": median(checked) if checked else None,
        "observed_push_to_all_admitting_s": lora["observed_push_to_all_admitting_s"],
        "cross_generation": lora["cross_generation"] + (full["cross_generation"] if full else 0),
        "stale_prefix_hits_across_adapters": lora["stale_prefix_hits_across_adapters"],
        "full_weight_throughput_over_steady": (
            full["throughput_through_updates_over_steady"] if full else None
        ),
        "full_weight_push_to_all_admitting_s": full["push_to_all_admitting_s"] if full else None,
        "min_admitting_replicas": lora["min_admitting_replicas"],
        "full_weight_min_admitting_replicas": full["min_admitting_replicas"] if full else None,
        "lora": lora,
        "full_weight": full,
    }
    write("lora", result)
    print({k: v for k, v in result.items() if not isinstance(v, dict)})


if __name__ == "__main__":
    main()
