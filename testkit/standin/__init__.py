"""A stand-in vLLM server: hundreds of cheap fake replicas for scale tests and benchmarks.

It speaks the subset of vLLM 0.32's HTTP API that RolloutPool uses (health, version, models,
metrics, pause/resume/is_paused, the cache resets, ``collective_rpc reload_weights``, weight
labels, ``abort_requests``, completions, chat completions and ``/inference/v1/generate``,
streamed or not, with ``weight_versions`` spans) with vLLM 0.32's semantics, pinned against a
real vLLM CPU server by ``tests/integration/test_standin_conformance.py``. It runs no model:

* what it generates depends deterministically on the checkpoint loaded (marker models emit their
  marker; any other checkpoint a pseudo-random function of its bytes and the prompt), and
  :func:`expected_tokens` gives the greedy output for a validation probe (:mod:`.weights`);
* how fast is a :class:`TimeModel` (tokens/s per request and per replica, transfer and start-up
  seconds), changeable at runtime (:mod:`.engine`);
* :class:`Faults` (hang, hang some paths, slow health, stuck transfer, failing reload) and the
  actions die / restart are set from Python or, for another process, the fleet's admin
  endpoint (:mod:`.fleet`).

Use::

    async with StandinFleet() as fleet:
        reps = await fleet.add_many(ReplicaConfig(model=ckpt) for _ in range(64))
        reps[3].faults = Faults(hang_paths=frozenset({"/collective_rpc"}))

or, as a process: ``python -m testkit.standin --count 128 --base-port 9000`` (``--help``).

Cost (``bench/standin_cost.py``, ``bench/results/standin_cost.json``; 2-core box):
MEASUREMENTS_PENDING
"""

from testkit.standin.engine import TimeModel
from testkit.standin.fleet import StandinFleet
from testkit.standin.server import Faults, ReplicaConfig, StandinReplica
from testkit.standin.weights import expected_tokens, load_weights

__all__ = [
    "Faults",
    "ReplicaConfig",
    "StandinFleet",
    "StandinReplica",
    "TimeModel",
    "expected_tokens",
    "load_weights",
]
