"""Int8 checkpoints (`.safetensors`): saved once from a `.pth`, they load into the same int8 model
as quantizing the `.pth` at load, keep its fingerprint, and are refused when they are something
else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from albatross import int8_checkpoint
from albatross.checkpoint import read_config, read_state_dict, validate_state_dict
from albatross.model import RWKV7
from albatross.quant import LARGE_MATRICES, Int8Weight
from albatross.state import StatePool
from albatross_engine.adapter import AlbatrossRWKV
from runner.interface import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def saved(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return int8_checkpoint.save(tiny_checkpoint, tmp_path_factory.mktemp("int8") / "rwkv7-tiny-int8.safetensors")


def _logits(model: RWKV7) -> torch.Tensor:
    return model.forward(StatePool(model, 2), [0, 1], [[5, 6, 7], [8, 9]])


def test_the_saved_file_loads_into_the_model_that_quantizing_at_load_builds(tiny_checkpoint: Path, saved: Path) -> None:
    from_pth = RWKV7.load(tiny_checkpoint, progress=False, weights="int8")
    from_file = RWKV7.load(saved, progress=False, weights="int8")
    for name in ("rkv", "output", "ffn_key", "ffn_value"):
        a, b = getattr(from_pth.layers[1], name), getattr(from_file.layers[1], name)
        assert isinstance(b, Int8Weight) and torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale), name
    assert torch.equal(from_pth.layers[0].w1, from_file.layers[0].w1)
    assert torch.equal(_logits(from_pth), _logits(from_file))
    assert from_file.fingerprint == from_pth.fingerprint, "cached states are shared with the source file"
    assert from_file.name == "rwkv7-tiny-int8" and from_file.weight_bytes() == from_pth.weight_bytes()


def test_it_is_smaller_than_its_source_and_its_config_reads_without_tensors(tiny_checkpoint: Path, saved: Path) -> None:
    source = read_state_dict(tiny_checkpoint)
    matrices = [t for key, t in source.items() if key.endswith(LARGE_MATRICES)]
    elements, scales = sum(t.numel() for t in matrices), sum(t.shape[0] for t in matrices)
    expected = tiny_checkpoint.stat().st_size - 3 * elements + 4 * scales  # fp32 source: matrices at a quarter
    assert abs(saved.stat().st_size - expected) < 64 * 1024, (saved.stat().st_size, expected)
    assert read_config(saved) == validate_state_dict(read_state_dict(tiny_checkpoint))
    shapes_only = int8_checkpoint.read(saved, tensors=False)
    assert shapes_only.matrices == {} and all(t.is_meta for t in shapes_only.state_dict.values())


def test_fp16_weights_from_an_int8_file_are_its_dequantized_matrices(saved: Path) -> None:
    int8 = RWKV7.load(saved, progress=False, weights="int8")
    dense = RWKV7.load(saved, progress=False, weights="fp16")
    assert isinstance(dense.head, torch.Tensor) and isinstance(int8.head, Int8Weight)
    assert torch.equal(dense.head, int8.head.dequantize(torch.float32))
    assert torch.allclose(_logits(dense), _logits(int8), atol=1e-4, rtol=0)


def test_a_safetensors_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    save_file({"emb.weight": torch.zeros(4, 4)}, str(other))
    with pytest.raises(ValueError, match="not an albatross int8 checkpoint"):
        RWKV7.load(other, progress=False)
    with pytest.raises(ValueError, match=r"is a \.safetensors file"):
        int8_checkpoint.save(tmp_path / "absent.pth", tmp_path / "x.bin")


def test_the_engine_serves_an_int8_file(tiny_checkpoint: Path, saved: Path) -> None:
    engine = AlbatrossRWKV(str(saved), worker_num=1, batch_size=2, device="cpu", weights="int8")
    try:
        events = list(engine.generate(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))))
        assert events[-1].finish_reason == "length"
        assert engine.fingerprint == RWKV7.load(tiny_checkpoint, progress=False).fingerprint
    finally:
        engine.shutdown()
