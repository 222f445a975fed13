"""The HTTP control calls of a weight update: vLLM's dev-mode routes, from the sending side.

Every route the NCCL transport calls on a replica server goes through :class:`HttpWeightSyncClient`
(the transport's own calls and, on vLLM 0.28+, the calls vLLM's trainer engine makes through the
same object), so how the control calls are made lives in this one place.

**Blocking.** The client is synchronous: each call blocks its thread until the server answers or
the call's timeout expires. ``/init_weight_transfer_engine`` and ``/update_weights`` only answer
once the NCCL rendezvous / broadcast they start has finished on the server, so the transport makes
them from daemon threads, concurrently with the sender, and never on the event loop. Each call
opens its own connection (no keep-alive), so an abandoned call holds nothing another call needs.

**Failure.** A non-2xx answer or a transport error raises :class:`HttpStepError`, which says
whether the request can have reached the engine (:attr:`HttpStepError.refused`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

__all__ = ["HttpStepError", "HttpWeightSyncClient"]


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
    runs in sender threads). Handed to the 0.28+ trainer engine; the 0.26-0.27 path calls the
    same methods itself. Non-2xx raises :class:`HttpStepError`.

    Timeouts: ``init_timeout_s`` for ``/init_weight_transfer_engine``, ``timeout_s`` for
    ``/update_weights`` (both block in NCCL on the server), ``control_timeout_s`` for start and
    finish."""

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

    def post(
        self, path: str, body: Mapping[str, Any] | None = None, *, timeout_s: float
    ) -> dict[str, Any]:
        """``POST path`` with a JSON ``body``; the JSON answer (``{}`` if it is not JSON)."""
        try:
            with httpx.Client(
                base_url=self.base_url,
                timeout=timeout_s,
                transport=self._transport,
                limits=httpx.Limits(max_keepalive_connections=0),
            ) as c:
                r = c.post(path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise HttpStepError(path, None, f"not sent: {type(e).__name__}: {e}", sent=False) from e
        except httpx.HTTPError as e:
            raise HttpStepError(path, None, f"{type(e).__name__}: {e}") from e
        if not r.is_success:
            raise HttpStepError(path, r.status_code, r.text[:500])
        try:
            out = r.json()
        except ValueError:
            out = {}
        return out if isinstance(out, dict) else {"body": out}

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
