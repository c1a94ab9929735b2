"""Request bodies of the native batch and state routes (the rwkv_lightning API; see docs/api.md).

Defaults are upstream's. Invalid values fail validation (422 naming the field); unknown fields are
ignored, as upstream clients send extra ones (`pad_zero` and `noise` are accepted and unused).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runner.interface import PREFIX_CACHE_KEY_PREFIX, SamplingParams
from runner.schemas import Index, Penalty, TopK, stop_strings

DEFAULT_NATIVE_STOPS: tuple[str, ...] = ("\nUser:",)


class _NativeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    password: str | None = None  # checked by the auth middleware


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class NativeBatchRequest(_NativeBody):
    """`/v1/chat/completions` with `contents`, and the fields every native route shares."""

    model: str = "rwkv7"
    contents: list[str] = Field(default_factory=list)
    max_tokens: int = Field(8192, ge=0)
    stop_tokens: list[str] = Field(default_factory=lambda: list(DEFAULT_NATIVE_STOPS))
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    top_k: TopK = 50
    top_p: float = Field(0.6, ge=0, le=1, allow_inf_nan=False)
    alpha_presence: Penalty = 2.0
    alpha_frequency: Penalty = 0.2
    alpha_decay: float = Field(0.996, ge=0, le=1, allow_inf_nan=False)
    stream: bool = False
    chunk_size: int = Field(4, ge=1, le=4096)
    pad_zero: Any = None  # upstream field, unused
    noise: Any = None  # upstream field, unused

    _as_list_stops = field_validator("stop_tokens", mode="before")(_as_list)

    @field_validator("stop_tokens")
    @classmethod
    def _stop_strings(cls, stops: list[str]) -> list[str]:
        stop_strings(stops, "stop_tokens")
        return stops

    def sampling(self, stops: tuple[str, ...] | None = None) -> SamplingParams:
        """Native fields onto the backend's sampling: alpha_* are the additive penalties."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            presence_penalty=self.alpha_presence,
            frequency_penalty=self.alpha_frequency,
            penalty_decay=self.alpha_decay,
            stop=tuple(self.stop_tokens) if stops is None else stops,
        )


class NativeBatchRequestV2(NativeBatchRequest):
    """`/v2/chat/completions`: the same fields with wider sampling defaults."""

    top_k: TopK = 500
    top_p: float = Field(0.5, ge=0, le=1, allow_inf_nan=False)
    alpha_presence: Penalty = 1.0
    alpha_frequency: Penalty = 0.1
    alpha_decay: float = Field(0.99, ge=0, le=1, allow_inf_nan=False)


class BigBatchRequest(NativeBatchRequest):
    """`/big_batch/completions`: always streamed; only temperature, stops, max_tokens and chunk_size
    apply (plain temperature sampling: no top-k/top-p cut, no penalties)."""

    def sampling(self, stops: tuple[str, ...] | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=1.0,
            top_k=0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            penalty_decay=1.0,
            stop=tuple(self.stop_tokens) if stops is None else stops,
        )


class FimRequest(NativeBatchRequest):
    """`/FIM/v1/batch-FIM`: one prompt per (prefix, suffix) pair; no stop strings."""

    prefix: list[str] = Field(default_factory=list)
    suffix: list[str] = Field(default_factory=list)

    _as_list_parts = field_validator("prefix", "suffix", mode="before")(_as_list)


class StateChatRequest(NativeBatchRequest):
    """`/state/chat/completions` and `/multi_state/chat/completions`. `session_id` and (multi_state)
    `dialogue_idx` are optional here so that leaving them out is the documented 400, not a 422."""

    session_id: str | None = Field(None, max_length=512)
    dialogue_idx: Index | None = None

    @field_validator("session_id")
    @classmethod
    def _session_id_text(cls, session_id: str | None) -> str | None:
        if session_id is not None and ("\x00" in session_id or session_id.startswith(PREFIX_CACHE_KEY_PREFIX)):
            raise ValueError(f"a session_id must not contain NUL or start with {PREFIX_CACHE_KEY_PREFIX!r}")
        return session_id


class TranslateRequest(_NativeBody):
    source_lang: str = "auto"
    target_lang: str = Field(min_length=1)
    text_list: list[str]
    max_tokens: int = Field(2048, ge=1)  # upstream's fixed length, overridable


class StateDeleteRequest(_NativeBody):
    session_id: str | None = None
    delete_prefix: bool = False


class StateStatusRequest(_NativeBody):
    pass
