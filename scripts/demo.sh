#!/usr/bin/env bash
# The README's first command: installs what it needs, then runs `rolloutpool demo` — a local
# redis-server, 2 vLLM CPU replicas of a tiny locally built model, the router and the updater,
# and a small REINFORCE loop whose rollouts go through the router while the updater rolls each
# new checkpoint over the replicas. Writes bench/results/demo.json and bench/results/demo.png.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null; then
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q -e '.[cpu,demo]'
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
exec .venv/bin/rolloutpool demo "$@"
