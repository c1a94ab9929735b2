"""The native batch routes (rwkv_lightning API, see docs/api.md): batch chat, v2, big batch, FIM,
translation, and the OpenAI chat route with rwkv_lightning's defaults and prompt format.

Prompts are used verbatim (no template) except where a route says otherwise. Every prompt is its
own generation; on the Albatross backend they all join the engine's shared batch at once.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runner.context import context, register_native_batch_handler
from runner.errors import ApiError
from runner.interface import SamplingParams, StateRef
from runner.native_batch import NativeSpec, collect_native, run_native
from runner.native_schemas import (
    BigBatchRequest,
    FimRequest,
    NativeBatchRequest,
    NativeBatchRequestV2,
    TranslateRequest,
)
from runner.routes.openai import CompletionSpec, run_completion
from runner.structured_output import chat_output, read_off_loop, with_tools_prompt
from runner.schemas import ChatCompletionRequest, read_json_object, validate_body
from runner.sessions import session_store_of

router = APIRouter()

BATCH_ID = "rwkv7-batch"
BATCH_V2_ID = "rwkv7-batch-v2"
FIM_OBJECT = "FIM.completion"

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "✿prefix✿", "✿suffix✿", "✿middle✿"

LANGUAGE_NAMES: dict[str, str] = {
    "zh-CN": "Chinese",
    "zh-TW": "Chinese",
    "en": "English",
    "ja": "Japanese",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "ru": "Russian",
    "ko": "Korean",
}


def _spec(body: NativeBatchRequest, prompts: list[str], response_id: str, sampling: SamplingParams, stream: bool, obj: str = "chat.completion", field_name: str = "contents") -> NativeSpec:
    return NativeSpec(prompts, sampling, body.model, response_id, stream, body.chunk_size, field_name=field_name, obj=obj)


async def native_batch(request: Request, payload: dict[str, Any]) -> Response:
    """`/v1/chat/completions` with `contents` (the runner's chat route hands such bodies here)."""
    body = validate_body(NativeBatchRequest, payload, request.url.path)
    return await run_native(request, _spec(body, body.contents, BATCH_ID, body.sampling(), body.stream))


@router.post("/v2/chat/completions")
async def native_batch_v2(request: Request) -> Response:
    body = validate_body(NativeBatchRequestV2, await read_json_object(request), request.url.path)
    return await run_native(request, _spec(body, body.contents, BATCH_V2_ID, body.sampling(), body.stream))


@router.post("/big_batch/completions")
async def big_batch(request: Request) -> Response:
    body = validate_body(BigBatchRequest, await read_json_object(request), request.url.path)
    return await run_native(request, _spec(body, body.contents, BATCH_ID, body.sampling(), stream=True))


def fim_prompt(prefix: str, suffix: str) -> str:
    return f"{FIM_PREFIX}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{prefix}"


@router.post("/FIM/v1/batch-FIM")
async def batch_fim(request: Request) -> Response:
    body = validate_body(FimRequest, await read_json_object(request), request.url.path)
    if len(body.prefix) != len(body.suffix):
        raise ApiError(400, f"prefix and suffix must have the same length (got {len(body.prefix)} and {len(body.suffix)})", "suffix")
    prompts = [fim_prompt(prefix, suffix) for prefix, suffix in zip(body.prefix, body.suffix, strict=True)]
    # FIM ends only at end-of-text or max_tokens: stop strings would cut code at arbitrary text.
    spec = _spec(body, prompts, BATCH_ID, body.sampling(stops=()), body.stream, obj=FIM_OBJECT, field_name="prefix")
    return await run_native(request, spec)


_SCRIPTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ja", re.compile(r"[\u3040-\u30ff]")),
    ("ko", re.compile(r"[\uac00-\ud7af\u1100-\u11ff]")),
    ("zh-CN", re.compile(r"[\u4e00-\u9fff]")),
    ("ru", re.compile(r"[\u0400-\u04ff]")),
)


def detect_language(text: str) -> str:
    """A script-based guess for `source_lang: "auto"`: kana -> ja, hangul -> ko, Han -> zh-CN,
    Cyrillic -> ru, otherwise en."""
    for code, pattern in _SCRIPTS:
        if pattern.search(text):
            return code
    return "en"


def translation_prompt(source_lang: str, target_lang: str, text: str) -> str:
    source = LANGUAGE_NAMES.get(source_lang, source_lang)
    target = LANGUAGE_NAMES.get(target_lang, target_lang)
    return f"{source}: {text}\n\n{target}:"


@router.post("/translate/v1/batch-translate")
async def batch_translate(request: Request) -> Response:
    body = validate_body(TranslateRequest, await read_json_object(request), request.url.path)
    sources = [detect_language(text) if body.source_lang == "auto" else body.source_lang for text in body.text_list]
    prompts = [translation_prompt(source, body.target_lang, text) for source, text in zip(sources, body.text_list, strict=True)]
    greedy = SamplingParams(max_tokens=body.max_tokens, temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, frequency_penalty=0.0, penalty_decay=1.0)
    spec = NativeSpec(prompts, greedy, "rwkv7", "rwkv7-translate", stream=False, chunk_size=1, field_name="text_list")
    outcomes = await collect_native(request, spec)
    translations = [{"detected_source_lang": source, "text": outcome.text.strip()} for source, outcome in zip(sources, outcomes, strict=True)]
    return JSONResponse({"translations": translations})


# ---- /openai/v1/chat/completions ------------------------------------------------------------

OPENAI_NATIVE_DEFAULTS: dict[str, Any] = {
    "max_tokens": 4096,
    "top_k": 20,
    "top_p": 0.6,
    "presence_penalty": 1.0,
    "frequency_penalty": 0.1,
    "penalty_decay": 0.996,
    "global_penalty": False,  # a Runner setting; rwkv_lightning's route never penalises the prompt
}
OPENAI_NATIVE_STOPS: tuple[str, ...] = ("\nUser:",)
THINK_OPEN = "Assistant: <think"
THINK_SKIPPED = "Assistant: <think>\n</think>\n"


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type == "text")


def lightning_chat_prompt(body: ChatCompletionRequest, system: str | None, enable_think: bool, extra_user: str | None = None) -> str:
    """rwkv_lightning's chat format: one `System:` block merging the `system` field and every
    system/developer message, then `User:` / `Assistant:` turns, then the assistant header with the
    think tag (open when `enable_think`, closed empty otherwise)."""
    system_parts = [_clean(system)] if system and _clean(system) else []
    turns: list[str] = []
    for message in body.messages:
        text = _clean(_message_text(message.content))
        if not text:
            continue
        if message.role in ("system", "developer"):
            system_parts.append(text)
        elif message.role == "user":
            turns.append(f"User: {text}")
        elif message.role == "assistant":
            turns.append(f"Assistant: {text}")
        else:  # tool results read as observations, as in the runner's template
            turns.append(f"Observation: {text}")
    if extra_user and _clean(extra_user):
        turns.append(f"User: {_clean(extra_user)}")
    blocks = ([f"System: {chr(10).join(system_parts)}"] if system_parts else []) + turns
    if not blocks:
        raise ApiError(400, "the conversation holds no system or user text", "messages")
    return "\n\n".join(blocks) + "\n\n" + (THINK_OPEN if enable_think else THINK_SKIPPED)


def _extra(body: ChatCompletionRequest, name: str, kind: type, default: Any) -> Any:
    value = (body.model_extra or {}).get(name, default)
    if value is not None and not isinstance(value, kind):
        raise ApiError(422, f"{name}: must be a {kind.__name__}", name)
    return default if value is None else value


async def openai_native_chat(request: Request) -> Response:
    """`/openai/v1/chat/completions`: the OpenAI chat route with rwkv_lightning's defaults, its
    prompt format, `enable_think`, and `use_prefix_cache` (default true) on backends with a cache."""
    payload = await read_json_object(request)
    if payload.get("messages"):
        body = validate_body(ChatCompletionRequest, payload, request.url.path)
    else:
        body = _validate_without_messages(payload, request.url.path)
    system = _extra(body, "system", str, None)
    enable_think = _extra(body, "enable_think", bool, False)
    use_prefix_cache = _extra(body, "use_prefix_cache", bool, True)
    contents = _extra(body, "contents", list, [])
    output = await read_off_loop(chat_output, body)
    if enable_think and output.constraint is not None:
        raise ApiError(400, f"enable_think cannot be combined with {output.constraint.label} (the constraint would hold the thinking too)", "enable_think")
    prompt = lightning_chat_prompt(with_tools_prompt(body, output), system, enable_think, contents[0] if contents and isinstance(contents[0], str) else None)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stops = OPENAI_NATIVE_STOPS if body.stop is None else ((body.stop,) if isinstance(body.stop, str) else tuple(body.stop))
    backend = context(request).manager.require_backend()
    # Only a backend with a state cache resumes from prefixes; the others refuse any StateRef.
    state = StateRef(use_prefix_cache=True) if use_prefix_cache and session_store_of(backend) is not None else None
    return await run_completion(request, CompletionSpec("chat", body, [prompt], max_tokens, stops, OPENAI_NATIVE_DEFAULTS, logprobs, state, output))


def _validate_without_messages(payload: dict[str, Any], route: str) -> ChatCompletionRequest:
    """rwkv_lightning clients may send only `system` and `contents`: validate the other fields with
    a placeholder message, then drop it."""
    body = validate_body(ChatCompletionRequest, {**payload, "messages": [{"role": "user", "content": ""}]}, route)
    body.messages = []
    return body


router.add_api_route("/openai/v1/chat/completions", openai_native_chat, methods=["POST"], name="openai_native_chat")


def install(app: FastAPI) -> None:
    register_native_batch_handler(app, native_batch)
