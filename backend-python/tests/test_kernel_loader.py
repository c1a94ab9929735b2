"""The kernel loader's rules: which binary each GPU takes, refusal of corrupted or stale binaries,
the one log line per library, and the committed binaries' independence from CPython."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from albatross import kernel_build, kernel_loader
from albatross.kernel_loader import KernelContext, KernelEntry, select_entry

H200 = KernelContext(torch="2.11.0", cuda="13.0", platform="linux_x86_64", arch="sm90")
# What build_kernels.py builds by default: one fat binary per library.
FAT_ARCHS = ("sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "compute100")


def entry(arch: tuple[str, ...], path: str = "k.so", **overrides: str) -> KernelEntry:
    fields = {
        "name": "wkv7",
        "torch": "2.11",
        "cuda": "13",
        "platform": "linux_x86_64",
        "path": path,
        "sha256": "0" * 64,
        "source": "",
    }
    fields.update(overrides)
    return KernelEntry(arch=arch, **fields)  # type: ignore[arg-type]


def context(**overrides: str | None) -> KernelContext:
    fields = {"torch": H200.torch, "cuda": H200.cuda, "platform": H200.platform, "arch": H200.arch}
    fields.update(overrides)
    return KernelContext(**fields)  # type: ignore[arg-type]


def chosen_arch(entries: list[KernelEntry], arch: str) -> str | None:
    choice = select_entry(entries, "wkv7", context(arch=arch))
    return choice.arch if choice else None


# ---------------------------------------------------------------------------------------------
# which code each GPU runs

# Every GPU generation CUDA 13 supports, and what it takes from the fat binary.
REAL_GPUS = {
    "sm75": "sm75",  # T4, RTX 20
    "sm80": "sm80",  # A100
    "sm86": "sm86",  # RTX 30, A10
    "sm87": "sm86",  # Jetson Orin: sm86 cubins run on 8.7
    "sm89": "sm89",  # RTX 40, L4
    "sm90": "sm90",  # H100, H200
    "sm100": "sm100",  # B200
    "sm103": "sm100",  # B300
    "sm110": "compute100",  # Thor: no 11.x cubin, the driver compiles the 10.0 PTX
    "sm120": "sm120",  # RTX 50
    "sm121": "sm120",  # DGX Spark
}


@pytest.mark.parametrize("device, expected", sorted(REAL_GPUS.items()))
def test_each_gpu_generation_takes_its_code_from_the_fat_binary(device: str, expected: str) -> None:
    assert chosen_arch([entry(FAT_ARCHS)], device) == expected


EVERY_CAPABILITY = [f"sm{major}{minor}" for major in range(7, 13) for minor in range(10) if (7, 5) <= (major, minor) <= (12, 1)]


@pytest.mark.parametrize("device", EVERY_CAPABILITY)
def test_every_capability_from_7_5_to_12_1_takes_the_best_code_it_can_run(device: str) -> None:
    """CUDA's rules: a cubin for X.y runs on X.z with z >= y; PTX for N runs on any capability >= N.
    The best is the cubin of the same major with the highest minor not above the device's, else
    the newest PTX not above the device's."""
    major, minor = divmod(int(device[2:]), 10)
    cubins = [a for a in FAT_ARCHS if a.startswith("sm") and int(a[2:]) // 10 == major and int(a[2:]) % 10 <= minor]
    ptx = [a for a in FAT_ARCHS if a.startswith("compute") and int(a[7:]) <= major * 10 + minor]
    expected = max(cubins, key=lambda a: int(a[2:])) if cubins else max(ptx, key=lambda a: int(a[7:]))
    assert chosen_arch([entry(FAT_ARCHS)], device) == expected


def test_gpus_older_than_every_binary_take_nothing() -> None:
    assert chosen_arch([entry(FAT_ARCHS)], "sm70") is None, "CUDA 13 code cannot run on a 7.0 GPU"
    assert chosen_arch([entry(("sm86", "sm90"))], "sm80") is None, "sm86 code must not run on sm80"
    assert chosen_arch([entry(("compute90",))], "sm89") is None, "PTX for 9.0 cannot run on an 8.9 GPU"


def test_one_file_per_arch_picks_the_right_file() -> None:
    files = [entry((arch,), f"{arch}/wkv7.so") for arch in FAT_ARCHS]
    for device, expected in REAL_GPUS.items():
        choice = select_entry(files, "wkv7", context(arch=device))
        assert choice is not None and choice.entry.path == f"{expected}/wkv7.so", (device, choice)


@pytest.mark.parametrize(
    "field, value, fits",
    [
        ("torch", "2.11.0", True),
        ("torch", "2.13.0", True),  # the stable ABI: a binary for 2.11 serves later 2.x releases
        ("torch", "2.10.0", False),
        ("torch", "3.0.0", False),
        ("cuda", "13.2", True),
        ("cuda", "12.8", False),  # another CUDA runtime than the binary needs
        ("cuda", None, False),
        ("platform", "linux_aarch64", False),
    ],
)
def test_environment_rules(field: str, value: str | None, fits: bool) -> None:
    chosen = select_entry([entry(("sm90",))], "wkv7", context(**{field: value}))
    assert (chosen is not None) == fits, f"{field}={value}: expected {'a match' if fits else 'no match'}, got {chosen}"


def test_another_library_name_never_matches() -> None:
    assert select_entry([entry(("sm90",), name="sampler")], "wkv7", H200) is None


def test_no_gpu_selects_nothing() -> None:
    assert select_entry([entry(FAT_ARCHS)], "wkv7", context(arch=None)) is None


def test_malformed_manifest_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="smNN or computeNN"):
        entry(("ampere",))
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        entry(("sm90",), torch="2.11.0+cu130")
    with pytest.raises(ValueError, match="major version"):
        entry(("sm90",), cuda="13.0")


def test_manifest_write_is_sorted_and_deduplicated(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    first = entry(("sm90",), "b/wkv7.so", sha256="1" * 64)
    replacement = entry(("sm90",), "b/wkv7.so", sha256="2" * 64)
    other = entry(("sm80",), "a/wkv7.so")
    kernel_loader.write_manifest([first, other, replacement], manifest)
    written = json.loads(manifest.read_text())["kernels"]
    assert [item["path"] for item in written] == ["a/wkv7.so", "b/wkv7.so"], "one entry per path, sorted"
    assert written[1]["sha256"] == "2" * 64, "the later entry for a path replaces the earlier one"
    assert kernel_loader.read_manifest(manifest) == [other, replacement], "read_manifest round-trips"


def test_a_manifest_of_another_format_is_refused(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"format": 1, "kernels": []}))
    with pytest.raises(ValueError, match="format 1"):
        kernel_loader.read_manifest(manifest)


# ---------------------------------------------------------------------------------------------
# checks and the one log line


def _manifest_with_binary(tmp_path: Path, payload: bytes, digest: str | None = None, source: str = "") -> Path:
    binary = tmp_path / "kernels" / "wkv7.so"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(payload)
    sha = digest or hashlib.sha256(payload).hexdigest()
    manifest = tmp_path / "manifest.json"
    kernel_loader.write_manifest([entry(FAT_ARCHS, "kernels/wkv7.so", sha256=sha, source=source)], manifest)
    return manifest


def test_matching_binary_is_loaded_without_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _manifest_with_binary(tmp_path, b"binary", source=kernel_build.source_digest("wkv7"))
    loaded: list[str] = []
    monkeypatch.setattr(kernel_loader.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(kernel_loader, "jit_build", lambda *a, **k: pytest.fail("must not compile"))
    notes: list[str] = []
    path = kernel_loader.load_precompiled_kernel_if_available("wkv7", manifest, context(arch="sm87"), notes)
    assert path == (tmp_path / "kernels" / "wkv7.so").resolve()
    assert loaded == [str(path)]
    assert notes == ["sm86 code for this sm87 GPU"], notes


def test_corrupted_binary_is_refused_and_the_jit_build_says_why_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _manifest_with_binary(tmp_path, b"original", source=kernel_build.source_digest("wkv7"))
    (tmp_path / "kernels" / "wkv7.so").write_bytes(b"corrupted")
    monkeypatch.setattr(kernel_loader.torch.ops, "load_library", lambda path: pytest.fail(f"{path} must never be loaded"))
    monkeypatch.setattr(kernel_loader, "current_context", lambda: H200)
    monkeypatch.setattr(kernel_loader, "_loaded", {})
    monkeypatch.setenv("ALBATROSS_KERNEL_CACHE", str(tmp_path / "cache"))
    built: list[str] = []

    def fake_jit(name: str, ctx: KernelContext | None = None) -> Path:
        built.append(name)
        return tmp_path / "jit.so"

    monkeypatch.setattr(kernel_loader, "jit_build", fake_jit)
    with caplog.at_level(logging.INFO, logger="albatross.kernels"):
        result = kernel_loader.load_kernel("wkv7", manifest)
    assert (result.how, built) == ("jit", ["wkv7"]), result.describe()
    lines = [record for record in caplog.records if record.name == "albatross.kernels"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert "refused" in message and "sha256" in message and "compiling" in message, message


def test_binary_built_from_other_sources_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _manifest_with_binary(tmp_path, b"binary", source="f" * 64)
    monkeypatch.setattr(kernel_loader.torch.ops, "load_library", lambda path: pytest.fail("stale binary loaded"))
    notes: list[str] = []
    assert kernel_loader.load_precompiled_kernel_if_available("wkv7", manifest, H200, notes) is None
    assert any("other sources" in n for n in notes), notes


def test_missing_binary_file_falls_through(tmp_path: Path) -> None:
    manifest = _manifest_with_binary(tmp_path, b"x")
    (tmp_path / "kernels" / "wkv7.so").unlink()
    notes: list[str] = []
    assert kernel_loader.load_precompiled_kernel_if_available("wkv7", manifest, H200, notes) is None
    assert any("missing" in n for n in notes), notes


def test_a_gpu_no_binary_fits_says_so(tmp_path: Path) -> None:
    manifest = _manifest_with_binary(tmp_path, b"x")
    notes: list[str] = []
    assert kernel_loader.load_precompiled_kernel_if_available("wkv7", manifest, context(arch="sm70"), notes) is None
    assert notes == ["no prebuilt binary fits torch 2.11.0, CUDA 13.0, linux_x86_64, sm70"], notes


def test_without_a_gpu_the_torch_path_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_loader, "current_context", lambda: context(arch=None))
    monkeypatch.setattr(kernel_loader, "_loaded", {})
    monkeypatch.setattr(kernel_loader, "jit_build", lambda *a, **k: pytest.fail("must not compile without a GPU"))
    result = kernel_loader.load_kernel("sampler", tmp_path / "none.json")
    assert result.how == "torch" and result.path is None


# ---------------------------------------------------------------------------------------------
# building


def test_a_build_that_cannot_start_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_build, "find_cuda_home", lambda: None)
    cpu_tree = kernel_build.TorchTree(root=tmp_path, version="2.13.0", cuda=None)
    with pytest.raises(kernel_build.KernelBuildError) as error:
        kernel_build.compile_library("wkv7", ["sm90"], cpu_tree, tmp_path / "wkv7.so")
    message = str(error.value)
    assert "a CUDA build of torch" in message and "nvcc" in message, message
    old_tree = kernel_build.TorchTree(root=tmp_path, version="2.9.1", cuda="12.8")
    assert any("torch >= 2.11" in problem for problem in old_tree.problems()), old_tree.problems()


def test_a_torch_tree_is_read_without_importing_it(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda = '13.0'\n")
    tree = kernel_build.TorchTree.at(tmp_path)
    assert (tree.version, tree.cuda) == ("2.11.0", "13.0")
    with pytest.raises(kernel_build.KernelBuildError, match="not a torch tree"):
        kernel_build.TorchTree.at(tmp_path / "elsewhere")


def test_the_nvcc_command_uses_the_stable_abi_and_no_python(tmp_path: Path) -> None:
    tree = kernel_build.TorchTree(root=tmp_path / "wheel", version="2.11.0", cuda="13.0")
    command = kernel_build.nvcc_command("fused", ["sm75", "compute100"], tree, tmp_path / "fused.so", Path("/cuda/bin/nvcc"))
    assert "-DTORCH_TARGET_VERSION=0x020b000000000000" in command
    includes = [flag for flag in command if flag.startswith("-I")]
    assert includes == [f"-I{tree.include_dir}", f"-I{kernel_build.CUDA_SOURCE_DIR}"], "torch's headers only, no Python.h"
    assert [flag for flag in command if flag.startswith("-L")] == [f"-L{tree.lib_dir}"]
    assert ["-ltorch_cpu", "-ltorch_cuda"] == [flag for flag in command if flag.startswith("-l")], "links no libc10, no libpython"
    assert "-gencode=arch=compute_75,code=sm_75" in command and "-gencode=arch=compute_100,code=compute_100" in command


def test_gencode_flags_refuse_archs_cuda_13_cannot_build() -> None:
    assert kernel_build.arch_gencode_flags(["sm90", "compute90"]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    with pytest.raises(ValueError, match="7.5 and newer"):
        kernel_build.arch_gencode_flags(["sm70"])
    with pytest.raises(ValueError, match="smNN or computeNN"):
        kernel_build.arch_gencode_flags(["sm_90"])


def test_unknown_kernel_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: fused, gemv, int8, sampler, wkv7"):
        kernel_build.kernel_sources("softmax")


def test_source_digest_follows_the_sources(tmp_path: Path) -> None:
    (tmp_path / "wkv7.cu").write_text('#include "common.cuh"\n#include <cstdint>\n')
    (tmp_path / "common.cuh").write_text("one\n")
    before = kernel_build.source_digest("wkv7", tmp_path)
    (tmp_path / "common.cuh").write_text("two\n")
    after = kernel_build.source_digest("wkv7", tmp_path)
    assert after != before, "a header edit must change the digest"
    (tmp_path / "common.cuh").write_bytes(b"two\r\n")
    assert kernel_build.source_digest("wkv7", tmp_path) == after, "CRLF line endings must not change the digest"


def test_source_digest_counts_the_headers_a_library_includes_and_no_other(tmp_path: Path) -> None:
    (tmp_path / "wkv7.cu").write_text('#include "split_k.cuh"\n')
    (tmp_path / "split_k.cuh").write_text('#pragma once\n  #  include "common.cuh"\n')
    (tmp_path / "common.cuh").write_text("one\n")
    (tmp_path / "unrelated.cuh").write_text("one\n")
    assert [path.name for path in kernel_build.local_headers([tmp_path / "wkv7.cu"], tmp_path)] == ["common.cuh", "split_k.cuh"]
    before = kernel_build.source_digest("wkv7", tmp_path)
    (tmp_path / "unrelated.cuh").write_text("two\n")
    assert kernel_build.source_digest("wkv7", tmp_path) == before, "a header the library does not include must not count"
    (tmp_path / "common.cuh").write_text("two\n")
    assert kernel_build.source_digest("wkv7", tmp_path) != before, "a header included through another must count"


def test_the_repository_libraries_include_common_cuh() -> None:
    for name in kernel_build.KERNEL_SOURCES:
        headers = [path.name for path in kernel_build.local_headers(kernel_build.kernel_sources(name))]
        assert "common.cuh" in headers, f"{name}: {headers}"


def test_importing_the_package_loads_and_compiles_nothing(tmp_path: Path) -> None:
    script = (
        "import torch, albatross, albatross.model, albatross.cuda_ops, albatross.kernel_loader as k, albatross.ops as ops; "
        "print(len(k.loaded_kernels()), len(ops.registered_cuda_ops()))"
    )
    env = dict(os.environ, ALBATROSS_KERNEL_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "0"], f"imports loaded kernels: {done.stdout!r} {done.stderr!r}"
    assert not (tmp_path / "cache").exists(), "imports must not create a build cache"


# ---------------------------------------------------------------------------------------------
# the committed binaries


def test_repository_manifest_entries_point_at_files_with_their_sha256() -> None:
    entries = kernel_loader.read_manifest()
    assert entries, "the repository ships prebuilt kernels"
    for item in entries:
        path = kernel_loader.DEFAULT_MANIFEST.parent / item.path
        assert path.exists(), f"manifest lists {item.path}, which is not in the repository"
        assert kernel_loader.file_sha256(path) == item.sha256, f"{item.path} does not match its manifest sha256"


# Libraries whose binaries are not committed yet (build_kernels.py is the only writer of binaries
# and manifest, run once per source change): until then a GPU JIT-builds them and the CPU runs the
# twins. The next rebuild adds them, and the test below then asks for this set to be emptied.
AWAITING_BUILD: frozenset[str] = frozenset()
BUILT = tuple(name for name in kernel_build.KERNEL_SOURCES if name not in AWAITING_BUILD)
# Libraries whose sources changed since their committed binaries were built, on a branch without a
# GPU (binaries come only from the lead's build_kernels.py run): a GPU JIT-builds them meanwhile.
# The rebuild makes them fresh, and test_repository_binaries_were_built_from_this_checkouts_sources
# then asks for this set to be emptied.
AWAITING_REBUILD: frozenset[str] = frozenset()
FRESH = tuple(name for name in BUILT if name not in AWAITING_REBUILD)


def _ops_of(library: str) -> set[str]:
    """The ops a library registers kernels for (its m.impl lines)."""
    return {op for path in kernel_build.kernel_sources(library) for op in re.findall(r'm\.impl\("(\w+)"', path.read_text())}


def test_libraries_awaiting_a_build_have_no_binary_yet() -> None:
    listed = {item.name for item in kernel_loader.read_manifest()}
    assert AWAITING_BUILD <= set(kernel_build.KERNEL_SOURCES), "AWAITING_BUILD names a library that does not exist"
    assert not AWAITING_BUILD & listed, f"{sorted(AWAITING_BUILD & listed)} are built now: remove them from AWAITING_BUILD"


def test_repository_binaries_were_built_from_this_checkouts_sources() -> None:
    """A source edit makes a library's committed binary stale (the loader would refuse it and
    compile): the edit and the rebuild go together, or the library waits in AWAITING_REBUILD."""
    for item in kernel_loader.read_manifest():
        fresh = item.source == kernel_build.source_digest(item.name)
        if item.name in AWAITING_REBUILD:
            assert not fresh, f"{item.path} is fresh now: remove {item.name} from AWAITING_REBUILD"
        else:
            assert fresh, f"{item.path} is stale: rerun build_kernels.py"


def test_repository_binaries_cover_every_library_and_gpu_generation() -> None:
    entries = kernel_loader.read_manifest()
    for name in BUILT:
        for device, expected in REAL_GPUS.items():
            env = context(arch=device, torch=".".join(map(str, kernel_build.STABLE_ABI_TARGET)) + ".0")
            choice = select_entry(entries, name, env)
            assert choice is not None and choice.arch == expected, f"{name} on {device}: {choice}"


def _dynamic_section(path: Path) -> tuple[list[str], list[str]]:
    """The NEEDED libraries and the undefined dynamic symbols of an ELF shared library."""
    from elftools.elf.elffile import ELFFile

    with path.open("rb") as handle:
        elf = ELFFile(handle)
        needed = [tag.needed for tag in elf.get_section_by_name(".dynamic").iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
        undefined = [sym.name for sym in elf.get_section_by_name(".dynsym").iter_symbols() if sym["st_shndx"] == "SHN_UNDEF" and sym.name]
    return needed, undefined


def test_repository_binaries_depend_on_no_python_and_only_on_torchs_c_abi() -> None:
    """One file for every CPython and torch >= the target: no libpython, no Python symbols, no
    libc10 or libtorch_python, and of libtorch only the extern "C" stable ABI (no C++ symbols)."""
    for item in kernel_loader.read_manifest():
        needed, undefined = _dynamic_section(kernel_loader.DEFAULT_MANIFEST.parent / item.path)
        assert not [lib for lib in needed if "python" in lib or lib.startswith("libc10")], f"{item.path} needs {needed}"
        assert {"libtorch_cpu.so", "libtorch_cuda.so"} <= set(needed), needed
        python = [name for name in undefined if name.startswith(("Py", "_Py"))]
        cxx_torch = [name for name in undefined if name.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch", "_ZNK3c10", "_ZNK2at"))]
        assert not python and not cxx_torch, f"{item.path} uses {python[:5]} {cxx_torch[:5]}"


# ---------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_this_gpu_takes_the_committed_binaries_without_compiling(tmp_path: Path) -> None:
    """On the H200: the sm90 cubins of the committed fat binaries, nothing compiled."""
    script = (
        "from albatross import cuda_ops, kernel_loader as k, ops; "
        f"results = k.load_kernels({FRESH!r}, allow_jit=False); "
        "print([(r.how, r.notes) for r in results.values()]); "
        "print(k.current_cuda_arch(), sorted(ops.registered_cuda_ops()))"
    )
    env = dict(os.environ, ALBATROSS_KERNEL_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    device = kernel_loader.current_cuda_arch()
    assert device is not None
    choice = select_entry(kernel_loader.read_manifest(), "wkv7", kernel_loader.current_context())
    assert choice is not None, f"no committed binary for {device}"
    expected_note = f"{choice.arch} code for this {device} GPU"
    lines = done.stdout.splitlines()
    assert lines[0] == str([("prebuilt", [expected_note])] * len(FRESH)), done.stdout + done.stderr
    served = sorted(set().union(*(_ops_of(name) for name in FRESH)))
    assert lines[1] == f"{device} {served}", "every op of a committed library has its CUDA kernel"
    assert not (tmp_path / "cache").exists(), "nothing may be compiled"
    if device == "sm90":
        assert choice.arch == "sm90"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_committed_libraries_loaded_before_the_declarations_serve_the_ops() -> None:
    """The other order: the libraries first (plain torch.ops.load_library), then albatross.ops."""
    script = """
import json, sys, torch
from pathlib import Path
root = Path(sys.argv[1])
for item in json.loads((root / "manifest.json").read_text())["kernels"]:
    torch.ops.load_library(str(root / item["path"]))
from albatross import ops
x = torch.randn(64, 256, device="cuda")
assert torch.equal(ops.relu_square(x), ops.relu_square_torch(x)), "relu_square through the CUDA kernel"
print(sorted(ops.registered_cuda_ops()))
"""
    root = kernel_loader.DEFAULT_MANIFEST.parent
    cwd = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    served = sorted(set().union(*(_ops_of(name) for name in BUILT)))
    assert done.stdout.strip() == str(served), done.stdout
