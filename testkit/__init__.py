"""RolloutPool's test kit: everything tests and benchmarks need besides the product itself.

One layer, with one rule: the product (``pool``, ``router``, ``updater``, ``rolloutpool``) never
imports it (a unit test, ``tests/unit/test_layers.py``, checks every import), and its wheel does
not ship it: tests and benchmarks import it from the checkout. Tests never import ``bench`` and
nothing imports ``tests``. The tiny models tests build are the product's
(:mod:`rolloutpool.local.models`).

* :mod:`testkit.redis_server` — the embedded pool's local ``redis-server`` launcher (AOF),
  re-exported.
* :mod:`testkit.harness` — act as the updater (label, register, publish), serve the router.
* :mod:`testkit.fault_proxy` — an HTTP proxy that can stall a replica's control calls.
* :mod:`testkit.loop_stalls` — how long the event loop could not run: the measured margin of a
  timing assertion.
* :mod:`testkit.standin` — a stand-in vLLM 0.32 server: hundreds of cheap fake replicas in one
  process (time model, fault switches, admin endpoint, CLI), conformance-tested against real
  vLLM (``tests/integration/test_standin_conformance.py``).
* :mod:`testkit.scenarios` — the long scenarios (stale cache, rolling updates under load,
  reliability); ``bench/`` runs them in full, ``tests/integration`` in short versions.
"""
