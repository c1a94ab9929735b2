"""OpenAI chat and text completions on the loaded backend (the runner's routes).

`make_chat_endpoint(ChatRouteConfig(...))` builds a chat route; a second chat route with other
defaults (e.g. /openai/v1/chat/completions of the native module) is one more config, not a copy.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runner.context import AppContext, context
from runner.errors import ApiError
from runner.generation import GenerationDriver, collect, stream_events
from runner.global_penalty import penalized_prompt_ids
from runner.interface import END_OF_TEXT_TOKEN, AbstractRWKV, BackendError, SamplingDefaults, SamplingParams, StateRef
from runner.jobs import build_jobs, check_item_count, check_max_tokens, encode_prompts
from runner.openai_format import OpenAIStreamFormatter, choice_payload, usage_payload
from runner.prompts import ChatNames, ChatTurn, ToolCall, chat_stops, parse_tool_arguments, runner_chat_template, stop_list
from runner.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, read_json_object, validate_body
from runner.sse import sse_response
from runner.stop_echo import StopStringEcho
from runner.structured_output import UNCONSTRAINED, StructuredOutput, chat_output, completion_output, read_off_loop, with_tools_prompt
from runner.tools import render_tool_calls

router = APIRouter()

Kind = Literal["chat", "text"]


def _message_text(content: str | list[Any] | None, index: int) -> str | None:
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content parts of type {part.type!r} are not supported (text only)", f"messages.{index}.content.{j}.type")
        texts.append(part.text)
    return "".join(texts)


def _runner_tool_call(calls: list[dict[str, Any]], index: int) -> ToolCall:
    """RWKV-Runner writes an assistant's first call into the history (as its own tool prompt asks)."""
    function = calls[0].get("function") if isinstance(calls[0], dict) else None
    param = f"messages.{index}.tool_calls.0.function"
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "a tool call needs a function with a name", param)
    arguments = function.get("arguments", "")
    try:
        return ToolCall(function["name"], parse_tool_arguments(arguments if isinstance(arguments, str) else json.dumps(arguments)))
    except ValueError as exc:
        raise ApiError(400, f"tool call arguments must be a JSON object: {exc}", param + ".arguments") from exc


def chat_turns(body: ChatCompletionRequest) -> list[ChatTurn]:
    """The messages as template turns. Earlier tool calls read as the model is asked to write
    them: in the tools template's form when the request offers tools (runner.tools), else as
    RWKV-Runner writes them."""
    turns: list[ChatTurn] = []
    for i, message in enumerate(body.messages):
        text, call = _message_text(message.content, i), None
        if message.role == "assistant" and message.tool_calls:
            if body.tools:
                text = "\n".join(part for part in (text, render_tool_calls(message.tool_calls)) if part)
            else:
                call = _runner_tool_call(message.tool_calls, i)
        turns.append(ChatTurn(message.role, text, call, message.prefix))
    return turns


def chat_names(body: ChatCompletionRequest) -> ChatNames:
    defaults = ChatNames()
    return ChatNames(body.user_name or defaults.user, body.assistant_name or defaults.assistant, body.system_name or defaults.system)


def runner_chat_prompt(body: ChatCompletionRequest) -> str:
    return runner_chat_template(chat_turns(body), chat_names(body), body.presystem, body.add_generation_prompt)


def runner_chat_stops(body: ChatCompletionRequest, backend: AbstractRWKV) -> tuple[str, ...]:
    return chat_stops(body.stop, chat_names(body), backend.encode, backend.decode)


@dataclass(frozen=True, slots=True)
class ChatRouteConfig:
    """What differs between chat routes: defaults below the body, the template, the state."""

    sampling_overrides: Mapping[str, Any] = field(default_factory=dict)  # over /update-config and the backend's
    build_stops: Callable[[ChatCompletionRequest, AbstractRWKV], tuple[str, ...]] = runner_chat_stops
    build_prompt: Callable[[ChatCompletionRequest], str] = runner_chat_prompt
    # The state a request starts from. Default: the longest cached prompt prefix, on backends that
    # keep a state cache (a multi-turn chat then prefills only its new turn); None elsewhere.
    state_for: Callable[[ChatCompletionRequest, AbstractRWKV], StateRef | None] = lambda body, backend: prefix_cache_state(backend)
    accept_native_batch: bool = True  # `contents` without `messages` goes to the native handler


def prefix_cache_state(backend: AbstractRWKV) -> StateRef | None:
    return StateRef(use_prefix_cache=True) if backend.state_store is not None else None


def defaults_for(ctx: AppContext, backend: AbstractRWKV, spec: CompletionSpec) -> SamplingDefaults:
    """The route's defaults over /update-config's over the backend's."""
    return dataclasses.replace(ctx.manager.sampling_defaults(backend), **spec.overrides)


def sampling_for(ctx: AppContext, backend: AbstractRWKV, spec: CompletionSpec) -> SamplingParams:
    defaults = defaults_for(ctx, backend, spec)
    body = spec.body
    max_tokens = defaults.max_tokens if spec.max_tokens is None else spec.max_tokens
    check_max_tokens(max_tokens, ctx.settings.max_tokens)
    stop_ids = tuple(body.stop_token_ids) if body.stop_token_ids is not None else (END_OF_TEXT_TOKEN,)
    if body.ignore_eos:
        stop_ids = tuple(i for i in stop_ids if i != END_OF_TEXT_TOKEN)
    knobs = {**dataclasses.asdict(defaults), **body.sampling_values()}
    del knobs["max_tokens"]  # chosen above: chat bodies also have max_completion_tokens
    del knobs["global_penalty"]  # not a sampling parameter: it decides the jobs' penalized ids
    try:
        return SamplingParams(
            max_tokens=max_tokens, stop=spec.stops, stop_token_ids=stop_ids, seed=body.seed, logprobs=spec.logprobs,
            logit_bias=body.logit_bias_pairs(), **knobs,
        )  # fmt: skip
    except ValueError as exc:
        raise ApiError(422, str(exc)) from exc


@dataclass(frozen=True, slots=True)
class CompletionSpec:
    """A chat or text completion, ready to run: what the body asked, after the route's reading."""

    kind: Kind
    body: SamplingFields
    prompts: Sequence[str]
    max_tokens: int | None  # None: the defaults'
    stops: tuple[str, ...]
    overrides: Mapping[str, Any] = field(default_factory=dict)  # route defaults over /update-config and the backend's
    logprobs: int | None = None
    state: StateRef | None = None
    output: StructuredOutput = UNCONSTRAINED  # response_format / tools


async def run_completion(request: Request, spec: CompletionSpec) -> Response:
    ctx = context(request)
    ctx.metrics.count_request(request.scope["path"])
    try:
        return await _run_completion(ctx, request, spec)
    except (ApiError, BackendError) as exc:
        ctx.metrics.count_error(exc.status_code)
        raise


async def _run_completion(ctx: AppContext, request: Request, spec: CompletionSpec) -> Response:
    if ctx.profile.enabled:
        ctx.profile.requests += 1
    body, kind = spec.body, spec.kind
    unsupported = body.unsupported_field()
    if unsupported is not None:
        raise ApiError(400, f"{unsupported} is not supported by this server yet", unsupported)
    n = body.choices_per_prompt
    check_item_count(len(spec.prompts) * n, ctx.settings.max_batch_items, "n", what="choices")
    backend = ctx.manager.require_backend()
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = body.model or backend.name
    tools = spec.output.tools is not None
    ticket = ctx.admission.admit(len(spec.prompts) * n, backend.generation_slots())  # 429 past the queue
    try:
        sampling = sampling_for(ctx, backend, spec)
        encoded = await encode_prompts(backend, spec.prompts, ctx.settings.max_prompt_tokens, "prompt", spec.state)
        global_penalty = defaults_for(ctx, backend, spec).global_penalty if body.global_penalty is None else body.global_penalty
        penalized = [penalized_prompt_ids(tokens, backend) for tokens in encoded] if global_penalty else None
        jobs = build_jobs(encoded, sampling, response_id, spec.state, n, spec.output.constraint, penalized)
        echo = StopStringEcho(sampling.stop, backend.decode) if body.include_stop_str_in_output and sampling.stop else None
        driver = GenerationDriver(request, ctx.manager, backend, jobs, ctx.profile, ctx.metrics, ticket, transform=echo)
    except BaseException:
        ticket.release()  # the driver releases it from here on
        raise

    if body.stream:
        try:
            await driver.prime()
        except BaseException:
            await driver.aclose()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        formatter = OpenAIStreamFormatter(kind, response_id, created, model, [job.index for job in jobs], n, include_usage, tools)
        return sse_response(stream_events(driver, formatter))

    outcomes = await collect(driver, jobs)  # a client that left: ClientGone, a 499
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice_payload(kind, outcome, tools) for outcome in outcomes],
            "usage": usage_payload(outcomes, n),
        }
    )


def make_chat_endpoint(config: ChatRouteConfig) -> Callable[[Request], Awaitable[Response]]:
    async def chat_completions(request: Request) -> Response:
        payload = await read_json_object(request)
        if config.accept_native_batch and "messages" not in payload and "contents" in payload:
            handler = context(request).native_batch_handler
            if handler is None:
                raise ApiError(400, "native batch requests (`contents`) need the native routes, which this server does not include", "contents")
            return await handler(request, payload)
        if "messages" not in payload and "prompt" in payload:
            return await _completions(request, payload)  # conRWKV: a raw prompt on the chat route
        body = validate_body(ChatCompletionRequest, payload, request.url.path)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = _max_tokens(body)
        backend = context(request).manager.require_backend()
        stops = config.build_stops(body, backend)
        output = await read_off_loop(chat_output, body)
        prompt = config.build_prompt(with_tools_prompt(body, output))
        state = config.state_for(body, backend)
        spec = CompletionSpec("chat", body, [prompt], max_tokens, stops, config.sampling_overrides, logprobs, state, output)
        return await run_completion(request, spec)

    return chat_completions


def _max_tokens(body: SamplingFields) -> int | None:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


async def _completions(request: Request, payload: dict[str, Any]) -> Response:
    body = validate_body(CompletionRequest, payload, request.url.path)
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not prompts:
        raise ApiError(422, "prompt: the list must hold at least one prompt", "prompt")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    output = await read_off_loop(completion_output, body)
    spec = CompletionSpec("text", body, prompts, _max_tokens(body), stop_list(body.stop), logprobs=body.logprobs, output=output)
    return await run_completion(request, spec)


async def completions(request: Request) -> Response:
    return await _completions(request, await read_json_object(request))


RUNNER_CHAT = ChatRouteConfig()
_runner_chat = make_chat_endpoint(RUNNER_CHAT)
for _path in ("/v1/chat/completions", "/chat/completions"):
    router.add_api_route(_path, _runner_chat, methods=["POST"], name=f"chat{_path.replace('/', '_')}")
for _path in ("/v1/completions", "/completions", "/openai/v1/completions"):
    router.add_api_route(_path, completions, methods=["POST"], name=f"text{_path.replace('/', '_')}")
