"""The router's own status routes and the admin API (``/v1/pool``, ``/healthz`` and
``/metrics`` are the HTTP kit's, :mod:`pool.web.handlers`, shared with the updater).

* ``GET /v1/models`` — the one model name clients use (``served_model_name``).
* ``POST /v1/admin/replicas/{replica_id}/taint`` (admin token; body ``{"reason": "..."}``) —
  close admissions on a replica now (the updater recovers it).
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from pool.web import BadRequest, json_response, read_json_object
from router.keys import SETTINGS, STORE, VIEW

log = logging.getLogger("router")
STARTED = int(time.time())


async def models(request: web.Request) -> web.Response:
    name = request.app[SETTINGS].served_model_name
    return json_response(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": STARTED, "owned_by": "rolloutpool"}
            ],
        }
    )


class TaintRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=500)


async def taint(request: web.Request) -> web.Response:
    replica_id = request.match_info["replica_id"]
    raw = await read_json_object(request, request.app[SETTINGS].max_body_bytes)
    try:
        body = TaintRequest.model_validate(raw)
    except ValueError as e:
        raise BadRequest(f"invalid taint request: {e}", code="invalid_body") from e
    previous = await request.app[STORE].taint(
        replica_id, f"admin: {body.reason}", source="router-admin"
    )
    request.app[VIEW].invalidate()
    log.warning("replica %s tainted by admin (was %s): %s", replica_id, previous, body.reason)
    return json_response(
        {"replica_id": replica_id, "state": "TAINTED", "previous_state": str(previous)}
    )
