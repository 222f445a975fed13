"""The VALIDATING step's evidence: a replica's checksums against the sender's
(:func:`verify_checksums`) and the default validator (:func:`probe_validate`: label, resume,
greedy probe, label read back).

Both run while the replica is closed to admissions (store state VALIDATING), under the cycle
runner's ``validate_s`` deadline (:mod:`updater.cycle`); neither commits anything: the runner
commits the evidence they return. A :data:`Validator` is what the runner calls for the probe
part (a GPU harness on bf16 weights plugs in a teacher-forced log-prob check).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pool.checksum import from_json as checksums_from_json
from pool.evidence import ChecksumEvidence, LabelEvidence, TransferEvidence, ValidationEvidence
from pool.types import Generation
from updater.handle import Probe, ReplicaHandle

#: Produces the ValidationEvidence of a replica that already holds the new weights and has its
#: caches reset; admissions stay closed.
Validator = Callable[[ReplicaHandle, Generation, Probe], Awaitable[ValidationEvidence]]


async def worker_result(h: ReplicaHandle, method: str, timeout_s: float) -> dict[str, Any]:
    """The worker extension's ``method`` (:mod:`pool.replica_extension`) run on ``h``'s one
    worker: its result. Raises ``ValueError`` for any other answer, and what the call raises
    (no extension loaded: the engine's error)."""
    rpc = await h.engine.collective_rpc(method, timeout_s=timeout_s)
    if len(rpc.results) != 1 or not isinstance(rpc.results[0], dict):
        raise ValueError(f"one result per worker expected, got {rpc.results!r:.200}")
    return rpc.results[0]


async def verify_checksums(
    h: ReplicaHandle, transfer: TransferEvidence, timeout_s: float
) -> ChecksumEvidence:
    """The replica's checksums over its runtime parameters against the sender's: those its
    receive reported (``transfer.replica_checksums``), else the worker extension's
    ``rolloutpool_checksums`` now (:mod:`pool.replica_extension`). A replica that cannot
    answer (no extension loaded, an error) yields evidence with ``error`` set, which does
    not prove equality."""
    expected = transfer.checksums or {}
    if transfer.replica_checksums is not None:
        return ChecksumEvidence.compare(
            expected, transfer.replica_checksums, sender_s=transfer.checksum_s
        )
    t0 = time.monotonic()
    try:
        result = await worker_result(h, "rolloutpool_checksums", timeout_s)
        actual = checksums_from_json(result.get("checksums"))
    except Exception as e:
        return ChecksumEvidence.compare(
            expected,
            {},
            sender_s=transfer.checksum_s,
            replica_s=time.monotonic() - t0,
            error=f"{type(e).__name__}: {e}"[:500],
        )
    return ChecksumEvidence.compare(
        expected, actual, sender_s=transfer.checksum_s, replica_s=time.monotonic() - t0
    )


async def probe_validate(h: ReplicaHandle, gen: Generation, probe: Probe) -> ValidationEvidence:
    """Label, resume (admissions stay closed), probe, read the label back."""
    caps = h.engine.capabilities
    if caps.labels:
        await h.engine.set_label(gen.label)
    await h.engine.resume()
    actual = await h.engine.complete(
        list(probe.prompt_token_ids),
        max_tokens=len(probe.expected),
        temperature=0.0,
        cache_salt=gen.label,
    )
    label = await h.engine.weight_label() if caps.labels else LabelEvidence(False, None)
    return ValidationEvidence(gen, label, probe.expected, actual)
