"""The request bodies of the updater's HTTP API (pydantic; validated at the edge).

Responses are :class:`pool.records.UpdateRecord` (records both services read). The OpenAPI
document (:mod:`updater.openapi`) is built from these models.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0)]


class ProbeSpec(BaseModel):
    """The validation probe: the greedy output ``expected_token_ids`` that the new weights must
    produce for ``prompt_token_ids`` (computed from the trainer's own model)."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=4096)
    expected_token_ids: list[TokenId] = Field(min_length=1, max_length=256)


class UpdateRequest(BaseModel):
    """``POST /v1/updates``: a checkpoint directory and what it is declared to be."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        min_length=1,
        pattern="^/",
        description="absolute path of a safetensors directory (a pool whose generations are "
        "LoRA adapters: of a PEFT adapter directory)",
    )
    label: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.:+-]{1,128}$",
        description="unique name of the new generation (default g<number>)",
    )
    trainer_run: str = ""
    step: int | None = Field(default=None, ge=0)
    content_hash: str | None = None
    probe: ProbeSpec


__all__ = ["ProbeSpec", "UpdateRequest"]
