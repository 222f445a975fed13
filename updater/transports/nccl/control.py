"""The HTTP control calls of a weight update: vLLM's dev-mode routes, from the sending side.

Every route an NCCL transport calls on a replica server goes through :class:`HttpWeightSyncClient`
(the transport's own calls and, on vLLM 0.28+, the calls vLLM's trainer engine makes through the
same object), so how the control calls are made lives in this one place.

**One long-lived client per replica.** The transport keeps one :class:`HttpWeightSyncClient` per
replica; it holds one ``httpx.Client`` with keep-alive, built on first use with the process's one
TLS context (:func:`ssl_context`, built once: loading the trust store costs 18-32 ms per client on
the GPU host, over 1 s on a busy 2-core box). Consecutive calls of a transfer (start, update,
finish) reuse one connection.

**When a kept-alive connection is not reused** (so that a failed call is never mistaken for
an ambiguous one although nothing was sent). vLLM's server closes the connection after a 5xx,
and closes idle connections after its keep-alive timeout (5 s by default); a request written
onto a connection the server is closing fails with a read error that says nothing about whether
the server read it. So:

* after a non-2xx answer or a transport error, the client's connections are retired: the next
  call opens a fresh connection (the retired ``httpx.Client`` is closed once no call uses it);
* a connection idle for :data:`KEEPALIVE_EXPIRY_S` (2 s, under the server's 5 s) is not reused.

A failure on a reused connection is then as ambiguous as on a fresh one, and the only failure
classed as "not sent" is one where no connection was made (``ConnectError``/``ConnectTimeout``).

**Blocking.** The client is synchronous and thread-safe: each call blocks its thread until the
server answers or the call's timeout expires. ``/init_weight_transfer_engine``,
``/update_weights`` and a ``/collective_rpc`` of the direct path only answer once the NCCL
rendezvous / broadcast they start has finished on the server, so transports make them from daemon
threads, concurrently with the sender, and never on the event loop. Concurrent calls use separate
connections; an abandoned call holds only its own.

**Failure.** A non-2xx answer or a transport error raises :class:`HttpStepError`, which says
whether the request can have reached the engine (:attr:`HttpStepError.refused`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import httpx

__all__ = ["KEEPALIVE_EXPIRY_S", "HttpStepError", "HttpWeightSyncClient", "ssl_context"]

#: Seconds an idle kept-alive connection may be reused: below vLLM's (uvicorn's) 5 s keep-alive
#: timeout, so the server never closes a connection this client is about to reuse for idleness.
KEEPALIVE_EXPIRY_S = 2.0

_ssl_lock = threading.Lock()
_ssl: Any = None


def ssl_context() -> Any:
    """The process's one TLS context for control calls (built on first use, then shared)."""
    global _ssl
    with _ssl_lock:
        if _ssl is None:
            _ssl = httpx.create_ssl_context()
        return _ssl


class HttpStepError(Exception):
    """One control call failed: ``status`` is the HTTP status (None: no response)."""

    def __init__(self, path: str, status: int | None, text: str, *, sent: bool = True) -> None:
        super().__init__(f"POST {path}: {status if status is not None else 'no response'}: {text}")
        self.path, self.status, self.text, self.sent = path, status, text, sent

    @property
    def refused(self) -> bool:
        """Nothing reached the engine (not sent) or the server refused the request (4xx)."""
        return (not self.sent) or (self.status is not None and 400 <= self.status < 500)


class HttpWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the dev-mode HTTP routes, synchronous (it
    runs in sender threads), plus ``/collective_rpc`` for the direct path. Handed to the 0.28+
    trainer engine; the 0.26-0.27 path calls the same methods itself. Non-2xx raises
    :class:`HttpStepError`. Thread-safe; see the module docstring for connection reuse.

    Timeouts: ``init_timeout_s`` for ``/init_weight_transfer_engine``, ``timeout_s`` for
    ``/update_weights`` (both block in NCCL on the server), ``control_timeout_s`` for start and
    finish. Picklable (it crosses into a sending child process): the connections stay behind.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        init_timeout_s: float = 300.0,
        control_timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.init_timeout_s = init_timeout_s
        self.control_timeout_s = control_timeout_s
        self._transport = transport
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._users: dict[int, int] = {}  # id(httpx.Client) -> calls in flight on it

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_lock", "_client", "_users"):
            state.pop(k)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # -- connections ---------------------------------------------------------------------------

    def _acquire(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    base_url=self.base_url,
                    transport=self._transport,
                    verify=ssl_context(),
                    limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
                )
            client = self._client
            self._users[id(client)] = self._users.get(id(client), 0) + 1
            return client

    def _release(self, client: httpx.Client, *, retire: bool) -> None:
        with self._lock:
            if retire and self._client is client:
                self._client = None
            left = self._users[id(client)] - 1
            if left:
                self._users[id(client)] = left
                return
            del self._users[id(client)]
            done = self._client is not client
        if done:
            client.close()

    def close(self) -> None:
        """Retire the connections: the next call opens new ones; calls in flight finish on
        theirs (the old ``httpx.Client`` is closed when the last of them returns)."""
        with self._lock:
            client, self._client = self._client, None
            idle = client is not None and id(client) not in self._users
        if idle and client is not None:
            client.close()

    # -- calls ---------------------------------------------------------------------------------

    def post(
        self, path: str, body: Mapping[str, Any] | None = None, *, timeout_s: float
    ) -> dict[str, Any]:
        """``POST path`` with a JSON ``body``; the JSON answer (``{}`` if it is not JSON)."""
        client = self._acquire()
        retire = True
        try:
            r = client.post(path, json=body, timeout=timeout_s)
            retire = not r.is_success
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise HttpStepError(path, None, f"not sent: {type(e).__name__}: {e}", sent=False) from e
        except httpx.HTTPError as e:
            raise HttpStepError(path, None, f"{type(e).__name__}: {e}") from e
        finally:
            self._release(client, retire=retire)
        if not r.is_success:
            raise HttpStepError(path, r.status_code, r.text[:500])
        try:
            out = r.json()
        except ValueError:
            out = {}
        return out if isinstance(out, dict) else {"body": out}

    def collective_rpc(self, method: str, kwargs: Mapping[str, Any], timeout_s: float) -> list[Any]:
        """``POST /collective_rpc``: ``method`` on every worker (a worker-extension method), its
        keyword arguments sent as JSON strings (vLLM passes only strings through); returns the
        per-worker results. An empty or malformed answer raises :class:`HttpStepError`."""
        body = {"method": method, "kwargs": {k: json.dumps(v) for k, v in kwargs.items()}}
        out = self.post("/collective_rpc", body, timeout_s=timeout_s)
        results = out.get("results")
        if not isinstance(results, list) or not results:
            raise HttpStepError("/collective_rpc", 200, f"{method}: no results: {out!r}"[:500])
        return results

    # the VLLMWeightSyncClient protocol (0.28+)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post(
            "/init_weight_transfer_engine", {"init_info": init_info}, timeout_s=self.init_timeout_s
        )

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", None, timeout_s=self.control_timeout_s)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("/update_weights", {"update_info": update_info}, timeout_s=self.timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self.post("/finish_weight_update", body, timeout_s=self.control_timeout_s)
