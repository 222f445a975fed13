"""GPU tests need the GPU host (two GPUs, the offline vLLM bundle): see ``README.md`` here.

They are marked ``gpu`` (deselected by the project's ``addopts``) and, unless
``ROLLOUTPOOL_GPU=1`` is set (``tests/gpu/gpu_env.sh`` sets it), not even collected, so CI never
imports them.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("ROLLOUTPOOL_GPU") == "1" else ["test_*.py"]
