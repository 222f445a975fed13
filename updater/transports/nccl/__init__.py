"""``nccl`` transport: live weight updates over NCCL through vLLM's own weight-transfer engine.

The sending side uses **vLLM's trainer helpers for the replica's vLLM version** — no home-made
NCCL protocol:

* vLLM 0.26-0.27 (static API): ``NCCLWeightTransferEngine.trainer_init`` joins the group as
  rank 0; ``NCCLWeightTransferEngine.trainer_send_weights`` broadcasts (packed buffers). The HTTP
  handshake (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) is sent by the transport.
* vLLM 0.28+ (factory API): ``WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo,
  client=..., source=...)`` then ``engine.send_weights()``, which drives start / update / finish
  itself through the :class:`HttpWeightSyncClient` given to it. Packing rides the init info
  there, so a change of packing re-initialises the group.

The trainer's ``vllm`` must speak the replica's wire format: by default the two must have the
same ``major.minor`` (``require_same_vllm_minor``); across the 0.27/0.28 API boundary it is always
refused.

**Two entry points.**

* In process: ``NcclTransport(config, source=ModuleSource(model))`` inside the trainer; the
  model's ``named_parameters()`` on its GPU are broadcast as they are (no copy besides vLLM's
  packing). ``target.path`` is ignored; ``target.identity.manifest_digest`` must be the source's.
* Service mode: ``NcclTransport(config)`` (no source). Each target's safetensors checkpoint is
  loaded onto ``config.device`` (:class:`CheckpointSource`, once per path) and broadcast. With
  ``sender="process"`` the loading and sending run in a child process: a sender that hangs or
  dies is killed with its CUDA context, and the updater process never holds a stuck collective.

**Multi-node.** ``master_address`` is the address of the *sending* machine that every replica
can reach: the sender binds vLLM's rendezvous store (a TCP store, rank 0) on
``master_address:port`` and each replica's workers connect to it, then NCCL picks its own data
path (NVLink / IB / sockets). Ports: ``replica_ports[url]`` if given, else ``master_port + i``
for the i-th replica first seen; after an abandoned group, ``+ port_stride`` per incarnation.
Open that range on the sender. ``NCCL_*`` variables that pin interfaces or transports (e.g.
``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``, ``NCCL_CUMEM_ENABLE``) must agree between the sender
and the replica servers or the join hangs. The sender's GPU must not be used by any rank of the
same group (NCCL refuses two ranks on one GPU).

**Modules**, in reading order:

* :mod:`~updater.transports.nccl.config` — :class:`NcclConfig`, :class:`Packing`;
* :mod:`~updater.transports.nccl.versions` — which trainer API, and version refusals;
* :mod:`~updater.transports.nccl.sources` — what is sent (:class:`WeightSource` and its kinds);
* :mod:`~updater.transports.nccl.control` — the HTTP control calls (:class:`HttpWeightSyncClient`);
* :mod:`~updater.transports.nccl.senders` — where vLLM's trainer helpers run (thread or process);
* :mod:`~updater.transports.nccl.threads` — blocking calls in daemon threads, awaited;
* :mod:`~updater.transports.nccl.transport` — :class:`NcclTransport`: group lifetime, blocking
  calls and deadlines, failure classes; its two hooks (group init, send) are the extension point;
* :mod:`~updater.transports.nccl.direct` — ``nccl_direct``: the same groups and failure
  handling, received straight into the runtime parameters by RolloutPool's worker extension
  (:mod:`pool.replica_extension`), with per-parameter checksums (imported on use, registered in
  :mod:`updater.transports.registry`).

Nothing here imports ``torch`` or ``vllm`` at module load: the package (and its unit tests) work
on machines without either; the heavy imports happen on the first send. The package itself
imports nothing until a name is asked of it: the updater's settings read
:class:`NcclConfig` from :mod:`~updater.transports.nccl.config` without loading the transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from updater.transports.nccl.config import NcclConfig, Packing
    from updater.transports.nccl.control import HttpStepError, HttpWeightSyncClient
    from updater.transports.nccl.senders import ProcessSender, Sender, SenderCore, ThreadSender
    from updater.transports.nccl.sources import (
        CheckpointSource,
        ModuleSource,
        SourceSpec,
        StagedSource,
        WeightSource,
    )
    from updater.transports.nccl.transport import NcclTransport
    from updater.transports.nccl.versions import (
        ApiFamily,
        api_family,
        check_versions,
        local_vllm_version,
    )

#: Each exported name -> the module that defines it (imported when the name is first asked for).
_HOMES: dict[str, str] = {
    "NcclConfig": "updater.transports.nccl.config",
    "Packing": "updater.transports.nccl.config",
    "HttpStepError": "updater.transports.nccl.control",
    "HttpWeightSyncClient": "updater.transports.nccl.control",
    "ProcessSender": "updater.transports.nccl.senders",
    "Sender": "updater.transports.nccl.senders",
    "SenderCore": "updater.transports.nccl.senders",
    "ThreadSender": "updater.transports.nccl.senders",
    "CheckpointSource": "updater.transports.nccl.sources",
    "ModuleSource": "updater.transports.nccl.sources",
    "SourceSpec": "updater.transports.nccl.sources",
    "StagedSource": "updater.transports.nccl.sources",
    "WeightSource": "updater.transports.nccl.sources",
    "NcclTransport": "updater.transports.nccl.transport",
    "ApiFamily": "updater.transports.nccl.versions",
    "api_family": "updater.transports.nccl.versions",
    "check_versions": "updater.transports.nccl.versions",
    "local_vllm_version": "updater.transports.nccl.versions",
}

__all__ = [
    "ApiFamily",
    "CheckpointSource",
    "HttpStepError",
    "HttpWeightSyncClient",
    "ModuleSource",
    "NcclConfig",
    "NcclTransport",
    "Packing",
    "ProcessSender",
    "Sender",
    "SenderCore",
    "SourceSpec",
    "StagedSource",
    "ThreadSender",
    "WeightSource",
    "api_family",
    "check_versions",
    "local_vllm_version",
]


def __getattr__(name: str) -> Any:
    """The exported ``name`` from its module, imported now (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
