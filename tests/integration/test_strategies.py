"""The strategies benchmark's segment (``bench/strategies.py``) on 2 stand-in replicas: every
strategy runs its trainer steps to the end on the same replicas, its samples are accounted for
by policy, and the contract-bearing ones never mix policies: stop-the-world (by construction:
it waits for every sample in flight), and the pool strict and at ``max_staleness`` 1 (0 mixed,
0 cross-generation, every sample bound to a published generation). The stand-ins pretend to be
vLLM 0.32 (spans) and 0.26 (no spans, no labels: the baselines' tokens are read by marker, as on
the GPU host)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from testkit.procs import terminate
from testkit.scenarios.scale import _spawn
from testkit.scenarios.strategies.models import eos_marker
from testkit.scenarios.strategies.report import STRATEGIES, row
from testkit.scenarios.strategies.segment import Params, run_segment

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("version", ["0.32.0", "0.26.0"])
def test_every_strategy_on_the_same_two_standins(tmp_path: Path, version: str) -> None:
    p = Params(
        concurrency=8, batch=4, steps=2, train_s=0.5, warmup_s=1.5,
        max_tokens=64, eos_prob=1 / 16, metrics_every_s=0.25,
    )  # fmt: skip
    urls_file = tmp_path / "urls.json"
    proc = _spawn(
        [sys.executable, "-m", "testkit.standin", "--count", "2",
         "--model", str(eos_marker(0, p.eos_prob)), "--urls-file", str(urls_file),
         "--request-tps", "400", "--replica-tps", "1000", "--transfer-s", "0.1",
         "--version", version],
        tmp_path / "standin.log",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not urls_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "stand-ins did not start"
            time.sleep(0.1)
        urls = json.loads(urls_file.read_text())["urls"]
        for strategy in STRATEGIES:
            seg = asyncio.run(run_segment(strategy, urls, p, tmp_path, seed=1))
            assert not seg.error, (strategy, seg.error, seg.logs)
            r = row([seg])
            assert r["samples"] > 0 and r["session_samples"] > 0, (strategy, r)
            assert r["trainer_wait_timeouts"] == 0, (strategy, r["trainer_wait_s_all"])
            assert r["cross_generation_samples"] == 0, strategy
            assert r["client_errors"] == {}, (strategy, r["client_errors"])
            assert seg.book.step == 2
            policies = {s.policy for s in seg.book.samples if not s.mixed}
            assert 2 in policies, (strategy, policies)  # the last step's policy was generated
            if strategy in ("stop_the_world", "pool_strict", "pool_staleness1"):
                assert r["mixed_samples"] == 0, strategy
            if strategy.startswith("pool"):
                assert all(s.bound is not None and s.policies <= {s.bound}
                           for s in seg.book.samples)  # fmt: skip
                assert r["pool_settings"]["max_staleness"] == (strategy == "pool_staleness1")
                assert [u["state"] for u in r["pool_updates"]] == ["succeeded"] * 2
            if strategy == "abort_resubmit":
                assert r["wasted_prefill_tokens"] >= 0 and r["resubmits"] >= 0
    finally:
        terminate(proc)
