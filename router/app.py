"""The router's app factory: routes, middlewares and resources (aiohttp cleanup contexts).

``create_app(settings, store_settings)`` does no I/O; the resources are set up when the app
starts and torn down in reverse order when it stops:

1. **store** — the :class:`~pool.store.RedisStore` client, the pool view the change feed keeps
   (:class:`~pool.store.feed.PoolWatch`) and its :class:`ReplicaView`, the :class:`Bindings`
   owner, this router's grants (:class:`~router.grants.GrantBook`), the provenance
   :class:`~router.records.Recorder` and the :class:`Admitter`. The router starts even if
   Redis is down (``/healthz`` says 503, admissions fail closed). Teardown waits up to 5 s
   for pending releases before closing the client.
2. **upstream** — one pooled :class:`aiohttp.ClientSession` for every replica, and the
   :class:`ReplicaCatalog` of their model ids.
3. **background** — the reaper, calling ``store.reap_expired()`` every ``reaper_interval_s``:
   bindings whose lease ran out (their router died) are aborted with "lease expired" (many
   routers may reap at once; each binding is released exactly once; errors are logged and
   retried next tick); the lease renewer of this router's in-flight requests
   (:meth:`Bindings.renew_forever`, ticking every sixth of the shortest lease, at most 1 s);
   and the :class:`~router.failover.FailoverGuard` (verifies in-flight bindings in every new
   failover epoch, reports to the updater; the router admits only once it has run); the change
   feed (:meth:`PoolWatch.run`); the recorder's flush loop; with ``grants``, the grant keeper
   (:meth:`GrantBook.keep`). On teardown the grants are returned (best effort: otherwise they
   lapse with the router's registration) and the last records flushed.

Middlewares, outermost first: JSON errors (the HTTP kit's, :mod:`pool.web.errors`), request
timing (``rolloutpool_request_seconds``), auth (:mod:`router.auth`), optional rate limit. Only
the routes below exist; anything else is a JSON 404 (vLLM's control endpoints are never
reachable through the router).

Serve it with :func:`pool.web.start_server` or ``python -m router``; both enable aiohttp's
``handler_cancellation``, which is how client disconnects reach the proxy (:mod:`router.proxy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry

from pool.errors import StoreError
from pool.metrics import RouterMetrics
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.store.feed import PoolWatch
from pool.web import (
    error_middleware,
    healthz_handler,
    metrics_handler,
    openapi_handler,
    pool_handler,
)
from router import dashboard, openapi, proxy, sessions, status
from router.admission import Admitter, ReplicaView
from router.auth import rate_limit_middleware, router_auth
from router.bindings import Bindings
from router.failover import FailoverGuard
from router.grants import GrantBook
from router.keys import (
    ADMITTER,
    BINDINGS,
    CATALOG,
    GRANTS,
    GUARD,
    HTTP,
    IN_FLIGHT,
    METRICS,
    POOL_GAUGES,
    REAPER,
    RECORDER,
    REGISTRY,
    RUNS,
    SETTINGS,
    STORE,
    VIEW,
    WATCH,
)
from router.limits import InFlight
from router.records import Recorder
from router.session_runs import SessionRuns
from router.settings import RouterSettings
from router.upstream import ReplicaCatalog, client_session

log = logging.getLogger("router")


def timing_middleware(metrics: RouterMetrics) -> Middleware:
    @web.middleware
    async def timing(request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            return await handler(request)
        finally:
            route = request.match_info.route.resource
            name = route.canonical if route is not None else "unmatched"
            metrics.request_latency.labels(name).observe(time.monotonic() - t0)

    return timing


def _store_ctx(
    store_settings: StoreSettings,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        settings, metrics = app[SETTINGS], app[METRICS]
        store = RedisStore.connect(store_settings)
        bindings = Bindings(store, metrics)
        guard = FailoverGuard(store, bindings, metrics)
        book = GrantBook(
            store,
            guard.router_id,
            slots=settings.grant_slots,
            max_staleness=settings.max_staleness,
            grace_s=store_settings.failover_grace_s,
        )
        view = ReplicaView(store, settings.replica_view_ttl_s)

        def changed(ids: set[str]) -> None:
            view.invalidate()
            book.on_view(watch.records, watch.latest)

        watch = PoolWatch(store, on_change=changed)
        view.watch = watch
        guard.attach(watch, book if settings.grants else None)
        app[STORE], app[VIEW], app[BINDINGS], app[GUARD] = store, view, bindings, guard
        app[WATCH], app[GRANTS] = watch, book
        app[RUNS] = SessionRuns(
            store,
            bindings,
            limit=settings.session_max_in_flight,
            lease_s=settings.request_lease_s,
            retry_after_s=settings.retry_after_s,
        )
        app[RECORDER] = Recorder(store, bindings, metrics, flush_s=settings.record_flush_s)
        app[ADMITTER] = Admitter(
            store,
            view,
            bindings,
            metrics,
            max_staleness=settings.max_staleness,
            wait_s=settings.admission_wait_s,
            retry_after_s=settings.retry_after_s,
            grants=book,
        )
        yield
        await bindings.close()
        await store.close()

    return store_ctx


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    http = client_session(app[SETTINGS])
    app[HTTP] = http
    app[CATALOG] = ReplicaCatalog(http)
    yield
    await http.close()


async def _reap_forever(store: RedisStore, interval_s: float, stop: asyncio.Event) -> None:
    """Reap until ``stop`` is set (a flag, not cancellation: see :mod:`router.bindings`)."""
    while not stop.is_set():
        try:
            reaped = await store.reap_expired()
            if reaped:
                log.warning("reaper aborted %d expired binding(s): %s", len(reaped), reaped[:10])
        except StoreError as e:
            log.warning("reaper: %s", e.message)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    """The reaper, the lease renewer and the failover guard; all stop on a flag (see
    :mod:`router.bindings`)."""
    settings = app[SETTINGS]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    await app[GUARD].tick()  # admissions wait for it: one round before serving (fails fast)
    tick_s = min(1.0, settings.request_lease_s / 6, sessions.session_lease_s(settings) / 6)
    tasks = [
        loop.create_task(_reap_forever(app[STORE], settings.reaper_interval_s, stop)),
        loop.create_task(app[BINDINGS].renew_forever(tick_s, stop)),
        loop.create_task(app[GUARD].run(stop)),
        loop.create_task(app[WATCH].run(stop)),
        loop.create_task(app[RECORDER].run(stop)),
    ]
    if settings.grants:
        tasks.append(loop.create_task(app[GRANTS].keep(stop)))
    app[REAPER] = tasks[0]
    yield
    stop.set()
    await app[GRANTS].close()
    _, pending = await asyncio.wait(tasks, timeout=10)
    for task in pending:
        task.cancel()


async def _warn_if_open(app: web.Application) -> None:
    """At start: say loudly when the data plane accepts anyone (no client keys configured)."""
    if not app[SETTINGS].api_keys:
        log.warning(
            "anonymous mode: no client API keys are configured (ROLLOUTPOOL_ROUTER_API_KEYS), "
            "so anyone who can reach this router may run rollouts, and sessions are not bound "
            "to their client; configure keys unless the network is trusted"
        )


def create_app(
    settings: RouterSettings,
    store_settings: StoreSettings,
    *,
    worker: tuple[int, int] | None = None,
) -> web.Application:
    """A wired router app (no I/O until it is started). ``worker``: (index, count) when it is
    one of several processes serving one port (:mod:`router.workers`); ``/healthz`` says which
    (``worker``: index, count and pid)."""
    registry = CollectorRegistry()
    metrics = RouterMetrics.create(registry)
    app = web.Application(
        middlewares=[
            error_middleware(log, settings.retry_after_s),
            timing_middleware(metrics),
            router_auth(settings),
            rate_limit_middleware(settings),
        ],
        client_max_size=settings.max_body_bytes + 1,
    )
    app[SETTINGS], app[REGISTRY], app[METRICS] = settings, registry, metrics
    app[POOL_GAUGES] = metrics.pool
    app[IN_FLIGHT] = InFlight(settings)
    app.cleanup_ctx.extend([_store_ctx(store_settings), _upstream_ctx, _background_ctx])
    app.on_startup.append(_warn_if_open)

    for path in proxy.INFERENCE_ROUTES:
        app.router.add_post(path, proxy.handle_inference)
    app.router.add_get("/v1/models", status.models, allow_head=False)
    app.router.add_post("/v1/rollouts", sessions.open_session)
    app.router.add_get("/v1/rollouts/{rollout_id}", sessions.get_rollout, allow_head=False)
    app.router.add_post("/v1/rollouts/{rollout_id}/heartbeat", sessions.heartbeat)
    app.router.add_post("/v1/rollouts/{rollout_id}/close", sessions.close_session)
    app.router.add_get("/v1/pool", pool_handler(settings.max_staleness), allow_head=False)
    index, count = worker or (0, 1)
    me = {"worker": {"index": index, "of": count, "pid": os.getpid()}}
    app.router.add_get("/healthz", healthz_handler(lambda _: (True, me)), allow_head=False)
    app.router.add_get("/metrics", metrics_handler(), allow_head=False)
    app.router.add_get("/dashboard", dashboard.dashboard, allow_head=False)
    app.router.add_get("/dashboard/data", dashboard.dashboard_data, allow_head=False)
    app.router.add_post("/v1/admin/replicas/{replica_id}/taint", status.taint)
    document = functools.partial(
        openapi.document,
        client_keys=bool(settings.api_keys),
        model=settings.served_model_name,
    )
    app.router.add_get("/openapi.json", openapi_handler(document), allow_head=False)
    return app
