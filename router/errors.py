"""The router's own errors: the answers only a proxy in front of replicas gives.

::

    HttpError (pool.web.errors)
    └── RouterError                    status 500   router_error
        ├── QuotaExceeded              429          client_sessions, client_in_flight,
        │                                           session_busy (Retry-After)
        ├── NoReplicaAvailable         503          no_replica_available (Retry-After)
        ├── BindingEnded               503          binding_ended: output withheld (Retry-After)
        ├── UpstreamError              502          upstream_error, upstream_unavailable,
        │                                           provenance_violation
        └── UpstreamTimeout            504          upstream_timeout, deadline_exceeded

The 4xx answers (``BadRequest``, ``Unauthorized``, ``Forbidden``, ``RouteNotFound``,
``Conflict``, ``PayloadTooLarge``, ``RateLimited``), the status of pool errors and the error
middleware are the HTTP kit's (:mod:`pool.web.errors`), shared with the updater.
"""

from __future__ import annotations

from pool.web import HttpError


class RouterError(HttpError, status=500, code="router_error"): ...


class QuotaExceeded(RouterError, status=429, code="quota_exceeded"):
    """A client limit of :class:`~router.settings.RouterSettings` refused the request."""


class NoReplicaAvailable(RouterError, status=503, code="no_replica_available"):
    """No replica admitted the rollout within the admission wait; retryable."""


class BindingEnded(RouterError, status=503, code="binding_ended"):
    """The rollout's binding was ended while its request ran; the output is withheld."""


class UpstreamError(RouterError, status=502, code="upstream_error"): ...


class UpstreamTimeout(RouterError, status=504, code="upstream_timeout"): ...
