"""A trainer pushing a ``torch.nn.Module`` from GPU memory to the updater (``ipc_direct``).

The update path moves no weight through disk: the trainer stages its weights on its GPU
(:class:`~updater.transports.ipc.staging.IpcStaging`, one device-to-device copy: the trainer's
stall) and the pool's ``ipc_direct`` replicas copy them from there. What the updater is handed
is still a checkpoint directory, for I6: **the generation's recovery source is a checkpoint
written from the staged copy in the background and confirmed before the update is submitted**
(so before the generation can be declared, let alone published). A replica recovered later
loads, into its fresh process, the staged copy while the trainer still holds it, else that
checkpoint (``reload``, checksummed), and is validated either way.

:func:`write_checkpoint` writes that directory: the staged tensors (device to host, one
safetensors file), whatever ``save_extra`` adds (the model's config, the tokenizer: what the
updater's preflight and a replica's ``reload`` read), and
:data:`~updater.transports.ipc.staging.SIDECAR` (the copy's
:class:`~updater.transports.ipc.staging.IpcDescriptor`, with the sender's checksums), each
file fsynced, into ``<path>.tmp`` renamed to ``path`` at the end: a directory at ``path`` is
complete. :class:`ModulePusher` stages in the caller's thread and does the rest (checkpoint,
probe, ``POST /v1/updates``) in a background thread.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from updater.transports.ipc.staging import SIDECAR, IpcStaging, StagedCopy
from updater.transports.nccl.sources import import_untyped

__all__ = ["ModulePusher", "StagedPush", "write_checkpoint"]

#: The probe of a generation: given or computed from its confirmed checkpoint.
ProbeSource = (
    tuple[Sequence[int], Sequence[int]] | Callable[[Path], tuple[Sequence[int], Sequence[int]]]
)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    staging: IpcStaging,
    copy: StagedCopy,
    path: Path,
    *,
    save_extra: Callable[[Path], None] | None = None,
) -> float:
    """Write ``copy`` as a checkpoint directory at ``path`` (module docstring); returns the
    seconds it took. ``path`` must not exist (a committed checkpoint is never overwritten).
    ``LookupError`` if the slot was restaged meanwhile (nothing is left at ``path``)."""
    save_file = import_untyped("safetensors.torch").save_file
    t0 = time.perf_counter()
    if path.exists():
        raise FileExistsError(f"{path} exists: a checkpoint is never overwritten")
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {n: t.cpu() for n, t in staging.views(copy)}
        descriptor = staging.descriptor(copy)
        if not staging.holds(copy):
            raise LookupError(f"slot {copy.slot} was restaged while its checkpoint was written")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if save_extra is not None:
            save_extra(tmp)
        (tmp / SIDECAR).write_text(descriptor.model_dump_json())
        for f in tmp.iterdir():
            if f.is_file():
                _fsync(f)
        tmp.rename(path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return time.perf_counter() - t0


@dataclass(frozen=True)
class StagedPush:
    """One module pushed from GPU memory: its staged copy, the trainer's stall (the staging
    copy), and the background part's future (the updater's queued update record)."""

    copy: StagedCopy
    checkpoint: Path
    stall_s: float
    future: Future[dict[str, Any]]

    def record(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The queued update record (raises what the background part raised)."""
        return self.future.result(timeout=timeout_s)


class Pushes(Protocol):
    """What the pusher queues an update through (:class:`updater.client.UpdaterClient`)."""

    def push(
        self,
        checkpoint: str | Path,
        *,
        probe: tuple[Sequence[int], Sequence[int]],
        step: int | None = None,
        label: str | None = None,
        trainer_run: str = "",
        content_hash: str | None = None,
    ) -> dict[str, Any]: ...


class ModulePusher:
    """Pushes modules from GPU memory through ``client`` (module docstring). ``slots``: staged
    copies kept; a push rewrites the oldest, so call :meth:`push` only while at most
    ``slots - 2`` earlier updates have not ended (2: the latest published copy stays while the
    next rolls; 3: one rolling and one queued behind it). One caller thread."""

    def __init__(self, client: Pushes, *, slots: int = 2) -> None:
        self.client = client
        self.staging = IpcStaging(slots=slots)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rolloutpool-push")

    def push(
        self,
        model: Any,
        checkpoint: Path,
        *,
        probe: ProbeSource,
        step: int | None = None,
        label: str | None = None,
        trainer_run: str = "",
        save_extra: Callable[[Path], None] | None = None,
    ) -> StagedPush:
        """Stage ``model``'s weights (blocking: the stall), then, in the background, write the
        checkpoint from the staged copy, compute the probe (a callable ``probe`` is given the
        confirmed checkpoint) and queue the update."""
        copy = self.staging.stage(model, key=str(checkpoint))

        def finish() -> dict[str, Any]:
            write_checkpoint(self.staging, copy, checkpoint, save_extra=save_extra)
            prompt_expected = probe(checkpoint) if callable(probe) else probe
            return self.client.push(
                checkpoint, probe=prompt_expected, step=step, label=label, trainer_run=trainer_run
            )

        return StagedPush(copy, checkpoint, copy.stall_s, self._pool.submit(finish))

    def close(self) -> None:
        """Wait for the background part, then free the staging buffers."""
        self._pool.shutdown(wait=True)
        self.staging.release()
