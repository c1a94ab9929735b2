"""The kernel loader's rules: manifest matching, refusal of tampered binaries, JIT error messages."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from albatross import kernel_loader
from albatross.kernel_loader import KernelContext, KernelEntry, select_entry

H200 = KernelContext(torch="2.11.0", cuda="13.0", python_abi="cp312", platform="linux_x86_64", arch="sm90")


def entry(arch: tuple[str, ...], path: str = "k.so", **overrides: str) -> KernelEntry:
    fields = {
        "name": "wkv7",
        "torch": "2.11.0",
        "cuda": "13.0",
        "python_abi": "cp312",
        "platform": "linux_x86_64",
        "path": path,
        "sha256": "0" * 64,
        "source": "",
    }
    fields.update(overrides)
    return KernelEntry(arch=arch, **fields)  # type: ignore[arg-type]


def context(**overrides: str | None) -> KernelContext:
    fields = {"torch": H200.torch, "cuda": H200.cuda, "python_abi": H200.python_abi, "platform": H200.platform, "arch": H200.arch}
    fields.update(overrides)
    return KernelContext(**fields)  # type: ignore[arg-type]


def test_exact_environment_and_arch_is_selected() -> None:
    wanted = entry(("sm90",), "sm90.so")
    chosen = select_entry([entry(("sm80",), "sm80.so"), wanted], "wkv7", H200)
    assert chosen == wanted, f"expected the sm90 binary, got {chosen}"


@pytest.mark.parametrize(
    "field, value",
    [("torch", "2.11.1"), ("cuda", "12.8"), ("python_abi", "cp311"), ("platform", "linux_aarch64"), ("name", "sampler")],
)
def test_any_environment_difference_rejects_the_entry(field: str, value: str) -> None:
    candidate = entry(("sm90",), **{field: value})
    assert select_entry([candidate], "wkv7", H200) is None, f"an entry with {field}={value} must not match {H200}"


def test_sm_entry_matches_only_its_own_chip() -> None:
    sm86 = entry(("sm86",))
    assert select_entry([sm86], "wkv7", context(arch="sm86")) == sm86
    assert select_entry([sm86], "wkv7", context(arch="sm89")) is None, "sm86 machine code must not run on sm89"
    assert select_entry([sm86], "wkv7", context(arch="sm80")) is None


def test_ptx_entry_matches_any_newer_chip_but_not_an_older_one() -> None:
    ptx = entry(("compute80",))
    assert select_entry([ptx], "wkv7", context(arch="sm80")) == ptx
    assert select_entry([ptx], "wkv7", context(arch="sm90")) == ptx
    assert select_entry([ptx], "wkv7", context(arch="sm75")) is None, "PTX for 8.0 cannot run on a 7.5 chip"


def test_exact_sm_beats_ptx_whatever_the_order() -> None:
    ptx = entry(("compute90",), "ptx.so")
    exact = entry(("sm90",), "exact.so")
    for entries in ([ptx, exact], [exact, ptx]):
        assert select_entry(entries, "wkv7", H200) == exact, f"{[e.path for e in entries]}: exact sm must win"


def test_newest_ptx_not_above_the_chip_is_preferred() -> None:
    old, new, too_new = entry(("compute80",), "80.so"), entry(("compute86",), "86.so"), entry(("compute100",), "100.so")
    assert select_entry([old, too_new, new], "wkv7", context(arch="sm89")) == new


def test_multi_arch_entry_matches_through_any_of_its_archs() -> None:
    fat = entry(("sm80", "sm90", "compute90"))
    assert select_entry([fat], "wkv7", H200) == fat
    assert select_entry([fat], "wkv7", context(arch="sm100")) == fat, "compute90 PTX covers sm100"
    assert select_entry([fat], "wkv7", context(arch="sm86")) is None


def test_no_gpu_or_cpu_torch_selects_nothing() -> None:
    anything = entry(("sm90", "compute50"))
    assert select_entry([anything], "wkv7", context(arch=None)) is None
    assert select_entry([anything], "wkv7", context(cuda=None)) is None


def test_malformed_manifest_arch_is_refused() -> None:
    with pytest.raises(ValueError, match="smNN or computeNN"):
        entry(("ampere",))


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


def _manifest_with_binary(tmp_path: Path, payload: bytes, digest: str | None = None, source: str = "") -> Path:
    binary = tmp_path / "kernels" / "wkv7.so"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(payload)
    sha = digest or hashlib.sha256(payload).hexdigest()
    manifest = tmp_path / "manifest.json"
    kernel_loader.write_manifest([entry(("sm90",), "kernels/wkv7.so", sha256=sha, source=source)], manifest)
    return manifest


def test_tampered_binary_is_refused_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _manifest_with_binary(tmp_path, b"original", digest=hashlib.sha256(b"original").hexdigest())
    (tmp_path / "kernels" / "wkv7.so").write_bytes(b"tampered")
    loaded: list[str] = []
    monkeypatch.setattr(kernel_loader.torch.ops, "load_library", loaded.append)
    notes: list[str] = []
    with caplog.at_level(logging.WARNING, logger="albatross.kernels"):
        result = kernel_loader.load_precompiled_kernel_if_available("wkv7", manifest, H200, notes)
    assert result is None, "a binary whose sha256 differs from the manifest must not be loaded"
    assert loaded == [], "the tampered file must never reach load_library"
    assert any("sha256" in n for n in notes) and "refusing" in caplog.text, f"notes {notes}, log {caplog.text!r}"


def test_matching_binary_is_loaded_without_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _manifest_with_binary(tmp_path, b"binary", source=kernel_loader.source_digest("wkv7"))
    loaded: list[str] = []
    monkeypatch.setattr(kernel_loader.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(kernel_loader, "jit_build", lambda *a, **k: pytest.fail("must not compile"))
    path = kernel_loader.load_precompiled_kernel_if_available("wkv7", manifest, H200)
    assert path == (tmp_path / "kernels" / "wkv7.so").resolve()
    assert loaded == [str(path)]


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


def test_prebuilt_failure_falls_through_to_jit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _manifest_with_binary(tmp_path, b"original", digest="a" * 64)
    monkeypatch.setattr(kernel_loader, "current_context", lambda: H200)
    monkeypatch.setattr(kernel_loader, "_loaded", {})
    built: list[str] = []

    def fake_jit(name: str, ctx: KernelContext | None = None) -> Path:
        built.append(name)
        return tmp_path / "jit.so"

    monkeypatch.setattr(kernel_loader, "jit_build", fake_jit)
    result = kernel_loader.load_kernel("wkv7", manifest)
    assert (result.how, built) == ("jit", ["wkv7"]), result.describe()
    assert any("sha256" in n for n in result.notes), "the refusal reason is kept in the load report"


def test_without_a_gpu_the_torch_path_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_loader, "current_context", lambda: context(arch=None))
    monkeypatch.setattr(kernel_loader, "_loaded", {})
    monkeypatch.setattr(kernel_loader, "jit_build", lambda *a, **k: pytest.fail("must not compile without a GPU"))
    result = kernel_loader.load_kernel("sampler", tmp_path / "none.json")
    assert result.how == "torch" and result.path is None


def test_missing_tools_are_named() -> None:
    assert kernel_loader.missing_build_tools(None, True, "13.0") == ["nvcc (the CUDA toolkit; set CUDA_HOME or put nvcc on PATH)"]
    assert kernel_loader.missing_build_tools("/nonexistent/cuda", True, "13.0")[0].startswith("nvcc")
    assert kernel_loader.missing_build_tools(None, False, None)[0].startswith("a CUDA build of torch")
    assert any(m.startswith("ninja") for m in kernel_loader.missing_build_tools(None, False, "13.0"))


def test_jit_error_says_nvcc_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(kernel_loader.torch.version, "cuda", "13.0")
    with pytest.raises(kernel_loader.KernelBuildError, match="missing nvcc"):
        kernel_loader.jit_build("wkv7", H200)


def test_jit_error_says_torch_is_a_cpu_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils import cpp_extension

    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(kernel_loader.torch.version, "cuda", None)
    with pytest.raises(kernel_loader.KernelBuildError) as error:
        kernel_loader.jit_build("wkv7", H200)
    message = str(error.value)
    assert "a CUDA build of torch" in message and "nvcc" not in message.split("missing", 1)[1], message


def test_unknown_kernel_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: fused, sampler, wkv7"):
        kernel_loader.kernel_sources("softmax")


def test_source_digest_follows_the_sources(tmp_path: Path) -> None:
    for unit in ("wkv7.cu", "common.cuh"):
        (tmp_path / unit).write_text("one\n")
    before = kernel_loader.source_digest("wkv7", tmp_path)
    (tmp_path / "common.cuh").write_text("two\n")
    after = kernel_loader.source_digest("wkv7", tmp_path)
    assert after != before, "a header edit must change the digest"
    (tmp_path / "common.cuh").write_bytes(b"two\r\n")
    assert kernel_loader.source_digest("wkv7", tmp_path) == after, "CRLF line endings must not change the digest"


def test_gencode_flags_for_machine_code_and_ptx() -> None:
    assert kernel_loader.arch_gencode_flags(["sm90", "compute90"]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_importing_the_package_loads_and_compiles_nothing(tmp_path: Path) -> None:
    script = (
        "import albatross, albatross.model, albatross.cuda_ops, albatross.kernel_loader as k; "
        "print(len(k.loaded_kernels()), hasattr(__import__('torch').ops.albatross, 'wkv7'))"
    )
    env = dict(os.environ, ALBATROSS_KERNEL_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False"], f"imports loaded kernels: {done.stdout!r} {done.stderr!r}"
    assert not (tmp_path / "cache").exists(), "imports must not create a build cache"


def test_repository_manifest_entries_point_at_files_with_their_sha256() -> None:
    for item in kernel_loader.read_manifest():
        path = kernel_loader.DEFAULT_MANIFEST.parent / item.path
        assert path.exists(), f"manifest lists {item.path}, which is not in the repository"
        assert kernel_loader.file_sha256(path) == item.sha256, f"{item.path} does not match its manifest sha256"
