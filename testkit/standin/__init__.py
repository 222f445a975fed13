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
* :class:`Faults` (hang, hang some paths, slow health, stuck transfer, failing reload; and the
  answer faults of the inference routes: error answers, dropped connections, padded bodies,
  floods of events, contradicting token ids and ``weight_versions``) and the actions die /
  restart are set from Python or, for another process, the fleet's admin endpoint
  (:mod:`.fleet`). The answer faults are what a real vLLM cannot be told to produce, so they
  are not in the conformance suite; the default behaviour, every switch off, is;
* :attr:`StandinReplica.recorded`, a recording switch, keeps the inference bodies received;
* :class:`~testkit.standin.process.StandinProcess` runs one instant replica as a child process
  (benchmarks of what sits in front of vLLM).

Use::

    async with StandinFleet() as fleet:
        reps = await fleet.add_many(ReplicaConfig(model=ckpt) for _ in range(64))
        reps[3].faults = Faults(hang_paths=frozenset({"/collective_rpc"}))

or, as a process: ``python -m testkit.standin --count 128 --base-port 9000`` (``--help``).

Cost (``python -m bench.standin_cost``, ``bench/results/standin_cost.json``; the 2-core box,
one ``python -m testkit.standin`` process, measured from ``/proc``):

* **128 replicas**: 67 MiB resident for the whole process (63 MiB with one replica: about
  0.03 MiB per extra replica); **idle CPU 0.0 %** over 20 s (no timers run without requests).
* **one replica, instant time model**, 16 concurrent closed-loop clients in another process
  (17 prompt tokens, 16 generated): 1,780 completions/s, 1,240 streamed completions/s, 2,030
  ``/inference/v1/generate``/s. The client was the limit (the server used about half a core):
  the server spends 0.26-0.36 CPU-ms per request, a ceiling near 3,000 requests/s per core.
  The same completions spread over 128 replicas of one process: 1,980/s.
"""

from testkit.standin.engine import TimeModel
from testkit.standin.fleet import StandinFleet
from testkit.standin.server import Faults, InferenceFailure, ReplicaConfig, StandinReplica
from testkit.standin.weights import expected_tokens, load_weights

__all__ = [
    "Faults",
    "InferenceFailure",
    "ReplicaConfig",
    "StandinFleet",
    "StandinReplica",
    "TimeModel",
    "expected_tokens",
    "load_weights",
]
