"""RolloutPool's test kit: everything tests and benchmarks need besides the product itself.

One layer, with one rule: ``pool``, ``router`` and ``updater`` never import it (a unit test,
``tests/unit/test_layers.py``, checks every import). Tests and benchmarks import it; tests never
import ``bench`` and nothing imports ``tests``. ``rolloutpool`` (the CLI's embedded default pool
and demo) uses it for the local ``redis-server`` and the tiny model, and only there.

* :mod:`testkit.models` — tiny Llama checkpoints and their tokenizer, built offline (random,
  marker, deliberately incompatible shapes/dtypes), cached by content.
* :mod:`testkit.redis_server` — a local ``redis-server`` child process with AOF.
* :mod:`testkit.harness` — act as the updater (label, register, publish), serve the router.
* :mod:`testkit.fault_proxy` — an HTTP proxy that can stall a replica's control calls.
* :mod:`testkit.standin` — a stand-in vLLM 0.32 server: hundreds of cheap fake replicas in one
  process (time model, fault switches, admin endpoint, CLI), conformance-tested against real
  vLLM (``tests/integration/test_standin_conformance.py``).
* :mod:`testkit.scenarios` — the long scenarios (stale cache, rolling updates under load,
  reliability); ``bench/`` runs them in full, ``tests/integration`` in short versions.
"""
