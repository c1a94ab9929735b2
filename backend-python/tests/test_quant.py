"""Int8 weights (W8A16) on the CPU: the quantizer, the torch twin every kernel is tested against,
the dequantize path's column slabs, and a model loaded with `weights=int8`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from albatross import int8_dispatch, linear
from albatross.model import RWKV7
from albatross.quant import QMAX, Int8Weight, check_weight_format, int8_mm_torch, quantize
from albatross.random_checkpoint import CheckpointShape, random_state_dict
from albatross.state import StatePool
from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.config import AlbatrossBackendConfig, parse_albatross_strategy
from runner.interface import GenerationRequest, SamplingParams
from runner.settings import settings_from_args

TINY = CheckpointShape(n_layer=2, n_embd=128)


def _matrix(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_each_weight_is_within_half_a_step_of_its_channel_scale() -> None:
    W = _matrix(96, 40) * torch.linspace(0.01, 3.0, 40)  # columns of very different ranges
    weight = quantize(W)
    assert weight.q.dtype == torch.int8 and weight.q.shape == (96, 40) and weight.scale.shape == (40,)
    assert torch.allclose(weight.scale, W.abs().amax(0) / QMAX)
    error = (weight.dequantize(torch.float32) - W).abs()
    assert bool((error <= weight.scale / 2 + 1e-7).all()), f"worst error {float((error / weight.scale).max()):.3f} steps"
    assert int(weight.q.min()) >= -QMAX, "-128 must never be produced (symmetric range)"
    assert int(weight.q.abs().amax(0).min()) == QMAX, "each column's largest weight maps to +-127"


def test_a_zero_column_stays_zero_and_16_bit_sources_quantize_like_fp32() -> None:
    W = _matrix(64, 8, seed=1)
    W[:, 3] = 0
    weight = quantize(W)
    assert float(weight.scale[3]) == 0 and int(weight.q[:, 3].abs().sum()) == 0
    assert torch.isfinite(weight.dequantize(torch.float32)).all()
    half = W.to(torch.bfloat16)
    assert torch.equal(quantize(half).q, quantize(half.float()).q), "quantization runs in fp32 whatever the source"


def test_large_matrices_quantize_in_slabs_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    W = _matrix(3, 32, 100, seed=2)  # a stack, as receptance/key/value
    whole = quantize(W)
    monkeypatch.setattr("albatross.quant._QUANTIZE_SLAB", 3 * 32 * 7)  # 7 columns at a time
    slabs = quantize(W)
    assert torch.equal(whole.q, slabs.q) and torch.equal(whole.scale, slabs.scale)
    assert whole[1].q.shape == (32, 100) and torch.equal(whole[1].q, quantize(W[1]).q)
    half = W[0].half()
    moved = quantize(half.t().contiguous().t(), torch.device("cpu"))  # a transposed view, as loading hands it
    assert torch.equal(moved.q, quantize(half).q) and torch.equal(moved.scale, quantize(half).scale)


def test_the_twin_is_the_product_with_the_dequantized_matrix() -> None:
    weight = quantize(_matrix(64, 48, seed=3))
    x = _matrix(5, 64, seed=4)
    assert torch.equal(int8_mm_torch(x, weight), x @ weight.dequantize(torch.float32))
    stack = quantize(_matrix(3, 64, 48, seed=5))
    xs = _matrix(3, 2, 64, seed=6)
    assert torch.equal(linear.bmm(xs, stack), torch.bmm(xs, stack.dequantize(torch.float32)))


def test_the_dequantize_path_cuts_large_matrices_into_column_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = quantize(_matrix(64, 200, seed=7))
    x = _matrix(7, 64, seed=8)
    assert int8_dispatch.path_for(x, weight) == "dequantize", "the CPU has no int8 kernel"
    whole = int8_dispatch.int8_mm(x, weight)
    monkeypatch.setattr(int8_dispatch, "DEQUANTIZE_SLAB", 64 * 48)
    sliced = int8_dispatch.int8_mm(x, weight)
    assert torch.allclose(sliced, whole, atol=1e-5, rtol=0), "slabs of 48 columns (the last one 8) give the same product"
    assert torch.allclose(whole, x @ weight.dequantize(torch.float32), atol=1e-5, rtol=0)


def test_bad_operands_are_refused_with_their_shapes() -> None:
    with pytest.raises(ValueError, match="int8"):
        Int8Weight(torch.zeros(4, 4), torch.zeros(4))
    with pytest.raises(ValueError, match="scale must be fp32"):
        Int8Weight(torch.zeros(4, 6, dtype=torch.int8), torch.zeros(4))
    with pytest.raises(ValueError, match=r"cannot multiply x \[2, 5\]"):
        linear.mm(torch.zeros(2, 5), quantize(_matrix(4, 6)))
    with pytest.raises(ValueError, match="known: fp16, int8"):
        check_weight_format("int4")


# ---------------------------------------------------------------------------------------------
# The model with int8 weights


@pytest.fixture(scope="module")
def models() -> tuple[RWKV7, RWKV7]:
    reference = RWKV7.from_state_dict(random_state_dict(TINY, seed=1), "cpu", torch.float32, progress=False)
    int8 = RWKV7.from_state_dict(random_state_dict(TINY, seed=1), "cpu", torch.float32, progress=False, weights="int8")
    return reference, int8


def test_the_large_matrices_are_int8_and_everything_else_keeps_the_model_dtype(models: tuple[RWKV7, RWKV7]) -> None:
    reference, model = models
    layer = model.layers[1]
    for name in ("rkv", "receptance", "key", "value", "output", "ffn_key", "ffn_value"):
        assert isinstance(getattr(layer, name), Int8Weight), f"{name} should be int8"
    assert isinstance(model.head, Int8Weight) and model.head.q.shape == (128, 65536), "head [in, out], one scale per token"
    for name in ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2", "att_mix", "ln1_weight", "k_k"):
        assert getattr(layer, name).dtype == torch.float32, f"{name} stays in the model dtype"
    assert model.emb.dtype == torch.float32 and model.weights == "int8" and reference.weights == "fp16"
    matrices = 4 * 128 * 128 + 2 * 128 * 512  # per layer
    assert reference.weight_bytes() - model.weight_bytes() == 3 * (2 * matrices + 128 * 65536) - 4 * (2 * (4 * 128 + 640) + 65536)


def test_int8_logits_stay_close_to_the_float_model_and_pick_the_same_tokens(models: tuple[RWKV7, RWKV7]) -> None:
    reference, model = models
    rng = random.Random(5)
    prompts = [[rng.randrange(65536) for _ in range(24)] for _ in range(4)]
    ref_pool, pool = StatePool(reference, 4), StatePool(model, 4)
    expected = reference.forward(ref_pool, range(4), prompts)
    actual = model.forward(pool, range(4), prompts)
    error = float((actual - expected).norm() / expected.norm())
    assert error < 0.03, f"relative logit error {error:.3e}"  # measured 0.010 on this model
    agree = 0
    for _ in range(16):  # greedy decode, each model fed its own tokens
        expected_tokens, tokens = expected.argmax(-1).tolist(), actual.argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(expected_tokens, tokens))
        expected = reference.forward(ref_pool, range(4), [[t] for t in expected_tokens])
        actual = model.forward(pool, range(4), [[t] for t in expected_tokens])  # teacher-forced
    assert agree >= 60, f"greedy agreement {agree}/64"


def test_int8_loads_from_a_16_bit_file_into_16_bit_activations(tiny_checkpoint: Path) -> None:
    model = RWKV7.load(tiny_checkpoint, "cpu", "bf16", progress=False, weights="int8")
    assert model.dtype == torch.bfloat16 and isinstance(model.layers[0].output, Int8Weight)
    logits = model.forward(StatePool(model, 1), [0], [[1, 2, 3]])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# The switches: strategy, --inference-engine, status


def test_weights_int8_is_a_strategy_word_and_a_bad_format_keeps_the_default() -> None:
    assert parse_albatross_strategy("albatross weights=int8").weights == "int8"
    assert parse_albatross_strategy("albatross weights=INT8 batch=4").weights == "int8"
    assert parse_albatross_strategy("albatross weights=int4").weights == "fp16"
    with pytest.raises(ValueError, match="weights must be one of fp16, int8"):
        AlbatrossBackendConfig(weights="int4")


def test_inference_engine_int8_is_the_albatross_strategy_with_int8_weights() -> None:
    strategy = settings_from_args(["--inference-engine", "int8"], environ={}).strategy
    assert strategy == "albatross workers=1 batch=32 weights=int8"
    assert parse_albatross_strategy(strategy).weights == "int8"


def test_an_int8_engine_generates_and_shows_its_weights_in_status(tiny_checkpoint: Path) -> None:
    engine = AlbatrossRWKV(str(tiny_checkpoint), worker_num=1, batch_size=2, device="cpu", weights="int8")
    try:
        events = list(engine.generate(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))))
        assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 4
        assert engine.status()["weights"] == "int8"
    finally:
        engine.shutdown()
