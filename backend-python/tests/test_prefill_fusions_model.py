"""The two prefill fusions wired into the model (albatross/relu_square_triton.py through
`linear.mm_relu_square`, albatross/lora_prep_triton.py through `lora_prep`), checked on the CPU:
a small fp32 model's prefill with prefix-cache captures, then a decode step, under Triton's
interpreter with their dispatch forced on, against the same calls without them (a child process,
since TRITON_INTERPRET must be set before the kernels are decorated). In fp32 their roundings are
no-ops, so logits and states agree to the order of fp32 sums; a wrong stack order, v_first or
capture would be off by far more. On a Hopper GPU, the kernels' own tests run the real dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from interpreter_cases import interpreter_cases

SCRIPT = Path(__file__).with_name("prefill_fusions_model_interpreter.py")


@pytest.fixture(scope="module")
def cases() -> list[dict[str, object]]:
    return interpreter_cases(SCRIPT)


def test_each_fusion_and_both_match_the_unfused_model(cases: list[dict[str, object]]) -> None:
    assert [case["name"] for case in cases] == ["relu^2 fused", "LoRA + prep fused", "both"]
    for case in cases:
        assert float(case["logits"]) <= 1e-5 and float(case["states"]) <= 1e-5, case
        assert case["captures"] == 3, case


def test_the_fusions_ran_where_their_dispatch_took_them(cases: list[dict[str, object]]) -> None:
    layers = 3
    relu, prep, both = cases
    # relu^2: every layer of the prefill and of the decode step (forced on for any call of 2+ rows)
    assert (relu["relu_calls"], relu["prep_calls"]) == (2 * layers, 0), relu
    # LoRA + prep: every layer of the prefill, never the decode step (the CUDA step op's)
    assert (prep["relu_calls"], prep["prep_calls"]) == (0, layers), prep
    assert (both["relu_calls"], both["prep_calls"]) == (2 * layers, layers), both
