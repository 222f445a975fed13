"""``updater.transports.nccl.control``: the HTTP control client's routes, bodies and errors
(the server faked at the HTTP seam)."""

from __future__ import annotations

import http.server
import json
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from updater.transports.nccl import HttpStepError, HttpWeightSyncClient
from updater.transports.nccl.control import ssl_context


def test_http_sync_client_routes_and_errors() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body))
        if request.url.path == "/finish_weight_update" and body:
            return httpx.Response(422, json={"detail": "bad"})
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "boom"})
        return httpx.Response(200, json={"message": "ok"})

    c = HttpWeightSyncClient("http://x/", transport=httpx.MockTransport(handler))
    c.init_weight_transfer_engine({"master_port": 1})
    c.start_weight_update()
    c.finish_weight_update()
    with pytest.raises(HttpStepError) as e:
        c.update_weights({"names": []})
    assert e.value.status == 500 and not e.value.refused
    with pytest.raises(HttpStepError) as e:
        c.finish_weight_update("v1")
    assert e.value.refused
    assert seen == [
        ("/init_weight_transfer_engine", {"init_info": {"master_port": 1}}),
        ("/start_weight_update", None),
        ("/finish_weight_update", None),
        ("/update_weights", {"update_info": {"names": []}}),
        ("/finish_weight_update", {"weight_version": "v1"}),
    ]

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    c = HttpWeightSyncClient("http://x", transport=httpx.MockTransport(refuse))
    with pytest.raises(HttpStepError) as e:
        c.start_weight_update()
    assert e.value.refused and not e.value.sent


class _VllmLikeHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive like uvicorn, and vLLM's close after a 500 as the race looks from
    the client: the 500 is answered, the next request written onto that connection is read, and
    then the connection is closed without an answer (deterministic stand-in for the server's
    close arriving after the client reused the connection)."""

    protocol_version = "HTTP/1.1"
    connections: list[int] = []  # one list per test: the fixture subclasses

    def setup(self) -> None:
        super().setup()
        self.connections.append(1)
        self.poisoned = False

    def handle_one_request(self) -> None:
        if self.poisoned:
            self.rfile.readline()  # the next request (or EOF once the client gives up on it)
            self.close_connection = True
            return
        super().handle_one_request()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = 500 if self.path == "/fail" else 200
        body = b'{"message": "ok"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.poisoned = status == 500

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def vllm_like_server() -> Iterator[tuple[str, list[int]]]:
    handler = type("Handler", (_VllmLikeHandler,), {"connections": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.connections
    server.shutdown()
    server.server_close()


def test_one_kept_alive_connection_and_none_reused_after_an_error(
    vllm_like_server: tuple[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pins #15.1: one httpx.Client (one TLS context) for many calls, one connection reused;
    after a 500 the connection is not reused (reusing it fails with a read error that would
    look ambiguous although the request was never answered; the old per-call client hid this
    by never reusing anything)."""
    url, connections = vllm_like_server
    built: list[int] = []
    init = httpx.Client.__init__

    def counting_init(self: httpx.Client, *a: Any, **kw: Any) -> None:
        built.append(1)
        init(self, *a, **kw)

    monkeypatch.setattr(httpx.Client, "__init__", counting_init)
    c = HttpWeightSyncClient(url)
    for _ in range(3):
        c.start_weight_update()
    assert (len(connections), len(built)) == (1, 1)
    with pytest.raises(HttpStepError) as e:
        c.post("/fail", None, timeout_s=5)
    assert e.value.status == 500
    c.finish_weight_update()  # a fresh connection, not the one the server is closing
    c.finish_weight_update()
    assert len(connections) == 2
    # a copy for a sending child process carries no connections and works on its own
    twin = pickle.loads(pickle.dumps(c))
    twin.start_weight_update()
    assert len(connections) == 3
    c.close()
    twin.close()
    assert ssl_context() is ssl_context()


def test_collective_rpc_sends_json_strings_and_needs_results() -> None:
    seen: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["method"] == "empty":
            return httpx.Response(200)
        return httpx.Response(200, json={"results": [{"n": 1}]})

    c = HttpWeightSyncClient("http://x", transport=httpx.MockTransport(handler))
    assert c.collective_rpc("m", {"plan": [1, "a"]}, timeout_s=5) == [{"n": 1}]
    assert seen[0] == {"method": "m", "kwargs": {"plan": '[1, "a"]'}}
    with pytest.raises(HttpStepError, match="no results"):
        c.collective_rpc("empty", {}, timeout_s=5)
