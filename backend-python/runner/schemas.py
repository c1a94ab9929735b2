"""Request bodies of the runner's routes (pydantic). Invalid values fail validation (422 naming the
field); unknown fields are kept in `model_extra` so routes can log them once and carry on."""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request

from runner.errors import ApiError, from_pydantic
from runner.interface import LOGIT_BIAS_LIMIT
from runner.json_body import JSON_BODY_STATE_KEY, BodyError, parse_json_body
from runner.limits import MAX_INDEX, MAX_PENALTY, MAX_TOP_K, SEED_RANGE, check_stop_strings, check_stop_token_ids

log = logging.getLogger("runner.schemas")

MAX_LOGIT_BIAS_ENTRIES = 1024  # bounds a request's share of the sampler's bias table
# OpenAI's own limit on a request's tools. Each one's schema is checked on the request's path and
# all of them become one grammar: 5,000 tools took 3.4 s and then failed inside llguidance (its
# grammar's symbol table is u16-indexed).
MAX_TOOLS = 128
VOCAB_SIZE = 65536  # RWKV World ids; a backend checks its own vocabulary again
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
BodyT = TypeVar("BodyT", bound=BaseModel)

# The ranges every route shares (runner/limits.py says why each is bounded).
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Index = Annotated[int, Field(ge=0, le=MAX_INDEX)]


def stop_strings(stops: str | list[str] | None, field_name: str) -> str | list[str] | None:
    """Validator body for a stop field: empty strings are invalid (422), the caps are a 400."""
    listed = [stops] if isinstance(stops, str) else (stops or [])
    if any(stop == "" for stop in listed):
        raise ValueError("stop strings must not be empty")
    check_stop_strings(listed, field_name)  # ApiError: pydantic lets it through as it is
    return stops


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    password: str | None = None  # checked by the auth middleware; accepted on every body


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (OpenAI shape)
    tool_call_id: str | None = None  # a tool turn's answer to that call
    raw: bool = False  # RWKV-Runner: its pre-RWKV-5 template only; no effect here
    prefix: bool = False  # RWKV-Runner / DeepSeek: a last assistant message the model continues


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    function: FunctionDefinition | None = None


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingKnobs(_Body):
    """The sampling values a request may set and /update-config may make the defaults; None means
    "use the defaults"."""

    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_k: TopK | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    penalty_decay: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    global_penalty: bool | None = None  # RWKV-Runner: the prompt's tokens count in the penalties

    def sampling_values(self) -> dict[str, Any]:
        """The knobs that were given."""
        return {name: value for name in _KNOBS if (value := getattr(self, name)) is not None}


_KNOBS = tuple(name for name in _SamplingKnobs.model_fields if name not in _Body.model_fields)


class SamplingFields(_SamplingKnobs):
    """Fields shared by chat and text completions; None means "use the defaults"."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None)
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    n: int | None = Field(None, ge=1)  # None (or null): one choice
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(None, ge=0)
    # vLLM's (conRWKV's) extensions
    ignore_eos: bool = False  # keep generating past the end-of-text token
    include_stop_str_in_output: bool = False  # the matched stop string stays in the text

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in value.items():
            if not key.isdigit() or not 0 <= int(key) < VOCAB_SIZE:
                raise ValueError(f"{key!r} is not a token id in [0, {VOCAB_SIZE})")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"the bias of token {key} is {bias}, outside [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items()))

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return stop_strings(stop, "stop")

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, token_ids: list[int] | None) -> list[int] | None:
        check_stop_token_ids(token_ids or [], "stop_token_ids")
        return token_ids

    def unsupported_field(self) -> str | None:
        """The first known OpenAI field that would change the result but is not supported."""
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # RWKV-Runner's chat fields (runner.prompts)
    user_name: str | None = Field(None, min_length=1)
    assistant_name: str | None = Field(None, min_length=1)
    system_name: str | None = Field(None, min_length=1)
    presystem: bool = False
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant's turn header
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def unsupported_field(self) -> str | None:
        if self.functions:
            return "functions"
        if self.function_call not in (None, "none", "auto"):
            return "function_call"
        if self.audio is not None:
            return "audio"
        if self.modalities is not None and set(self.modalities) - {"text"}:
            return "modalities"
        if self.prediction is not None:
            return "prediction"
        return super().unsupported_field()


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field()
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def unsupported_field(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            return "best_of"
        return super().unsupported_field()


class SwitchModelRequest(_Body):
    model: str
    strategy: str = ""
    tokenizer: str | None = None
    customCuda: bool | None = None  # the runner's spelling
    deploy: bool = False


class UpdateConfigRequest(_SamplingKnobs):
    state: str | None = None  # a state-tuned file; "" clears it


class FileToTextForm(BaseModel):
    """`/file-to-text`'s multipart form (for the OpenAPI document; the route reads the form itself).
    `file_name` and `file_encoding` may also come as query parameters."""

    file_data: bytes  # the file: .txt or .pdf
    file_name: str | None = None  # used when the upload has no file name
    file_encoding: str = "utf-8"


class EmbeddingsRequest(_Body):
    input: str | list[str] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


_logged_unknown: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def log_unknown_fields(body: BaseModel, route: str) -> None:
    """Unknown fields are ignored; each name is logged once per route for the server's life."""
    extra = body.model_extra
    if not extra:
        return
    with _logged_lock:
        fresh = [name for name in extra if (route, name) not in _logged_unknown]
        _logged_unknown.update((route, name) for name in fresh)
    if fresh:
        log.info("ignoring unknown fields on %s: %s", route, ", ".join(sorted(fresh)))


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object: runner.json_body's parse (it runs before every route), or a parse
    here when an app was built without it."""
    state = request.scope.get("state", {})
    if JSON_BODY_STATE_KEY in state:
        payload = state[JSON_BODY_STATE_KEY]
    else:
        raw = await request.body()
        if not raw.strip():
            raise ApiError(400, "the request body is empty; send a JSON object")
        try:
            payload = parse_json_body(raw)
        except BodyError as error:
            raise ApiError(error.status_code, error.message, error.param) from None
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return payload


def validate_body(model: type[BodyT], payload: dict[str, Any], route: str) -> BodyT:
    try:
        body = model.model_validate(payload)
    except ValidationError as exc:
        raise from_pydantic(exc) from exc
    log_unknown_fields(body, route)
    return body


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    return validate_body(model, await read_json_object(request), request.url.path)
