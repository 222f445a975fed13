"""Typed application keys: every resource the router's handlers share lives under one of these.

Set by :func:`router.app.create_app` (settings, registry, metrics, pool gauges, in-flight
counts) and by its cleanup contexts (store, change feed, view, bindings, session request marks,
grants, recorder, admitter, upstream session, catalog, reaper) — the latter exist only while
the app runs. ``STORE``, ``REGISTRY`` and ``POOL_GAUGES`` are the HTTP kit's keys (its shared
``/healthz``, ``/metrics`` and ``/v1/pool`` handlers read them).
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from pool.metrics import RouterMetrics
from pool.store.feed import PoolWatch
from pool.web import POOL_GAUGES, REGISTRY, STORE
from router.admission import Admitter, ReplicaView
from router.bindings import Bindings
from router.failover import FailoverGuard
from router.grants import GrantBook
from router.limits import InFlight
from router.records import Recorder
from router.session_runs import SessionRuns
from router.settings import RouterSettings
from router.upstream import ReplicaCatalog

SETTINGS = web.AppKey("settings", RouterSettings)
METRICS = web.AppKey("metrics", RouterMetrics)
VIEW = web.AppKey("view", ReplicaView)
BINDINGS = web.AppKey("bindings", Bindings)
ADMITTER = web.AppKey("admitter", Admitter)
HTTP = web.AppKey("http", aiohttp.ClientSession)
CATALOG = web.AppKey("catalog", ReplicaCatalog)
REAPER = web.AppKey("reaper", asyncio.Task[None])
IN_FLIGHT = web.AppKey("in_flight", InFlight)
GUARD = web.AppKey("guard", FailoverGuard)
GRANTS = web.AppKey("grants", GrantBook)
RECORDER = web.AppKey("recorder", Recorder)
WATCH = web.AppKey("watch", PoolWatch)
RUNS = web.AppKey("session_runs", SessionRuns)

__all__ = [
    "ADMITTER",
    "BINDINGS",
    "CATALOG",
    "GRANTS",
    "GUARD",
    "HTTP",
    "IN_FLIGHT",
    "METRICS",
    "POOL_GAUGES",
    "REAPER",
    "RECORDER",
    "REGISTRY",
    "RUNS",
    "SETTINGS",
    "STORE",
    "VIEW",
    "WATCH",
]
