"""The trainer's client for the updater API (httpx, synchronous: trainers are usually sync).

::

    from updater.client import UpdaterClient

    with UpdaterClient("http://127.0.0.1:8300", admin_token="...") as up:
        u = up.push("/ckpts/step-700", step=700, probe=(prompt_ids, expected_ids))
        done = up.wait(u["id"], timeout_s=600)   # raises UpdateFailed unless it succeeded

A trainer whose weights are on a GPU of the replicas' node pushes its module from GPU memory
(the pool's transport ``ipc_direct``: the replicas copy from the trainer's staged copy over
CUDA IPC; :mod:`updater.transports.ipc.pusher` says where the generation's recovery source
comes from)::

    p = up.push_module(model, "/ckpts/step-700", probe=probe_fn, step=700)  # stall: one copy
    rec = p.record()              # queued once the checkpoint written from the copy is confirmed
    up.wait(rec["id"])

Against a pool on another transport (``nccl_direct`` or ``reload`` in service mode) the same
call works and those read the confirmed checkpoint instead.

Errors: :class:`UpdaterAPIError` carries the HTTP status and the JSON error body; ``wait``
raises :class:`UpdateFailed` for a failed or superseded update and ``TimeoutError`` when the
update is still running at the deadline (it keeps running server-side).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pool.errors import RolloutPoolError

if TYPE_CHECKING:
    from updater.transports.ipc.pusher import ModulePusher, ProbeSource, StagedPush


class UpdaterAPIError(RolloutPoolError):
    code = "updater_api_error"

    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(
            f"updater answered {status}: {err.get('message', body)}",
            status=status,
            error_code=err.get("code"),
        )
        self.status = status
        self.body = body


class UpdateFailed(RolloutPoolError):
    code = "update_failed"

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(
            f"update {record.get('id')} {record.get('state')}: {record.get('error', '')}",
            update_id=record.get("id"),
        )
        self.record = record


class UpdaterClient:
    def __init__(
        self, base_url: str, admin_token: str | None = None, timeout_s: float = 30.0
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)
        self._pusher: ModulePusher | None = None

    def __enter__(self) -> UpdaterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for a module push still in the background, free its staged copies, close."""
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None
        self._http.close()

    def _json(self, r: httpx.Response) -> Any:
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text[:500]}}
        if r.status_code >= 400:
            raise UpdaterAPIError(r.status_code, body)
        return body

    def push(
        self,
        checkpoint: str | Path,
        *,
        probe: tuple[Sequence[int], Sequence[int]],
        step: int | None = None,
        label: str | None = None,
        trainer_run: str = "",
        content_hash: str | None = None,
    ) -> dict[str, Any]:
        """Queue an update to ``checkpoint`` (absolute). ``probe`` = (prompt token ids, the
        greedy token ids the new weights must produce for it). Returns the queued record."""
        body = {
            "checkpoint": str(Path(checkpoint).resolve()),
            "step": step,
            "label": label,
            "trainer_run": trainer_run,
            "content_hash": content_hash,
            "probe": {"prompt_token_ids": list(probe[0]), "expected_token_ids": list(probe[1])},
        }
        result: dict[str, Any] = self._json(self._http.post("/v1/updates", json=body))
        return result

    def push_module(
        self,
        model: Any,
        checkpoint: str | Path,
        *,
        probe: ProbeSource,
        step: int | None = None,
        label: str | None = None,
        trainer_run: str = "",
        save_extra: Callable[[Path], None] | None = None,
        slots: int = 2,
    ) -> StagedPush:
        """Push ``model`` (a ``torch.nn.Module`` on a GPU) from GPU memory: its weights are
        staged on that GPU before this returns (the trainer's stall: one device-to-device
        copy); the checkpoint written from the staged copy (at ``checkpoint``, absolute, new),
        the probe (``probe``, or ``probe(checkpoint)``) and ``POST /v1/updates`` follow in the
        background (:meth:`StagedPush.record`). ``slots`` staged copies are kept (the first
        call decides); push the next module only while at most ``slots - 2`` earlier updates
        have not ended. See :mod:`updater.transports.ipc.pusher`."""
        if self._pusher is None:
            from updater.transports.ipc.pusher import ModulePusher

            self._pusher = ModulePusher(self, slots=slots)
        return self._pusher.push(
            model,
            Path(checkpoint).resolve(),
            probe=probe,
            step=step,
            label=label,
            trainer_run=trainer_run,
            save_extra=save_extra,
        )

    def get(self, update_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json(self._http.get(f"/v1/updates/{update_id}"))
        return result

    def list(self, limit: int = 100) -> list[dict[str, Any]]:
        body = self._json(self._http.get("/v1/updates", params={"limit": limit}))
        return list(body["updates"])

    def wait(
        self,
        update_id: str,
        timeout_s: float = 600.0,
        poll_s: float = 0.2,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the update ends; returns the record if it succeeded. ``on_record`` is
        called with every record polled, the final one included (to show progress: the
        updater saves the record each time a replica's phase begins)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rec = self.get(update_id)
            if on_record is not None:
                on_record(rec)
            if rec["state"] == "succeeded":
                return rec
            if rec["state"] in ("failed", "superseded"):
                raise UpdateFailed(rec)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"update {update_id} still {rec['state']} after {timeout_s}s")
            time.sleep(poll_s)
