"""The router's own status routes and the admin API (``/v1/pool``, ``/healthz`` and
``/metrics`` are the HTTP kit's, :mod:`pool.web.handlers`, shared with the updater).

* ``GET /v1/models`` — the one model name clients use (``served_model_name``).
* ``GET /dashboard`` — a small self-refreshing HTML page of the same pool view (no URLs; public
  like ``/metrics``).
* ``POST /v1/admin/replicas/{replica_id}/taint`` (admin token; body ``{"reason": "..."}``) —
  close admissions on a replica now (the updater recovers it).
"""

from __future__ import annotations

import html
import logging
import time

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from pool.errors import StoreError
from pool.records import ReplicaReport, UpdateRecord
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


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>RolloutPool</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: .3em .8em; text-align: left; }}
.READY, .succeeded {{ color: #070; }} .TAINTED, .failed {{ color: #b00; font-weight: bold; }}
</style></head><body>
<h1>RolloutPool</h1>
<p>published generation: <b id="latest">{latest}</b> &middot; max staleness {staleness}
&middot; <a href="/metrics">metrics</a> &middot; refreshes every 2 s</p>
<h2>Replicas</h2>
<table id="replicas"><tr><th>replica</th><th>state</th><th>generation</th><th>label</th>
<th>active / capacity</th><th>reason</th></tr>
{rows}
</table>
<h2>Recent updates</h2>
<table id="updates"><tr><th>update</th><th>generation</th><th>state</th><th>replica</th>
<th>outcome</th><th>window s</th><th>phases (s)</th></tr>
{updates}
</table>
<h2>Rollouts admitted per generation</h2>
<table id="generations"><tr><th>generation</th><th>rollouts</th></tr>
{generations}
</table></body></html>
"""


def _update_rows(records: list[UpdateRecord]) -> str:
    """Rows for the updater's records: one per replica an update touched."""
    esc = html.escape
    out = []
    for u in records:
        reps: list[tuple[str, ReplicaReport | None]] = list(u.replicas.items()) or [("-", None)]
        for rid, rep in reps:
            phases = (
                "" if rep is None else ", ".join(f"{esc(k)} {v:.3f}" for k, v in rep.phases.items())
            )
            window = None if rep is None else rep.window_s
            out.append(
                f"<tr><td>{esc(u.id)}</td><td>{esc(u.label)}</td>"
                f'<td class="{esc(u.state)}">{esc(u.state)}</td>'
                f"<td>{esc(rid)}</td><td>{esc(rep.outcome if rep else '-')}</td>"
                f"<td>{'-' if window is None else f'{window:.3f}'}</td><td>{phases}</td></tr>"
            )
    return "\n".join(out)


async def dashboard(request: web.Request) -> web.Response:
    store = request.app[STORE]
    try:
        replicas = await store.replicas()
        latest = await store.latest()
        updates = await store.updates(10)
        counts = await store.generation_admissions()
    except StoreError as e:
        text = f"<!doctype html><p>store unavailable: {html.escape(e.message)}</p>"
        return web.Response(text=text, status=503, content_type="text/html")
    esc = html.escape
    rows = "\n".join(
        f'<tr><td>{esc(r.replica_id)}</td><td class="{esc(r.state.value)}">'
        f"{esc(r.state.value)}</td><td>{r.generation if r.generation is not None else '-'}"
        f"</td><td>{esc(r.label or '-')}</td><td>{r.active} / {r.capacity}</td>"
        f"<td>{esc(r.reason)}</td></tr>"
        for r in replicas
    )
    page = _PAGE.format(
        latest="none" if latest is None else f"{latest[0].number} ({esc(latest[0].label)})",
        staleness=request.app[SETTINGS].max_staleness,
        rows=rows,
        updates=_update_rows(updates),
        generations="\n".join(
            f"<tr><td>{g}</td><td>{n}</td></tr>" for g, n in sorted(counts.items(), reverse=True)
        ),
    )
    return web.Response(text=page, content_type="text/html")
