"""CUDA IPC transports: colocated senders hand replicas a staged copy of the weights.

* :mod:`~updater.transports.ipc.staging` — :class:`IpcStaging`: staged copies of a trainer's
  weights on its GPU (the trainer's stall is one device-to-device copy), their checksums and
  the :class:`IpcDescriptor` another process loads them by;
* :mod:`~updater.transports.ipc.transport` — ``ipc_direct`` (:class:`IpcDirectTransport`): the
  replica's worker extension copies the staged copy into its runtime parameters on its GPU;
* :mod:`~updater.transports.ipc.vllm_ipc` — ``ipc`` (:class:`VllmIpcTransport`): the same
  staged copy through vLLM's own ``IPCWeightTransferEngine`` (``/update_weights``), the fallback
  where the extension cannot map a model.

The wire format of a handle and the staging layout are :mod:`pool.ipc_handles` (the replica
side imports only ``pool``). Nothing here imports ``torch`` at module load.
"""

from updater.transports.ipc.staging import SIDECAR, IpcDescriptor, IpcStaging, StagedCopy
from updater.transports.ipc.transport import IpcDirectTransport
from updater.transports.ipc.vllm_ipc import VllmIpcTransport

__all__ = [
    "SIDECAR",
    "IpcDescriptor",
    "IpcDirectTransport",
    "IpcStaging",
    "StagedCopy",
    "VllmIpcTransport",
]
