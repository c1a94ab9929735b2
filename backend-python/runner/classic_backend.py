"""The classic backend: one request at a time on the official `rwkv` package (RWKV-7 mode).

Strategies `cpu fp32`, `cpu bf16`, `cuda fp16`, `cuda bf16`. It is the correctness baseline, not a
fast path: the prompt goes through the package's forward in one call, then one forward per token.
Sampling, penalties and seeds follow albatross.sampler (one row), text and stop strings
albatross.detokenizer, when a request ends albatross.stopping, so a request means the same here as
on the Albatross backend.

A request's output constraint (`response_format`, `tools`) is applied for real: before each token
the request's grammar matcher fills the allowed-token mask that the sampler applies, and the
sampled token advances the matcher; a grammar that reaches its end finishes with "stop".

Usage: `prompt_tokens` is the prompt's length; `completion_tokens` counts every token the model
produced for the request, including a stop token (an id in `stop_token_ids`) and the token that
completed a stop string. Logprobs (when asked) are of the model's own distribution, before
penalties and temperature.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from albatross.constraints import MASK_WORDS, CompiledGrammar, ConstraintCompiler, ConstraintError, TokenMatcher
from albatross.detokenizer import TextStream
from albatross.sampler import AllowedTokens, PenaltyPool, SamplingBatch, sample, seed_to_seed32, top_logprobs
from albatross.stopping import accept_token
from albatross.tokenizer import Tokenizer, get_tokenizer
from runner.interface import (
    AbstractRWKV,
    BackendError,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    TokenLogprob,
    compile_request_grammar,
    output_grammar_failed,
)
from runner.state_file import InitialState

log = logging.getLogger(__name__)

VALID_STRATEGIES: tuple[str, ...] = ("cpu fp32", "cpu bf16", "cuda fp16", "cuda bf16")
_FINISHED = object()  # end-of-stream marker on the async queue


def normalize_strategy(strategy: str) -> str:
    """`"  CPU   fp32 "` -> `"cpu fp32"`; anything else is refused with the list of valid ones."""
    normalized = " ".join(strategy.lower().split())
    if normalized not in VALID_STRATEGIES:
        raise ValueError(f"unsupported classic strategy {strategy!r}; valid strategies: {', '.join(VALID_STRATEGIES)}")
    if normalized.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"strategy {normalized!r} needs CUDA, which this machine does not have; use 'cpu fp32' or 'cpu bf16'")
    return normalized


def rwkv_model_module() -> types.ModuleType:
    """The official package's `rwkv.model`, imported with RWKV_V7_ON=1 (it picks its model family
    at its first import) and without its side effect on torch: that import turns on TF32 for every
    fp32 CUDA matmul of the process (and cuDNN's benchmark mode), which would silently lower the
    precision of the Albatross model's fp32 paths in the same server and of the GPU tests' fp32
    twins. The flags are put back as they were."""
    os.environ["RWKV_V7_ON"] = "1"
    backends = torch.backends
    flags = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, backends.cudnn.benchmark)
    try:
        import rwkv.model
    finally:
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, backends.cudnn.benchmark = flags
    return rwkv.model


def _rwkv7_model_class() -> Any:
    """The package's RWKV-7 class."""
    model_module = rwkv_model_module()
    model_class = getattr(model_module, "RWKV_x070", None)
    if model_class is None:
        raise RuntimeError("rwkv.model was imported without RWKV_V7_ON=1 earlier in this process; restart the server")
    return model_class


def _checkpoint_base(model_path: str | os.PathLike[str]) -> Path:
    """The package appends `.pth` itself."""
    path = Path(model_path)
    base = path.with_suffix("") if path.suffix == ".pth" else path
    if not base.with_name(base.name + ".pth").is_file():
        raise FileNotFoundError(f"checkpoint not found: {base}.pth")
    return base


class ClassicRWKV(AbstractRWKV):
    backend_name = "classic"
    concurrent = False

    def __init__(self, model_path: str | os.PathLike[str], strategy: str, tokenizer: Tokenizer | None = None) -> None:
        self.strategy = normalize_strategy(strategy)
        base = _checkpoint_base(model_path)
        self.name = base.name
        self.version = 7
        self.tokenizer_len = 65536
        self.device = torch.device("cuda" if self.strategy.startswith("cuda") else "cpu")
        self.tokenizer = tokenizer or get_tokenizer()
        self._model: Any = _rwkv7_model_class()(str(base), self.strategy)
        self._grammars = ConstraintCompiler(self.tokenizer)
        self._model_lock = threading.Lock()  # one generation at a time, even if a caller forgets the runner's lock
        self._aborts: set[threading.Event] = set()
        self._aborts_lock = threading.Lock()
        self._initial_wkv: list[torch.Tensor] | None = None  # a state file's WKV matrices, per layer

    # ---- AbstractRWKV ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        grammar = self._check(request)
        return self._generate(request, threading.Event(), grammar)

    async def async_generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Runs the synchronous loop in a worker thread; closing this iterator aborts it."""
        grammar = self._check(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        abort = threading.Event()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody listens any more
                abort.set()

        def produce() -> None:
            try:
                for event in self._generate(request, abort, grammar):
                    deliver(event)
            except BaseException as exc:  # delivered to the consumer, which re-raises it
                deliver(exc)
            finally:
                deliver(_FINISHED)

        worker = threading.Thread(target=produce, name=f"classic-generate-{request.request_id}", daemon=True)
        worker.start()
        try:
            while True:
                item = await queue.get()
                if item is _FINISHED:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, GenerationEvent)
                yield item
        finally:
            abort.set()

    def status(self) -> dict[str, object]:
        return {"strategy": self.strategy, "device": str(self.device)}

    def set_initial_state(self, state: InitialState | None) -> None:
        """The package's state list takes the file's matrices as each layer's WKV state, as
        RWKV-Runner's load_rwkv_state does for RWKV-7 (no transpose); the shifts stay zero."""
        if state is None:
            self._initial_wkv = None
            return
        model = self._model
        if model is None:
            raise BackendError(503, "the model has been shut down")
        state.check_fits(model.n_layer, model.n_embd // model.head_size, model.head_size)
        self._initial_wkv = [state.wkv[i].to(self.device, torch.float32).contiguous() for i in range(model.n_layer)]

    def shutdown(self) -> None:
        with self._aborts_lock:
            for abort in self._aborts:
                abort.set()
        # a generation notices the abort within one token; a stalled synchronous caller is not waited for
        acquired = self._model_lock.acquire(timeout=30.0)
        try:
            self._model = None
        finally:
            if acquired:
                self._model_lock.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- generation -----------------------------------------------------------------------------

    def _check(self, request: GenerationRequest) -> CompiledGrammar | None:
        """Refusals before anything runs; the request's grammar, compiled (cached by its text)."""
        if request.state is not None:
            raise BackendError(400, "state sessions need the albatross backend")
        bad = [token_id for token_id in request.prompt_tokens if not 0 <= token_id < self.tokenizer_len]
        if bad:
            raise BackendError(400, f"prompt token ids must lie in [0, {self.tokenizer_len}); got {bad[:5]}")
        bad = [token_id for token_id, _ in request.sampling.logit_bias if token_id >= self.tokenizer_len]
        if bad:
            raise BackendError(400, f"logit_bias token ids must lie in [0, {self.tokenizer_len}); got {bad[:5]}")
        if self._model is None:
            raise BackendError(503, "the model has been shut down")
        return compile_request_grammar(self._grammars, request.constraint)

    def _generate(self, request: GenerationRequest, abort: threading.Event, grammar: CompiledGrammar | None = None) -> Iterator[GenerationEvent]:
        with self._aborts_lock:
            self._aborts.add(abort)
        matcher = grammar.matcher() if grammar is not None else None
        try:
            with self._model_lock:
                if self._model is None:
                    raise BackendError(503, "the model has been shut down")
                yield from self._generate_locked(request, matcher, abort)
        finally:
            if matcher is not None:
                matcher.free()
            with self._aborts_lock:
                self._aborts.discard(abort)

    def _allowed(self, matcher: TokenMatcher, mask: np.ndarray) -> AllowedTokens:
        """The next token's allowed ids as the sampler's one-row mask (ConstraintError if none)."""
        matcher.fill_bitmask(mask)
        words = torch.from_numpy(mask).to(self.device).reshape(1, MASK_WORDS)
        return AllowedTokens(index=torch.zeros(1, dtype=torch.int64, device=self.device), words=words)

    def _generate_locked(self, request: GenerationRequest, matcher: TokenMatcher | None, abort: threading.Event) -> Iterator[GenerationEvent]:
        sampling = request.sampling
        prompt_tokens = len(request.prompt_tokens)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(64)
        batch = SamplingBatch.from_params([sampling], [seed_to_seed32(seed)], [0], device=self.device)
        penalties = PenaltyPool(1, self.tokenizer_len, device=self.device)
        penalties.seed(0, request.penalized_prompt_ids, sampling)
        slot = torch.zeros(1, dtype=torch.int64, device=self.device)
        stream = TextStream(self.tokenizer, sampling.stop)
        stop_ids = frozenset(sampling.stop_token_ids)
        mask = np.zeros(MASK_WORDS, dtype=np.int32)

        if sampling.max_tokens == 0:
            yield GenerationEvent(finish_reason="length", prompt_tokens=prompt_tokens)
            return
        try:
            logits, state = self._model.forward(list(request.prompt_tokens), self._start_state())
        except Exception as exc:
            log.exception("classic prefill failed")
            yield GenerationEvent(finish_reason="error", error=str(exc) or type(exc).__name__, prompt_tokens=prompt_tokens)
            return

        for step in range(sampling.max_tokens):
            if abort.is_set():
                yield GenerationEvent(finish_reason="abort", prompt_tokens=prompt_tokens, completion_tokens=step)
                return
            try:
                row = logits.float().reshape(1, -1)
                batch.step.fill_(step)
                if matcher is not None:
                    batch.allowed = self._allowed(matcher, mask)
                token_id = int(sample(row, slot, batch, penalties)[0])
                logprobs = None if sampling.logprobs is None else [self._logprob(row, token_id, sampling.logprobs)]
                if matcher is not None and not matcher.advance(token_id):
                    raise output_grammar_failed(f"it refused the sampled token {token_id}: {matcher.error()}")
                complete = matcher is not None and matcher.is_terminated()
                outcome = accept_token(stream, token_id, stop_ids, step + 1, sampling.max_tokens, complete)
                # Unlike the engine's events, the classic ones carry a stop token's id too.
                yield self._event(outcome.text, token_id, outcome.finish_reason, prompt_tokens, step + 1, logprobs)
                if outcome.finish_reason is not None:
                    return
                logits, state = self._model.forward([token_id], state)
            except BackendError:
                raise  # the request's own grammar failed: its status reaches the client
            except ConstraintError as exc:  # the matcher failed before this token's mask (fill_bitmask)
                raise output_grammar_failed(str(exc)) from exc
            except Exception as exc:
                log.exception("classic generation failed at token %d", step)
                yield GenerationEvent(
                    finish_reason="error", error=str(exc) or type(exc).__name__, prompt_tokens=prompt_tokens, completion_tokens=step
                )
                return

    def _start_state(self) -> list[torch.Tensor]:
        """The package's state layout (per layer: time-mix shift, WKV matrices, channel-mix shift),
        built from this model's own dtype: the package's generate_zero_state reads module globals
        that the most recently loaded model set. Zeros, or the state file's WKV matrices."""
        weights = self._model.z
        dtype, device = weights["emb.weight"].dtype, weights["emb.weight"].device
        n_embd, head_size = self._model.n_embd, self._model.head_size
        initial = self._initial_wkv
        state: list[torch.Tensor] = []
        for layer in range(self._model.n_layer):
            state.append(torch.zeros(n_embd, dtype=dtype, device=device))
            if initial is not None:
                state.append(initial[layer].clone())
            else:
                state.append(torch.zeros(n_embd // head_size, head_size, head_size, dtype=torch.float32, device=device))
            state.append(torch.zeros(n_embd, dtype=dtype, device=device))
        return state

    @staticmethod
    def _event(
        text: str,
        token_id: int,
        finish_reason: FinishReason | None,
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: list[TokenLogprob] | None,
    ) -> GenerationEvent:
        return GenerationEvent(
            text=text,
            token_ids=[token_id],
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            logprobs=logprobs,
        )

    def _logprob(self, logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
        chosen = torch.tensor([token_id], device=logits.device)
        result = top_logprobs(logits, top, chosen)
        assert result.chosen is not None
        top_pairs = zip(result.top_ids[0].tolist(), result.top_values[0].tolist())
        return TokenLogprob(
            token_id=token_id,
            text=self.tokenizer.decode([token_id]),
            logprob=float(result.chosen[0]),
            top=[(top_id, self.tokenizer.decode([top_id]), value) for top_id, value in top_pairs],
        )


def create_backend(model_path: str | os.PathLike[str], strategy: str, settings: object = None) -> ClassicRWKV:
    """The registry's factory for `cpu ...` / `cuda ...` strategies (settings are not needed)."""
    return ClassicRWKV(model_path, strategy)


def check_load(model_path: str, strategy: str) -> None:
    """The registry's first preflight: the strategy, and no random-weights spec (the checkpoint's
    format is the next one's)."""
    from runner.backends import LoadRefused

    try:
        normalize_strategy(strategy)
    except ValueError as exc:
        raise LoadRefused(str(exc), "strategy") from exc
    if model_path.startswith("random:") or model_path.endswith(".safetensors"):
        raise LoadRefused(f"the classic backend loads .pth checkpoints only; {model_path!r} needs an albatross strategy", "model")
