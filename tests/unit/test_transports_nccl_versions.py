"""``updater.transports.nccl.versions``: which trainer API a replica's vLLM needs, and when the
sending side's vLLM is refused (pure functions, no vLLM needed)."""

from __future__ import annotations

import pytest

from pool.errors import PreflightFailed
from updater.transports.nccl import api_family, check_versions


def test_version_dispatch() -> None:
    assert api_family((0, 26, 0)) == "static"
    assert api_family((0, 27, 3)) == "static"
    assert api_family((0, 28, 0)) == "factory"
    assert api_family((0, 33, 1)) == "factory"
    with pytest.raises(PreflightFailed):
        api_family((0, 25, 9))
    assert check_versions((0, 26, 0), (0, 26, 0), same_minor=True) == "static"
    assert check_versions((0, 32, 0), (0, 32, 1), same_minor=True) == "factory"
    assert check_versions((0, 26, 0), (0, 27, 0), same_minor=False) == "static"
    with pytest.raises(PreflightFailed, match="same_vllm_minor"):
        check_versions((0, 26, 0), (0, 27, 0), same_minor=True)
    with pytest.raises(PreflightFailed, match="different weight-transfer APIs"):
        check_versions((0, 27, 0), (0, 28, 0), same_minor=False)
    with pytest.raises(PreflightFailed, match="no vllm"):
        check_versions((0, 26, 0), None, same_minor=False)
