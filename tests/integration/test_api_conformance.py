"""Both services' OpenAPI documents against the running services: schemathesis with every check
(``-c all``), a fixed seed and a bounded number of examples per operation, authenticated, on a
real embedded pool (local redis-server, one vLLM CPU replica, the updater and the router).

Zero failures means: every status, header, content type and body is what the document
declares; a request the document calls valid is accepted and one it calls invalid refused
(with the two declared exceptions below); every 405 says ``Allow``. Afterwards no binding is
left active: sessions the fuzzer opened are closed by it or end with their (2 s) lease.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pool.settings import StoreSettings
from pool.store import RedisStore
from rolloutpool.embedded import EmbeddedPool, PoolConfig

pytestmark = pytest.mark.integration

ADMIN, KEY = "conformance-admin", "conformance-client"
SESSION_LEASE_S = 2.0
EXAMPLES, SEED = 25, 21

# What a schema cannot declare, and why (answers about the world, not about the request):
# * POST /v1/updates: the preflight reads the checkpoint from disk; a well-formed path that
#   holds no checkpoint of the pool's architecture is refused with 422 preflight_failed.
# * the inference routes: the router documents only the body fields it reads; the replica
#   validates the rest (vLLM's own request schema) and its 400/422 is passed through.
# * an undeclared request header does not make a request invalid (schemathesis sends one and
#   expects a refusal); the inference bodies are open objects anyway.
# * the admin route is fuzzed with the admin token, but not in stateful sequences: they would
#   taint the one replica (found in /v1/pool) and restart it mid-run.
# * the router is a proxy: 502 (replica failed), 503 (no replica admissible now, e.g. while
#   one is tainted or restarting) and 504 (replica too slow) are documented answers; 500 is not.
CONFIG = {
    "updater": """
[[operations]]
include-path = "/v1/updates"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "409", "422", "5xx"]
""",
    "router": """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "502", "503", "504"]

[[operations]]
include-path = "/v1/admin/replicas/{replica_id}/taint"
headers = { Authorization = "Bearer %s" }
phases.stateful.enabled = false

[[operations]]
include-path = ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"]
generation.allow-extra-parameters = false
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "422", "429", "5xx",
]
""",
}


def schemathesis(service: str, base_url: str, token: str, workdir: Path) -> dict[str, Any]:
    """One schemathesis run against ``base_url``; its JSON report plus the console text."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG[service].replace("%s", ADMIN))
    report = workdir / "report.json"
    argv = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{base_url}/openapi.json",
        "--url",
        base_url,
        "--checks",
        "all",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(SEED),
        "--header",
        f"Authorization: Bearer {token}",
        "--request-timeout",
        "30",
        "--suppress-health-check",
        "all",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    text = out.stdout + out.stderr
    (workdir / "console.txt").write_text(text)
    data: dict[str, Any] = json.loads(report.read_text()) if report.exists() else {}
    return {"exit_code": out.returncode, "report": data, "text": text}


async def active_bindings(store: RedisStore) -> int:
    """Bindings still active: counted on the replicas and in the lease index."""
    return sum(r.active for r in await store.replicas()) + await store.leased_rollouts()


@pytest.mark.timeout(420)
async def test_both_documents_match_behaviour(tmp_path: Path) -> None:
    config = PoolConfig(
        workdir=tmp_path / "pool",
        replicas=1,
        router_port=0,
        updater_port=0,
        admin_token=ADMIN,
        api_keys=[KEY],
        router={
            "session_lease_s": SESSION_LEASE_S,
            "reaper_interval_s": 0.5,
            "admission_wait_s": 0.5,
        },
    )
    pool = await EmbeddedPool(config, progress=lambda _: None).start()
    assert pool.redis is not None
    store = RedisStore.connect(StoreSettings(url=pool.redis.url, namespace=config.namespace))
    try:
        runs = {
            name: await asyncio.to_thread(schemathesis, name, url, token, tmp_path / name)
            for name, url, token in (
                ("updater", pool.updater_url, ADMIN),
                ("router", pool.router_url, KEY),
            )
        }
        # every session the fuzzer opened ends by its lease at the latest
        deadline = time.monotonic() + SESSION_LEASE_S + 10
        while (left := await active_bindings(store)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await store.close()
        await pool.stop()
    for name, run in runs.items():
        report = run["report"]
        assert report, f"{name}: no report\n{run['text'][-3000:]}"
        cases = report["test_cases"]
        assert cases["generated"] > 0, name
        assert (cases["unique_failures"], report["errors"]) == (0, []), (
            f"{name}:\n{run['text'][-6000:]}"
        )
        assert run["exit_code"] == 0, f"{name}:\n{run['text'][-3000:]}"
        # authenticated: no operation answered only 401/403
        assert report["warnings"]["missing_auth"] == [], name
    assert left == 0, f"{left} binding(s) still active"
