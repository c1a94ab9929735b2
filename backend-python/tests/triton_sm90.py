"""Compile a Triton kernel for sm90 (H100/H200) without a GPU, as the runtime would for arguments
whose integers are all multiples of 16 (but those named unspecialized), and report what the
compiler made of it: whether `tl.dot` became wgmma, with its left operand in registers and
asynchronous products in flight, whether the loads were pipelined, which loads, stores and copies
the PTX has, the shared memory and, from the wheel's own ptxas, registers and spills."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90_SHARED_BYTES = 232448  # the most shared memory one block may take on sm90 (227 KB)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@dataclass(frozen=True, slots=True)
class Sm90Build:
    wgmma: int  # wgmma.mma_async instructions in the PTX
    left_in_registers: bool  # a warp_group_dot whose left operand is a register tensor, not shared memory
    most_in_flight: int  # the largest `pendings` of a warp_group_dot_wait: products left running
    async_copies: int  # cp.async instructions (pipelined loads)
    shared_bytes: int
    registers: int
    spill_bytes: int
    memory_ops: Counter[str]  # the PTX's loads, stores, copies and tensor-core instructions, with their widths, by count
    warps: int = 0  # as launched: a warp-specialized build has more than it was asked for


# A PTX instruction that moves data or feeds the tensor cores: its opcode with every qualifier
# (`ld.global.v4.b32`, `cp.async.cg.shared.global`, `wgmma.mma_async.sync.aligned...`).
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|cp|ldmatrix|stmatrix|wgmma)\.[\w.:]+)", re.MULTILINE)


def compile_sm90(
    fn: object,
    signature: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int,
    num_stages: int,
    unspecialized: Collection[str] = (),
) -> Sm90Build:
    """`unspecialized`: arguments built without the divisibility by 16 (a kernel's
    `do_not_specialize`, or a runtime value that is not a multiple of 16)."""
    names = list(signature)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]] for n, kind in signature.items() if kind != "constexpr" and n not in unspecialized
    }
    source = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "k.ptx").write_text(ptx)
        done = subprocess.run(
            [str(PTXAS), "-v", "--gpu-name=sm_90a", f"{folder}/k.ptx", "-o", f"{folder}/k.o"], capture_output=True, text=True, check=True
        )
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores", done.stderr)
    return Sm90Build(
        wgmma=ptx.count("wgmma.mma_async"),
        left_in_registers=bool(re.search(r"ttng\.warp_group_dot %\S+, %\S+, %\S+ [^\n]*: tensor<", ttgir)),
        most_in_flight=max((int(p) for p in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)), default=0),
        async_copies=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        shared_bytes=int(kernel.metadata.shared),
        registers=int(registers.group(1)) if registers else -1,
        spill_bytes=int(spills.group(1)) if spills else -1,
        memory_ops=Counter(_MEMORY_OP.findall(ptx)),
        warps=int(kernel.metadata.num_warps),
    )
