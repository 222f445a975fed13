"""The strategies benchmark (``bench/strategies.py``): one asynchronous RL workload, five ways
of updating the replicas' weights (stop-the-world, keep, abort + resubmit, the pool strict and
the pool at ``max_staleness`` 1), run interleaved on the same replicas.

* :mod:`.models` — marker checkpoints that also emit EOS with a fixed per-token probability at
  temperature 1 (geometric output lengths nobody knows in advance);
* :mod:`.workload` — samples, their policy accounting (pure), the rollout clients and the
  trainer loop;
* :mod:`.drivers` — the five strategies: the three baselines drive vLLM's native endpoints on
  the replicas directly; the pool ones start Redis, an updater and a router in front of them;
* :mod:`.report` — the per-strategy figures, the ratios and the figure.
"""
