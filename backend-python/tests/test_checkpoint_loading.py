"""Loading RWKV-7 checkpoints: dtypes, paths, config, fingerprint, refusal of other files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from albatross.checkpoint import ModelConfig, fingerprint, read_state_dict, validate_state_dict
from albatross.model import RWKV7
from albatross.random_checkpoint import CheckpointShape, random_state_dict, write_random_checkpoint
from albatross.state import StatePool

TINY = CheckpointShape(n_layer=2, n_embd=128)


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(65536) for _ in range(count)]


def _logits(model: RWKV7, tokens: list[int]) -> torch.Tensor:
    return model.forward(StatePool(model, batch_size=1), [0], [tokens])[0]


@pytest.fixture(scope="module")
def tiny_fp32_logits(tiny_checkpoint: Path) -> torch.Tensor:
    return _logits(RWKV7.load(tiny_checkpoint, progress=False), _tokens(seed=1, count=16))


def test_config_is_read_from_tensor_shapes(small_checkpoint: Path) -> None:
    model = RWKV7.load(small_checkpoint, progress=False)
    shape = CheckpointShape(n_layer=3, n_embd=256)
    assert model.config == ModelConfig(
        n_layer=3, n_embd=256, n_head=4, head_size=64, vocab_size=65536,
        decay_rank=shape.decay_rank, a_rank=shape.a_rank, value_rank=shape.value_rank,
        gate_rank=shape.gate_rank, ffn_size=1024,
    )  # fmt: skip
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert model.name == "rwkv7-small"


def test_path_may_omit_the_pth_suffix(tiny_checkpoint: Path) -> None:
    with_suffix = RWKV7.load(tiny_checkpoint, progress=False)
    without = RWKV7.load(str(tiny_checkpoint.with_suffix("")), progress=False)
    assert with_suffix.fingerprint == without.fingerprint


def test_a_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        RWKV7.load(tmp_path / "nope", progress=False)


@pytest.mark.parametrize("file_dtype", ["fp16", "bf16"])
def test_16_bit_files_load_into_an_fp32_model_close_to_the_fp32_file(
    tmp_path: Path, file_dtype: str, tiny_fp32_logits: torch.Tensor
) -> None:
    # Same seed as the tiny_checkpoint fixture: only the storage precision differs.
    path = write_random_checkpoint(tmp_path / f"tiny-{file_dtype}", TINY, seed=1, dtype=file_dtype)
    model = RWKV7.load(path, progress=False)
    assert model.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in (model.emb, model.head, model.layers[1].receptance))
    logits = _logits(model, _tokens(seed=1, count=16))
    diff = (logits - tiny_fp32_logits).abs().max().item()
    scale = tiny_fp32_logits.abs().max().item()
    assert diff <= 0.02 * scale, f"{file_dtype} file logits differ by {diff:.3f} (fp32 logit scale {scale:.2f})"
    assert int(logits.argmax()) == int(tiny_fp32_logits.argmax()), "the top token changed with the file precision"


def test_bf16_cpu_model_runs_and_stays_close_to_fp32(tiny_checkpoint: Path, tiny_fp32_logits: torch.Tensor) -> None:
    model = RWKV7.load(tiny_checkpoint, dtype=torch.bfloat16, progress=False)
    assert model.dtype == torch.bfloat16 and model.head.dtype == torch.bfloat16
    logits = _logits(model, _tokens(seed=1, count=16))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    diff = (logits - tiny_fp32_logits).abs().max().item()
    scale = tiny_fp32_logits.abs().max().item()
    assert diff <= 0.03 * scale, f"bf16 logits differ by {diff:.3f} (fp32 logit scale {scale:.2f})"


def test_weights_are_preprocessed_like_the_reference(tiny_checkpoint: Path) -> None:
    raw = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    model = RWKV7.load(tiny_checkpoint, progress=False)
    normed = torch.nn.functional.layer_norm(raw["emb.weight"], (128,), raw["blocks.0.ln0.weight"], raw["blocks.0.ln0.bias"])
    assert torch.allclose(model.emb, normed, atol=1e-6), "the embedding is not layer-normed with ln0"
    assert torch.equal(model.layers[0].receptance, raw["blocks.0.att.receptance.weight"].t()), "matrices are not [in, out]"
    assert torch.equal(model.head, raw["head.weight"].t())
    assert torch.equal(model.layers[1].r_k, raw["blocks.1.att.r_k"].flatten()), "r_k is not flattened"
    assert model.layers[0].v1 is None and model.layers[1].v1 is not None


def test_large_matrices_move_and_transpose_a_slab_at_a_time_with_the_same_result(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = RWKV7.load(tiny_checkpoint, progress=False)
    monkeypatch.setattr("albatross.model._TRANSPOSE_SLAB", 128 * 5)  # 5 rows of a 128-column matrix
    slabs = RWKV7.load(tiny_checkpoint, progress=False)
    assert torch.equal(whole.head, slabs.head) and torch.equal(whole.layers[1].rkv, slabs.layers[1].rkv)
    assert torch.equal(whole.layers[1].ffn_value, slabs.layers[1].ffn_value) and slabs.head.is_contiguous()


def test_from_state_dict_consumes_the_dict_and_matches_load(tiny_checkpoint: Path) -> None:
    state_dict = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    built = RWKV7.from_state_dict(state_dict, device="cpu", dtype=torch.float32, progress=False)
    assert state_dict == {}, f"{len(state_dict)} source tensors were kept after conversion"
    loaded = RWKV7.load(tiny_checkpoint, progress=False)
    assert built.fingerprint == loaded.fingerprint and built.name == "random"
    tokens = _tokens(seed=2, count=5)
    assert torch.equal(_logits(built, tokens), _logits(loaded, tokens))


def test_loading_shows_a_progress_bar_on_stderr_unless_disabled(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    RWKV7.load(tiny_checkpoint, progress=True)
    shown = capsys.readouterr()
    assert "loading weights" in shown.err and "69/69" in shown.err, f"no complete progress bar in stderr: {shown.err[-200:]!r}"
    assert shown.out == ""
    RWKV7.load(tiny_checkpoint, progress=False)
    assert capsys.readouterr().err == ""


def test_fingerprint_is_stable_and_tells_checkpoints_apart(tiny_checkpoint: Path, tmp_path: Path) -> None:
    first = fingerprint(read_state_dict(tiny_checkpoint))
    assert first == fingerprint(read_state_dict(tiny_checkpoint)), "the fingerprint of one file changed between reads"
    assert len(first) == 64 and int(first, 16) >= 0
    other_seed = write_random_checkpoint(tmp_path / "seed7", TINY, seed=7)
    other_dtype = write_random_checkpoint(tmp_path / "half", TINY, seed=1, dtype="fp16")
    assert fingerprint(read_state_dict(other_seed)) != first, "different weights share a fingerprint"
    assert fingerprint(read_state_dict(other_dtype)) != first, "a different storage dtype shares a fingerprint"
    retrained = read_state_dict(tiny_checkpoint)
    retrained = {k: v.clone() for k, v in retrained.items()}
    retrained["blocks.1.att.k_a"] += 0.01  # one small tensor of one layer changed
    assert fingerprint(retrained) != first, "changing one layer's k_a kept the fingerprint"


# ------------------------------------------------------------------------------------------------
# refusal of checkpoints that are not RWKV-7


@pytest.fixture()
def tiny_state_dict() -> dict[str, torch.Tensor]:
    return random_state_dict(TINY, seed=3)


def test_a_missing_key_is_named(tiny_state_dict: dict[str, torch.Tensor]) -> None:
    del tiny_state_dict["blocks.1.att.k_a"]
    with pytest.raises(ValueError, match=r"missing key 'blocks\.1\.att\.k_a'"):
        validate_state_dict(tiny_state_dict)


def test_a_misshaped_key_is_named_with_both_shapes(tiny_state_dict: dict[str, torch.Tensor]) -> None:
    tiny_state_dict["blocks.0.ffn.value.weight"] = torch.randn(128, 256)
    with pytest.raises(ValueError, match=r"'blocks\.0\.ffn\.value\.weight' has shape \[128, 256\], expected \[128, 512\]"):
        RWKV7.from_state_dict(tiny_state_dict, progress=False)


def test_an_unexpected_key_is_named(tiny_state_dict: dict[str, torch.Tensor]) -> None:
    tiny_state_dict["blocks.1.ffn.s_emb.weight"] = torch.randn(65536, 32)
    with pytest.raises(ValueError, match=r"unexpected key 'blocks\.1\.ffn\.s_emb\.weight'"):
        validate_state_dict(tiny_state_dict)


def test_an_rwkv6_checkpoint_is_refused_naming_its_first_missing_rwkv7_key(tmp_path: Path) -> None:
    C = 128
    rwkv6 = {"emb.weight": torch.randn(65536, C), "blocks.0.ln0.weight": torch.ones(C), "blocks.0.ln0.bias": torch.zeros(C)}
    for i in range(2):
        p = f"blocks.{i}."
        rwkv6 |= {p + "ln1.weight": torch.ones(C), p + "ln1.bias": torch.zeros(C), p + "ln2.weight": torch.ones(C), p + "ln2.bias": torch.zeros(C)}
        rwkv6 |= {p + f"att.time_maa_{n}": torch.rand(1, 1, C) for n in ("x", "w", "k", "v", "r", "g")}
        rwkv6 |= {p + "att.time_decay": torch.randn(1, 1, C), p + "att.time_faaaa": torch.randn(2, 64)}
        rwkv6 |= {p + f"att.{n}.weight": torch.randn(C, C) for n in ("receptance", "key", "value", "output", "gate")}
        rwkv6 |= {p + "ffn.time_maa_k": torch.rand(1, 1, C), p + "ffn.key.weight": torch.randn(4 * C, C)}
    rwkv6 |= {"ln_out.weight": torch.ones(C), "ln_out.bias": torch.zeros(C), "head.weight": torch.randn(65536, C)}
    path = tmp_path / "rwkv6.pth"
    torch.save(rwkv6, path)
    with pytest.raises(ValueError, match=r"not an RWKV-7 checkpoint: missing key 'blocks\.0\.att\.x_r'"):
        RWKV7.load(path, progress=False)


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.pth"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(ValueError, match="not a state dict"):
        RWKV7.load(path, progress=False)


def test_unused_value_weights_in_block_0_are_accepted_and_ignored(tiny_state_dict: dict[str, torch.Tensor]) -> None:
    reference = {k: v.clone() for k, v in tiny_state_dict.items()}
    for name in ("v0", "v1", "v2"):
        tiny_state_dict[f"blocks.0.att.{name}"] = torch.randn_like(tiny_state_dict[f"blocks.1.att.{name}"])
    tokens = _tokens(seed=4, count=4)
    with_extra = _logits(RWKV7.from_state_dict(tiny_state_dict, progress=False), tokens)
    assert torch.equal(with_extra, _logits(RWKV7.from_state_dict(reference, progress=False), tokens))


def test_an_unknown_dtype_name_lists_the_known_ones(tiny_state_dict: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="known: .*bf16"):
        RWKV7.from_state_dict(tiny_state_dict, dtype="fp8", progress=False)
