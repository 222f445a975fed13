"""Typed application keys: every resource the router's handlers share lives under one of these.

Set by :func:`router.app.create_app` (settings, metrics) and by its cleanup contexts (store,
view, bindings, admitter, upstream session, catalog, reaper) — the latter exist only while the
app runs.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from pool.metrics import RouterMetrics
from pool.store import RedisStore
from router.admission import Admitter, ReplicaView
from router.bindings import Bindings
from router.failover import FailoverGuard
from router.settings import RouterSettings
from router.upstream import ReplicaCatalog

SETTINGS = web.AppKey("settings", RouterSettings)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", RouterMetrics)
STORE = web.AppKey("store", RedisStore)
VIEW = web.AppKey("view", ReplicaView)
BINDINGS = web.AppKey("bindings", Bindings)
ADMITTER = web.AppKey("admitter", Admitter)
HTTP = web.AppKey("http", aiohttp.ClientSession)
CATALOG = web.AppKey("catalog", ReplicaCatalog)
REAPER = web.AppKey("reaper", asyncio.Task[None])
GUARD = web.AppKey("guard", FailoverGuard)
