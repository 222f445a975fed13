"""``GET /dashboard`` (an HTML page that reads at 128 replicas) and ``GET /dashboard/data`` (the
JSON it polls). Both public, like ``/metrics``: no URL, secret or prompt appears in either.

The page has no build step and loads nothing from elsewhere: one HTML document with inline CSS
and a hand-written script that draws on ``<canvas>``. What it shows:

* a **replica grid**, one cell per replica, coloured by state and, when READY, by how far its
  generation is from the published one (cell text: the generation number);
* a **generation timeline**: one row per replica, time left to right, coloured by generation
  (a READY replica) or by state (draining, updating, tainted...), with the update windows
  (start -> every replica on the new generation) shaded;
* **rollouts/s and admitting capacity** over time (admissions counted by the ADMIT script, so
  the rate is the whole pool's across every router; capacity = replicas READY within
  ``max_staleness`` of the published generation, over all replicas), update windows shaded;
* the recent updates (roll time, staleness window, replica windows) and, collapsed, the full
  tables: every replica, every replica-update with phase timings, admissions per generation.

The script polls ``/dashboard/data`` every second; the time series are kept in the page (the
last 10 minutes), so they start when the page is opened. The server renders the grid and the
tables too, so the page is readable without the script (the tables then as of page load).

``/dashboard/data`` costs one pool read (SMEMBERS, then HGETALL + SCARD per replica, pipelined),
the published generation, the newest ``UPDATES`` update records and the per-generation admission
counts: about 2N + 4 Redis commands per call; in a LoRA pool (``generations: lora``) two more
per replica (what holds its adapters), plus a generation record per older adapter held. A LoRA
replica's row and grid cell then name its adapters (:func:`pool_view`).
"""

from __future__ import annotations

import html
import json
import re
import time
from typing import Any

from aiohttp import web

from pool.adapters import adapter_name
from pool.errors import NotFound, StoreError
from pool.records import ReplicaReport, UpdateRecord
from pool.store import RedisStore
from pool.types import Generation, ReplicaRecord
from pool.web import json_response, public_reason
from router.keys import SETTINGS, STORE

UPDATES = 10


async def dashboard_data(request: web.Request) -> web.Response:
    """The pool now, for the page's script (schema in :mod:`router.openapi`)."""
    try:
        data = await _read(request)
    except StoreError as e:
        error = {"code": "store_unavailable", "message": e.message}
        return json_response({"error": error}, status=503)
    return json_response(data)


async def _read(request: web.Request) -> dict[str, Any]:
    settings = request.app[SETTINGS]
    return await pool_view(
        request.app[STORE], settings.max_staleness, lora=settings.generations == "lora"
    )


async def pool_view(store: RedisStore, max_staleness: int, *, lora: bool) -> dict[str, Any]:
    """What ``/dashboard/data`` answers. In a LoRA pool (``lora``) each replica also has
    ``adapter``, the adapter it admits new rollouts on (None on the base, g0), and
    ``adapters``, every adapter something on it still runs on: its own and those of the
    generations its active rollouts and live router grants hold
    (:meth:`pool.store.adapters.Adapters.holds`; None where a grant's generation is unknown);
    the base is listed as ``base``."""
    replicas = await store.replicas()
    latest = await store.latest()
    updates = await store.updates(UPDATES)
    counts = await store.generation_admissions()
    rows = []
    for r in replicas:
        row: dict[str, Any] = {
            "id": r.replica_id,
            "state": r.state.value,
            "generation": r.generation,
            "active": r.active,
            "capacity": r.capacity,
            "reason": public_reason(r.reason),
        }
        if lora:
            row.update(await _adapters(store, r))
        rows.append(row)
    return {
        "now_ms": int(time.time() * 1000),
        "latest": None
        if latest is None
        else {"generation": latest[0].number, "label": latest[0].label},
        "max_staleness": max_staleness,
        "replicas": rows,
        "admitted_total": sum(counts.values()),
        "admissions": {str(g): n for g, n in sorted(counts.items())},
        "updates": [_update_summary(u) for u in updates],
    }


async def _adapters(store: RedisStore, r: ReplicaRecord) -> dict[str, Any]:
    """A LoRA replica's ``adapter`` and ``adapters`` (see :func:`pool_view`)."""
    if r.generation is None or r.label is None:
        return {"adapter": None, "adapters": []}
    own = Generation(number=r.generation, label=r.label)
    held = await store.adapters.holds(r.replica_id)
    if held is None:
        return {"adapter": adapter_name(own), "adapters": None}
    names = {own.number: adapter_name(own) or "base"}
    for g in held - {own.number}:
        try:
            rec = await store.generation_record(g)
        except NotFound:  # its record was pruned: the number names it
            names[g] = f"g{g}"
            continue
        names[g] = adapter_name(rec.generation) or "base"
    return {"adapter": adapter_name(own), "adapters": [names[g] for g in sorted(names)]}


def _update_summary(u: UpdateRecord) -> dict[str, Any]:
    windows = sorted(r.window_s for r in u.replicas.values() if r.window_s is not None)
    return {
        "id": u.id,
        "generation": u.generation,
        "label": u.label,
        "state": u.state.value,
        "created_ms": u.created_ms,
        "started_ms": u.started_ms,
        "published_ms": u.published_ms,
        "rolled_ms": u.rolled_ms,
        "finished_ms": u.finished_ms,
        "staleness_window_s": u.staleness_window_s,
        "replicas_updated": len(u.replicas),
        "window_s_median": windows[len(windows) // 2] if windows else None,
        "window_s_max": windows[-1] if windows else None,
    }


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
    try:
        data = await _read(request)
        records = await request.app[STORE].updates(UPDATES)
    except StoreError as e:
        text = f"<!doctype html><p>store unavailable: {html.escape(e.message)}</p>"
        return web.Response(text=text, status=503, content_type="text/html")
    esc = html.escape
    latest = data["latest"]
    rows = "\n".join(
        f'<tr><td>{esc(r["id"])}</td><td class="{esc(r["state"])}">{esc(r["state"])}</td>'
        f"<td>{'-' if r['generation'] is None else r['generation']}</td>"
        f"<td>{r['active']} / {r['capacity']}</td><td>{esc(_adapter_text(r))}</td>"
        f"<td>{esc(r['reason'])}</td></tr>"
        for r in data["replicas"]
    )
    cells = "".join(
        f'<div class="cell" data-id="{esc(r["id"])}" data-state="{esc(r["state"])}">'
        f"{'' if r['generation'] is None else r['generation'] % 100}</div>"
        for r in data["replicas"]
    )
    gens = "\n".join(
        f"<tr><td>{g}</td><td>{n}</td></tr>" for g, n in reversed(data["admissions"].items())
    )
    fills = {
        "LATEST": "none" if latest is None else _gen(latest),
        "STALENESS": str(data["max_staleness"]),
        "N": str(len(data["replicas"])),
        "CELLS": cells,
        "ROWS": rows,
        "UPDATES": _update_rows(records),
        "GENERATIONS": gens,
        "DATA": _script_json(data),
        "SCRIPT": _SCRIPT,
    }
    # one pass, so text from the store can never be taken for a placeholder
    page = re.sub(r"@([A-Z]+)@", lambda m: fills[m.group(1)], _PAGE)
    return web.Response(text=page, content_type="text/html")


def _adapter_text(row: dict[str, Any]) -> str:
    """The adapters column of a replica row: '-' outside a LoRA pool, '?' where unknown."""
    if "adapters" not in row:
        return "-"
    return "?" if row["adapters"] is None else ", ".join(row["adapters"])


def _script_json(data: dict[str, Any]) -> str:
    """JSON safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` appears literally."""
    text = json.dumps(data)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _gen(latest: dict[str, Any]) -> str:
    return f"{latest['generation']} ({html.escape(latest['label'])})"


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>RolloutPool</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.2em 2em; color: #1f2328; }
h1 { margin: 0 0 .2em; font-size: 1.5em; } h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
.bar { color: #57606a; } .bar b { color: #1f2328; }
#grid { display: grid; grid-template-columns: repeat(auto-fill, 26px); gap: 3px;
  max-width: 980px; }
.cell { height: 20px; border-radius: 3px; font: 10px/20px monospace; text-align: center;
  color: #fff; background: #8c959f; }
canvas { border: 1px solid #d0d7de; border-radius: 4px; display: block; }
.legend span { display: inline-block; margin-right: 1em; font-size: .85em; }
.legend i { display: inline-block; width: .9em; height: .9em; border-radius: 2px;
  vertical-align: -1px; margin-right: .3em; }
table { border-collapse: collapse; margin-bottom: 1em; font-size: .9em; }
td, th { border: 1px solid #d0d7de; padding: .2em .6em; text-align: left; }
.READY, .succeeded { color: #1a7f37; } .TAINTED, .failed { color: #cf222e; font-weight: bold; }
details { margin-top: 1em; } summary { cursor: pointer; font-weight: 600; }
</style></head><body>
<h1>RolloutPool</h1>
<p class="bar">published generation: <b id="latest">@LATEST@</b> &middot; max staleness
@STALENESS@ &middot; <b id="n">@N@</b> replicas, <b id="admitting">-</b> admitting &middot;
<b id="rate">-</b> rollouts/s &middot; <span id="status">live</span> &middot;
<a href="/metrics">metrics</a></p>
<h2>Replicas</h2>
<div id="grid">@CELLS@</div>
<p class="legend" id="legend"></p>
<h2>Generation per replica over time</h2>
<canvas id="timeline" width="980" height="260"></canvas>
<p class="legend" id="timeline-legend"></p>
<h2>Rollouts/s and admitting capacity</h2>
<canvas id="rates" width="980" height="180"></canvas>
<p class="legend"><span><i style="background:#0969da"></i>rollouts/s (left axis)</span>
<span><i style="background:#1a7f37"></i>admitting capacity, share of replicas (right axis)</span>
<span><i style="background:#fff1c2;border:1px solid #d4a72c"></i>update window</span></p>
<h2>Recent updates</h2>
<table id="update-summary"><tr><th>update</th><th>generation</th><th>state</th>
<th>replicas</th><th>roll s</th><th>staleness window s</th><th>window s median / max</th></tr>
</table>
<details><summary>All replicas</summary>
<table id="replicas"><tr><th>replica</th><th>state</th><th>generation</th>
<th>active / capacity</th><th>adapters</th><th>reason</th></tr>
@ROWS@
</table></details>
<details><summary>Replica updates with phase timings (as of page load)</summary>
<table id="updates"><tr><th>update</th><th>generation</th><th>state</th><th>replica</th>
<th>outcome</th><th>window s</th><th>phases (s)</th></tr>
@UPDATES@
</table></details>
<details><summary>Rollouts admitted per generation</summary>
<table id="generations"><tr><th>generation</th><th>rollouts</th></tr>
@GENERATIONS@
</table></details>
<script id="initial" type="application/json">@DATA@</script>
<script>@SCRIPT@</script>
</body></html>
"""

_SCRIPT = r"""
"use strict";
const SPAN_MS = 600000, POLL_MS = 1000;
const STATE = {DRAINING: "#f08c00", QUIESCED: "#0969da", UPDATING: "#0969da",
  INVALIDATING: "#0969da", VALIDATING: "#0969da", RESUMING: "#0969da", TAINTED: "#cf222e",
  RECOVERING: "#8250df", UNINITIALIZED: "#8c959f"};
const hist = [];  // {t, latest, cap, rate, reps: [[state, generation]]}
let last = null, updates = [];
const $ = (id) => document.getElementById(id);
// generations cycle through colours that no state uses (red, blue, orange, purple)
const GENS = ["#2da44e", "#1b7c83", "#8c6d1f", "#116329", "#7d8b2a", "#bf3989"];
function genColor(g) { return GENS[((g % GENS.length) + GENS.length) % GENS.length]; }
function cellColor(r, latest) {
  if (r.state !== "READY") return STATE[r.state] || "#8c959f";
  if (latest === null || r.generation === null) return "#8c959f";
  const behind = latest - r.generation;
  return behind <= 0 ? "#1a7f37" : behind === 1 ? "#8cc265" : "#d4a72c";
}
function esc(s) { return String(s).replace(/[&<>"]/g, (c) => "&#" + c.charCodeAt(0) + ";"); }
function admitting(d) {
  if (!d.latest) return 0;
  const g = d.latest.generation;
  return d.replicas.filter((r) => r.state === "READY" && r.generation !== null &&
    r.generation >= g - d.max_staleness).length;
}
function ingest(d) {
  const n = d.replicas.length, a = admitting(d);
  let rate = null;
  if (last !== null && d.now_ms > last.now_ms)
    rate = Math.max(0, (d.admitted_total - last.admitted_total) * 1000 / (d.now_ms - last.now_ms));
  last = d;
  updates = d.updates;
  hist.push({t: d.now_ms, latest: d.latest ? d.latest.generation : null,
    cap: n ? a / n : 0, rate: rate,
    reps: d.replicas.map((r) => [r.state, r.generation])});
  while (hist.length && hist[0].t < d.now_ms - SPAN_MS) hist.shift();
  $("latest").textContent = d.latest ? d.latest.generation + " (" + d.latest.label + ")" : "none";
  $("n").textContent = n;
  $("admitting").textContent = a;
  $("rate").textContent = rate === null ? "-" : rate.toFixed(1);
  $("status").textContent = "live, " + new Date(d.now_ms).toLocaleTimeString();
}
function drawGrid(d) {
  const grid = $("grid"), latest = d.latest ? d.latest.generation : null;
  while (grid.children.length > d.replicas.length) grid.lastChild.remove();
  while (grid.children.length < d.replicas.length) {
    const c = document.createElement("div"); c.className = "cell"; grid.appendChild(c);
  }
  d.replicas.forEach((r, i) => {
    const c = grid.children[i];
    c.dataset.id = r.id; c.dataset.state = r.state;
    c.style.background = cellColor(r, latest);
    c.textContent = r.generation === null ? "" : r.generation % 100;
    c.title = r.id + ": " + r.state + ", generation " + r.generation + ", " + r.active +
      " / " + r.capacity + ("adapters" in r ? ", adapters " + adapterText(r) : "") +
      (r.reason ? " (" + r.reason + ")" : "");
  });
  const seen = [...new Set(d.replicas.map((r) => r.state))].sort();
  const items = [["READY, published", "#1a7f37"], ["READY, one behind", "#8cc265"],
    ["READY, older", "#d4a72c"]].concat(seen.filter((s) => s !== "READY")
    .map((s) => [s, STATE[s] || "#8c959f"]));
  $("legend").innerHTML = items.map(([s, c]) =>
    '<span><i style="background:' + c + '"></i>' + esc(s) + "</span>").join("");
}
function windows(t0, t1) {
  return updates.filter((u) => u.started_ms).map((u) =>
    [u.started_ms, u.rolled_ms || u.finished_ms || last.now_ms, u]).filter((w) =>
    w[1] >= t0 && w[0] <= t1);
}
function shade(ctx, x, t0, t1, top, h) {
  ctx.fillStyle = "rgba(212,167,44,0.22)";
  for (const [a, b] of windows(t0, t1)) ctx.fillRect(x(a), top, Math.max(1, x(b) - x(a)), h);
}
function axisTime(ctx, x, t0, t1, y) {
  ctx.fillStyle = "#57606a"; ctx.font = "10px sans-serif";
  const step = t1 - t0 > 240000 ? 60000 : t1 - t0 > 60000 ? 30000 : 10000;
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step)
    ctx.fillText(new Date(t).toLocaleTimeString(), x(t) - 22, y);
}
function span() {
  const t1 = last.now_ms, t0 = Math.max(hist[0].t, t1 - SPAN_MS);
  return [t0, Math.max(t1, t0 + 10000)];
}
function drawTimeline() {
  const cv = $("timeline"), ctx = cv.getContext("2d"), W = cv.width, L = 40, B = 16;
  ctx.clearRect(0, 0, W, cv.height);
  if (!hist.length) return;
  const n = Math.max(1, last.replicas.length), H = cv.height - B, rh = H / n;
  const [t0, t1] = span(), x = (t) => L + (t - t0) / (t1 - t0) * (W - L - 4);
  shade(ctx, x, t0, t1, 0, H);
  for (let k = 0; k < hist.length; k++) {
    const s = hist[k], a = x(Math.max(s.t, t0));
    const b = k + 1 < hist.length ? x(hist[k + 1].t) : x(s.t + POLL_MS);
    s.reps.forEach(([state, g], i) => {
      ctx.fillStyle = state === "READY" && g !== null ? genColor(g) : STATE[state] || "#8c959f";
      ctx.fillRect(a, i * rh, Math.max(1, b - a), Math.max(1, rh - (rh > 3 ? 1 : 0)));
    });
  }
  ctx.fillStyle = "#57606a"; ctx.font = "10px sans-serif";
  ctx.fillText("0", 4, 10); ctx.fillText(String(n - 1), 4, H - 2);
  for (const [a, , u] of windows(t0, t1)) ctx.fillText("g" + u.generation, x(a) + 2, 10);
  axisTime(ctx, x, t0, t1, cv.height - 4);
  cv.dataset.samples = hist.length;
  const gens = [...new Set(hist.flatMap((s) => s.reps.map((r) => r[1])))]
    .filter((g) => g !== null).sort((a, b) => a - b).slice(-8);
  const items = gens.map((g) => ["generation " + g + " (READY)", genColor(g)])
    .concat([["draining", STATE.DRAINING], ["updating", STATE.UPDATING],
      ["tainted", STATE.TAINTED], ["recovering", STATE.RECOVERING]]);
  $("timeline-legend").innerHTML = items.map(([s, c]) =>
    '<span><i style="background:' + c + '"></i>' + esc(s) + "</span>").join("");
}
function drawRates() {
  const cv = $("rates"), ctx = cv.getContext("2d"), W = cv.width, L = 40, R = 36, B = 16;
  ctx.clearRect(0, 0, W, cv.height);
  if (!hist.length) return;
  const H = cv.height - B - 6, top = 6, [t0, t1] = span();
  const x = (t) => L + (t - t0) / (t1 - t0) * (W - L - R);
  shade(ctx, x, t0, t1, top, H);
  const rates = hist.map((s) => s.rate).filter((r) => r !== null);
  const rmax = Math.max(1, ...rates) * 1.1;
  ctx.strokeStyle = "#d0d7de"; ctx.beginPath();
  ctx.moveTo(L, top); ctx.lineTo(L, top + H); ctx.lineTo(W - R, top + H); ctx.stroke();
  function line(vals, scale, color) {
    ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
    let on = false;
    hist.forEach((s, k) => {
      const v = vals[k];
      if (v === null) { on = false; return; }
      const px = x(s.t), py = top + H - v / scale * H;
      if (on) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      on = true;
    });
    ctx.stroke();
  }
  line(hist.map((s) => s.rate), rmax, "#0969da");
  line(hist.map((s) => s.cap), 1, "#1a7f37");
  ctx.fillStyle = "#57606a"; ctx.font = "10px sans-serif";
  ctx.fillText(rmax.toFixed(0), 4, top + 8); ctx.fillText("0", 4, top + H);
  ctx.fillText("100%", W - R + 4, top + 8); ctx.fillText("0%", W - R + 4, top + H);
  axisTime(ctx, x, t0, t1, cv.height - 2);
  cv.dataset.samples = hist.length;
}
function drawUpdates() {
  const rows = updates.map((u) => {
    const done = u.started_ms && u.rolled_ms;
    const roll = done ? ((u.rolled_ms - u.started_ms) / 1000).toFixed(2) : "-";
    const f = (v) => (v === null || v === undefined ? "-" : Number(v).toFixed(2));
    return "<tr><td>" + esc(u.id) + "</td><td>" + u.generation + " (" + esc(u.label) +
      ")</td><td class=\"" + esc(u.state) + "\">" + esc(u.state) + "</td><td>" +
      u.replicas_updated + "</td><td>" + roll + "</td><td>" + f(u.staleness_window_s) +
      "</td><td>" + f(u.window_s_median) + " / " + f(u.window_s_max) + "</td></tr>";
  });
  const t = $("update-summary");
  while (t.rows.length > 1) t.deleteRow(1);
  t.insertAdjacentHTML("beforeend", rows.join(""));
}
function adapterText(r) {  // as _adapter_text on the server
  if (!("adapters" in r)) return "-";
  return r.adapters === null ? "?" : r.adapters.join(", ");
}
function drawTables(d) {
  const t = $("replicas");
  while (t.rows.length > 1) t.deleteRow(1);
  t.insertAdjacentHTML("beforeend", d.replicas.map((r) => "<tr><td>" + esc(r.id) +
    '</td><td class="' + esc(r.state) + '">' + esc(r.state) + "</td><td>" +
    (r.generation === null ? "-" : r.generation) + "</td><td>" + r.active + " / " +
    r.capacity + "</td><td>" + esc(adapterText(r)) + "</td><td>" + esc(r.reason) +
    "</td></tr>").join(""));
  const g = $("generations");
  while (g.rows.length > 1) g.deleteRow(1);
  g.insertAdjacentHTML("beforeend", Object.entries(d.admissions).reverse().map(([k, v]) =>
    "<tr><td>" + k + "</td><td>" + v + "</td></tr>").join(""));
}
function render(d) {
  ingest(d); drawGrid(d); drawTimeline(); drawRates(); drawUpdates(); drawTables(d);
}
async function tick() {
  try {
    const r = await fetch("/dashboard/data", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    $("status").textContent = "not live: " + e.message;
  }
  setTimeout(tick, POLL_MS);
}
render(JSON.parse($("initial").textContent));
setTimeout(tick, POLL_MS);
"""
