"""RolloutPool's router: the data plane rollout clients talk to (aiohttp, stateless, many).

It is a drop-in OpenAI-compatible endpoint (``/v1/completions``, ``/v1/chat/completions``,
``/inference/v1/generate``, ``/v1/models``) that admits every rollout to a replica that is
``READY`` on an admissible generation (one atomic Redis script, I1), forwards it with that
generation's ``cache_salt``, checks vLLM's ``weight_versions`` spans where present (I7), and
ends the binding exactly once with a provenance record. Nothing but the routes below is
reachable; vLLM's control endpoints are not.

Modules (read in this order):

* :mod:`router.settings` — ``RouterSettings`` (env ``ROLLOUTPOOL_ROUTER_*``)
* :mod:`router.app` — ``create_app(settings, store_settings)``, resources (serve it with
  :func:`pool.web.start_server`)
* :mod:`router.proxy` — forwarding: the request's path and the outcome of each request
* :mod:`router.answers` — the replica's answer passed on (whole or SSE), span check, settling
* :mod:`router.admission` — constraints, the cached pool view, ordering and admitting
* :mod:`router.sessions` — ``/v1/rollouts`` (multi-request rollouts) and provenance records
* :mod:`router.limits` — what a client may hold: requests in flight, the terms of its rollouts
  (owner, a session's maximum age and idle limit, its session quota), a request's deadline
* :mod:`router.bindings` — releasing (shielded, retried) and lease renewal
* :mod:`router.provenance` — the ``rollout`` object, ``X-Rollout-*`` headers, span check
* :mod:`router.upstream` — the pooled client session and the replicas' model ids
* :mod:`router.status` — ``/v1/models``, admin taint
* :mod:`router.dashboard` — ``/dashboard`` (grid, timelines, rates) and ``/dashboard/data``
* :mod:`router.failover` — bindings verified in every new Redis failover epoch
* :mod:`router.workers` — ``--workers N``: SO_REUSEPORT worker processes
* :mod:`router.auth` (the router's auth policy, rate limit), :mod:`router.errors` (502/503/504),
  :mod:`router.keys`, :mod:`router.openapi`

Errors, auth rules, JSON, ``/v1/pool``, ``/healthz``, ``/metrics`` and serving come from the HTTP
kit shared with the updater, :mod:`pool.web`.
"""

from router.app import create_app
from router.settings import RouterSettings

__all__ = ["RouterSettings", "create_app"]
