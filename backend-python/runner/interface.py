"""The contract between the runner (HTTP) and any backend that generates text.

Routes build a `GenerationRequest` and iterate `backend.async_generate(request)`, receiving
`GenerationEvent`s. A backend never sees HTTP; a route never sees tensors.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from albatross.constraints import CompiledGrammar, ConstraintCompiler
    from runner.state_file import InitialState

FinishReason = Literal["stop", "length", "abort", "error"]

END_OF_TEXT_TOKEN = 0  # RWKV World: id 0 ends a document; generation stops on it unless told otherwise
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# State keys a backend's prefix cache owns (`prefix:<sha256>`): never a session's.
PREFIX_CACHE_KEY_PREFIX = "prefix:"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The runner's defaults for the sampling fields a request and /update-config leave out
    (docs/api.md); `SamplingParams` takes its own defaults from here."""

    max_tokens: int = 500
    temperature: float = 1.0
    top_p: float = 0.3
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 1.0
    penalty_decay: float = 0.996
    global_penalty: bool = False  # the prompt's tokens count in the penalties (RWKV-Runner)


_DEFAULTS = SamplingDefaults()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. Penalties are additive on logits: a generated token's penalty grows by
    `presence_penalty` on first use and `frequency_penalty` on every use, and every penalty is
    multiplied by `penalty_decay` after each generated token."""

    max_tokens: int = _DEFAULTS.max_tokens
    temperature: float = _DEFAULTS.temperature  # 0 means greedy
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k  # 0 means off
    presence_penalty: float = _DEFAULTS.presence_penalty
    frequency_penalty: float = _DEFAULTS.frequency_penalty
    penalty_decay: float = _DEFAULTS.penalty_decay
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = (END_OF_TEXT_TOKEN,)
    seed: int | None = None  # None: the backend draws one
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits before sampling

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError("top_p must be within [0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.penalty_decay <= 1.0:
            raise ValueError("penalty_decay must be within [0, 1]")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        ids = [token_id for token_id, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(token_id < 0 for token_id in ids):
            raise ValueError("logit_bias ids must be distinct and >= 0")
        if not all(math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_LIMIT for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias values must lie within [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")


@dataclass(slots=True)
class StateRef:
    """Where a request's initial state comes from and where its final state goes (state sessions,
    prefix cache). Backends that keep no states refuse a request that carries one."""

    load_key: str | None = None  # start from this cached state (None: zero state)
    save_key: str | None = None  # after a completed (not aborted, not failed) run, save the final state here
    use_prefix_cache: bool = False


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """A grammar the output must match (`response_format`, `tools`), as llguidance lark text that
    `albatross.constraints` compiles against the backend's vocabulary. A backend that cannot
    enforce it refuses the request (400); none ignores it. The end-of-text token is allowed only
    where the grammar can end, and a grammar that reaches its end finishes the request ("stop")."""

    grammar: str
    label: str  # what the client asked for, for messages: "response_format json_schema", "tools", ...


@dataclass(slots=True)
class GenerationRequest:
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    state: StateRef | None = None
    constraint: OutputConstraint | None = None
    # Ids counted in the penalties as if already generated, in order, before the first sample
    # (RWKV-Runner's `global_penalty`: the prompt's tokens).
    penalized_prompt_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_tokens and (self.state is None or self.state.load_key is None):
            raise ValueError("a request needs at least one prompt token or a state to continue")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenerationEvent:
    """A delta of one request's output. `text` never splits a UTF-8 character and never holds
    any part of a matched stop string. The last event of a request has `finish_reason` set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0  # tokens actually consumed from the prompt (exact usage)
    completion_tokens: int = 0  # cumulative count of generated tokens so far
    cached_prompt_tokens: int = 0  # prompt tokens skipped thanks to a cached state
    error: str | None = None  # set with finish_reason "error"
    logprobs: list[TokenLogprob] | None = None


class BackendError(Exception):
    """A failure the route reports to the client with `status_code` and `message`."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def output_grammar_failed(detail: str) -> BackendError:
    """A request's output grammar failing during generation (llguidance's resource limits: a schema
    too large or complex to follow, found only once the output reaches it). The request asked for
    it, so it is a 400 for that request; the others in the batch carry on."""
    return BackendError(400, f"the output constraint could not be followed: {detail}")


def compile_request_grammar(compiler: ConstraintCompiler, constraint: OutputConstraint | None) -> CompiledGrammar | None:
    """A request's output grammar compiled for a backend's vocabulary, the same on both backends
    (the compiler caches by text): one that cannot be enforced is a 400 naming what the client
    asked for, before anything is queued."""
    if constraint is None:
        return None
    from albatross.constraints import ConstraintError  # llguidance loads with the first grammar

    try:
        return compiler.compile(constraint.grammar)
    except ConstraintError as error:
        raise BackendError(400, f"{constraint.label}: {error}") from error


class StateStore(Protocol):
    """A backend's state cache as the runner sees it (sessions, prefix cache): keys are the
    runner's, states the backend's own business. The engine's `StateStore` adds get and put;
    the state routes need more (runner.sessions.SessionStateStore)."""

    def contains(self, key: str) -> bool: ...


class AbstractRWKV(abc.ABC):
    """What every backend implements. `name` is the checkpoint file stem."""

    name: str
    version: int = 7
    tokenizer_len: int = 65536
    backend_name: str = "abstract"  # shown by /status ("classic", "albatross")
    concurrent: bool = False  # False: the runner serialises requests under its completion lock
    defaults: SamplingDefaults = SamplingDefaults()
    # The backend's state cache (sessions, prefix cache), or None when it keeps no states. The state
    # routes read it through runner.sessions.SessionStateStore; requests carrying a StateRef need it.
    state_store: StateStore | None = None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str: ...

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Synchronous generation, for scripts and the classic call sites."""

    @abc.abstractmethod
    def async_generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Asynchronous generation. Closing the iterator early (client gone) aborts the request."""

    def set_initial_state(self, state: InitialState | None) -> None:
        """Start every generation that has no other state (no session, no cached prefix) from
        `state` (a state-tuned file) instead of zeros; None goes back to zeros. Raises BackendError
        400 when the state does not fit the model (`InitialState.check_fits`)."""
        if state is not None:
            raise BackendError(400, f"the {self.backend_name} backend does not support state files")

    def generation_slots(self) -> int:
        """How many generations run at once (the others queue): the unit of the runner's
        back-pressure limit (runner.admission)."""
        return 1

    def status(self) -> dict[str, object]:
        """Backend-specific fields merged into GET /status under `effective`."""
        return {}

    def health(self) -> str | None:
        """None while the backend can serve (every worker alive), else why not (GET /readyz)."""
        return None

    def shutdown(self) -> None:
        """Stop threads and release device memory. Called before another model loads."""
