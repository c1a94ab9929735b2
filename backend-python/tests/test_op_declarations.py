"""Each op is declared once, in albatross/ops.py: the schema and its torch twin as the default
kernel; a kernel library adds only a backend kernel for that schema. Shown on the CPU with a
small stable-ABI library built here against the installed torch, standing in for a CUDA one."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from albatross import kernel_build, ops, sampler

N = ops.HEAD_SIZE


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _wkv7_case(gen: torch.Generator) -> tuple[tuple[object, ...], tuple[int, ...]]:
    lengths = [2, 1, 3]
    T, C = sum(lengths), 2 * N
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    kk = F.normalize(_randn(gen, T, 2, N), dim=-1).view(T, C)
    args = (_randn(gen, 4, 2, N, N, scale=0.1), torch.tensor([3, 0, 2], dtype=torch.int32), cu, _randn(gen, T, C),
            -0.5 - torch.rand(T, C, generator=gen), _randn(gen, T, C, scale=0.3), _randn(gen, T, C), -kk, kk * 0.5)  # fmt: skip
    return args, (0,)


def _per_head_inputs(gen: torch.Generator, rows: int, C: int, count: int) -> list[torch.Tensor]:
    return [_randn(gen, rows, C) for _ in range(count)]


# Each declared op: (arguments, indices of the arguments it updates in place).
def _cases(gen: torch.Generator) -> dict[str, list[tuple[tuple[object, ...], tuple[int, ...]]]]:
    C = 2 * N
    x, delta = _per_head_inputs(gen, 5, C, 2)
    k, v, w_lora, a_lora, v_lora, v_first = _per_head_inputs(gen, 5, C, 6)
    w0, a0, v0, k_k, k_a, weight, bias = (_randn(gen, C) for _ in range(7))
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    slots = torch.tensor([1, 3, 0], dtype=torch.int32)
    logits = _randn(gen, 3, 97, scale=3.0)
    batch = sampler.SamplingBatch(
        temperature=torch.tensor([0.0, 1.0, 0.7]),
        top_p=torch.tensor([1.0, 0.9, 0.5]),
        top_k=torch.tensor([0, 20, 0]),
        presence=torch.tensor([0.1, 0.2, 0.3]),
        frequency=torch.tensor([0.3, 0.2, 0.1]),
        decay=torch.tensor([0.99, 0.9, 1.0]),
        seed32=torch.tensor([5, 6, 7]),
        step=torch.tensor([0, 3, 9]),
    )
    penalties, seen = torch.rand(4, 97, generator=gen), torch.rand(4, 97, generator=gen) > 0.7
    return {
        "wkv7": [_wkv7_case(gen)],
        "add_layer_norm": [((x, delta, weight, bias), (0,)), ((x, None, weight, bias), (0,))],
        "shift_mix": [((x, _randn(gen, 4, C), slots, cu, _randn(gen, 6, C)), (1,)), ((x, _randn(gen, 4, C), slots, cu, w0), (1,))],
        "norm_mix_decode": [
            ((x[:3], delta[:3], weight, bias, _randn(gen, 4, C), slots, _randn(gen, 6, C)), (0, 4)),
            ((x[:3], None, weight, bias, _randn(gen, 4, C), slots, w0), (0, 4)),
        ],
        "norm_mix_rows": [
            ((x, delta, weight, bias, _randn(gen, 4, C), slots, cu, _randn(gen, 6, C)), (4,)),
            ((x, delta, weight, bias, _randn(gen, 4, C), slots, cu, w0), (4,)),
        ],
        "wkv_prep": [
            ((k, v, w_lora, a_lora, None, None, w0, a0, None, k_k, k_a), (0, 1)),
            ((k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a), (0, 1)),
        ],
        "gn_bonus_gate": [((x, k, v, w_lora, a_lora, k_k, weight, bias), ())],
        "wkv_decode_step": [
            ((_randn(gen, 4, 2, N, N, scale=0.1), slots, x[:3], k[:3], v[:3], delta[:3], w_lora[:3], a_lora[:3], None, None,
              w0, a0, None, k_k, k_a, weight, bias, w0), (0, 3, 4)),
            ((_randn(gen, 4, 2, N, N, scale=0.1), slots, x[:3], k[:3], v[:3], delta[:3], w_lora[:3], a_lora[:3], v_lora[:3],
              v_first[:3], w0, a0, v0, k_k, k_a, weight, bias, w0), (0, 3, 4)),
        ],
        "relu_square": [((x,), ())],
        "int8_gemv": [
            ((x[:3], torch.randint(-127, 128, (C, 48), generator=gen, dtype=torch.int8), torch.rand(48, generator=gen),
              torch.zeros(4, dtype=torch.int32)), (3,)),
            ((_randn(gen, 3, 2, C), torch.randint(-127, 128, (3, C, 32), generator=gen, dtype=torch.int8),
              torch.rand(3, 32, generator=gen), torch.zeros(4, dtype=torch.int32)), (3,)),
        ],  # fmt: skip
        "gemv": [((x[:3], _randn(gen, C, 40), torch.zeros(4, dtype=torch.int32)), (2,)),
                 ((_randn(gen, 3, 2, C), _randn(gen, 3, C, 24), torch.zeros(4, dtype=torch.int32)), (2,))],  # fmt: skip
        "sample": [
            ((logits, torch.tensor([2, 0, 3]), batch.temperature, batch.top_p, batch.top_k, batch.presence, batch.frequency,
              batch.decay, batch.seed32, batch.step, penalties, seen, True), (10, 11)),
        ],  # fmt: skip
    }


def _cloned(args: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def test_every_op_called_through_its_declaration_computes_its_twin() -> None:
    """The schema and the twin agree: arguments, optional tensors, defaults and in-place updates
    reach the twin as a direct call passes them."""
    cases = _cases(_gen(0))
    assert set(cases) == set(ops.declared_ops()), "every declared op needs a case here"
    for name, calls in cases.items():
        op = getattr(torch.ops.albatross, name)
        twin = getattr(ops, f"{name}_torch")
        for args, updated in calls:
            through, direct = _cloned(args), _cloned(args)
            got, want = op(*through), twin(*direct)
            for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert torch.equal(a, b), f"{name}: the op's result differs from its twin's"
            for index in updated:
                assert torch.equal(through[index], direct[index]), f"{name}: argument {index} updated differently"


def test_the_sampler_face_takes_the_samplers_dataclasses() -> None:
    gen = _gen(1)
    logits = _randn(gen, 4, 50, scale=2.0)
    settings = sampler.SamplingBatch(
        temperature=torch.tensor([0.0, 1.0, 0.8, 1.2]), top_p=torch.tensor([1.0, 0.8, 1.0, 0.95]),
        top_k=torch.tensor([0, 0, 5, 40]), presence=torch.full((4,), 0.2), frequency=torch.full((4,), 0.1),
        decay=torch.full((4,), 0.95), seed32=torch.tensor([1, 2, 3, 4]), step=torch.tensor([0, 1, 2, 3]),
    )  # fmt: skip
    slots = torch.tensor([3, 1, 0, 2])
    through, direct = sampler.PenaltyPool(4, 50), sampler.PenaltyPool(4, 50)
    ids = ops.sample(logits, slots, settings, through)
    assert torch.equal(ids, sampler.sample(logits, slots, settings, direct))
    assert torch.equal(through.penalties, direct.penalties) and torch.equal(through.seen, direct.seen)


def test_kernel_sources_register_only_kernels_of_declared_ops() -> None:
    """The C++ side declares no schema (no m.def, no TORCH_LIBRARY) and every kernel it registers
    is for an op declared in albatross/ops.py."""
    declared = set(ops.declared_ops())
    for source in sorted(kernel_build.CUDA_SOURCE_DIR.glob("*.cu")):
        text = source.read_text()
        assert "m.def(" not in text and not re.search(r"\bTORCH_LIBRARY(_FRAGMENT)?\s*\(", text), f"{source.name} declares a schema"
        impls = re.findall(r'm\.impl\("(\w+)"', text)
        assert impls, f"{source.name} registers no kernel"
        assert set(impls) <= declared, f"{source.name} registers kernels for undeclared ops {sorted(set(impls) - declared)}"
        assert "STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m)" in text, f"{source.name}: CUDA kernels of the albatross ops only"


# ---------------------------------------------------------------------------------------------
# a kernel library loaded before or after the declarations

_PROBE_SOURCE = r"""
#include <optional>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

// relu(x)^2 + 1: one more than the twin, so a caller can tell which kernel ran.
Tensor relu_square_plus_one(const Tensor& x) {
  STD_TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got dim ", x.dim());
  Tensor out = torch::stable::empty_like(x);
  const float* in = x.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = in[i] > 0.f ? in[i] : 0.f;
    o[i] = v * v + 1.f;
  }
  return out;
}

// add_layer_norm's arguments in, evidence of them out: x += delta in place when delta is given,
// and a result filled with eps (the schema's default when the caller passes none).
Tensor add_then_eps(Tensor x, const std::optional<Tensor>& delta, const Tensor& weight, const Tensor& bias, double eps) {
  float* xs = x.mutable_data_ptr<float>();
  if (delta.has_value()) {
    const float* d = delta->const_data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) xs[i] += d[i];
  }
  Tensor out = torch::stable::empty_like(x);
  float* o = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = static_cast<float>(eps);
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(albatross, CPU, m) {
  m.impl("relu_square", TORCH_BOX(&relu_square_plus_one));
  m.impl("add_layer_norm", TORCH_BOX(&add_then_eps));
}
"""

_PROBE_CHILD = r"""
import sys, torch
library, order = sys.argv[1], sys.argv[2]
if order == "declared-first":
    from albatross import ops
torch.ops.load_library(library)
if order == "library-first":
    from albatross import ops
x = torch.randn(4, 128)
assert torch.equal(ops.relu_square(x), torch.relu(x).square() + 1), "relu_square did not reach the library's kernel"
delta = torch.randn(4, 128)
updated = x.clone()
out = ops.add_layer_norm(updated, delta, torch.ones(128), torch.zeros(128))
assert torch.equal(updated, x + delta), "x was not updated in place through the optional delta"
assert bool((out == torch.tensor(ops.LAYER_NORM_EPS, dtype=torch.float32)).all()), "the schema's default eps did not arrive"
y, r, k, v, g = (torch.randn(3, 128) for _ in range(5))
vectors = [torch.randn(128) for _ in range(3)]
assert torch.equal(ops.gn_bonus_gate(y, r, k, v, g, *vectors), ops.gn_bonus_gate_torch(y, r, k, v, g, *vectors))
print(sorted(n for n in ops.declared_ops() if torch._C._dispatch_has_kernel_for_dispatch_key("albatross::" + n, "CPU")))
"""


@pytest.fixture(scope="module")
def probe_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    tree = kernel_build.TorchTree.running()
    directory = tmp_path_factory.mktemp("probe")
    source, library = directory / "probe.cpp", directory / "probe.so"
    source.write_text(_PROBE_SOURCE)
    command = [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", kernel_build.stable_abi_define(), f"-I{tree.include_dir}",
               str(source), "-o", str(library), f"-L{tree.lib_dir}", "-ltorch_cpu"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return library


@pytest.mark.parametrize("order", ["declared-first", "library-first"])
def test_a_library_registers_its_kernel_whether_loaded_before_or_after_the_declarations(probe_library: Path, order: str) -> None:
    """In a child process (the probe's CPU kernels must not replace the twins here)."""
    child = subprocess.run([sys.executable, "-c", _PROBE_CHILD, str(probe_library), order], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == str(["add_layer_norm", "relu_square"]), child.stdout
