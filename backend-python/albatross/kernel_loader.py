"""Find, check and load the CUDA kernel libraries, in a fixed order.

For each kernel library (a name in `KERNEL_SOURCES`) the loader tries, and logs once:

1. a prebuilt binary listed in `manifest.json` whose (name, torch, cuda, python_abi, platform)
   equal the running environment's and whose `arch` list covers the GPU (`sm90` matches exactly
   that chip; `compute90` is PTX and matches any chip >= 9.0; an exact `sm` match beats PTX). Its
   sha256 must equal the manifest's and its recorded source digest must equal the sources in this
   checkout; otherwise it is refused with a warning;
2. a JIT build with `torch.utils.cpp_extension` into a cache directory (a progress message while
   it compiles; an error that names what is missing: nvcc, ninja, a CUDA build of torch);
3. without CUDA, nothing: the caller stays on the pure-torch ops.

The libraries register their ops with TORCH_LIBRARY (namespace `albatross`), so loading one is
`torch.ops.load_library(path)`: no Python extension module, no Python-ABI coupling inside the
binary. Importing this module compiles and loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("albatross.kernels")

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
CUDA_SOURCE_DIR = PACKAGE_DIR / "cuda"
DEFAULT_MANIFEST = REPO_ROOT / "manifest.json"
KERNELS_DIR = PACKAGE_DIR / "kernels"

# Kernel library name -> its translation units (in cuda/). Headers in cuda/ count towards every
# library's source digest, so a header edit marks all prebuilt binaries stale.
KERNEL_SOURCES: dict[str, tuple[str, ...]] = {
    "wkv7": ("wkv7.cu",),
    "sampler": ("sampler.cu",),
    "fused": ("fused.cu",),
}

# The C++ standard is left to torch.utils.cpp_extension (it matches the torch headers).
NVCC_FLAGS: tuple[str, ...] = ("-O3", "--expt-relaxed-constexpr", "-lineinfo")
CXX_FLAGS: tuple[str, ...] = ("-O3",)

_ARCH_PATTERN = re.compile(r"^(sm|compute)(\d+)$")


class KernelBuildError(RuntimeError):
    """A JIT build cannot start or failed; the message says what is missing or what went wrong."""


@dataclass(frozen=True, slots=True)
class KernelContext:
    """The environment a binary must have been built for (everything but the chip must be equal)."""

    torch: str  # public torch version, e.g. "2.11.0" (no local "+cu130" suffix)
    cuda: str | None  # torch.version.cuda, e.g. "13.0"; None for a CPU build of torch
    python_abi: str  # e.g. "cp312"
    platform: str  # e.g. "linux_x86_64"
    arch: str | None  # the GPU, e.g. "sm90"; None without a usable GPU

    @property
    def torch_tag(self) -> str:
        """The directory name binaries for this torch build live under: "2.11.0-cu130"."""
        cuda = f"cu{self.cuda.replace('.', '')}" if self.cuda else "cpu"
        return f"{self.torch}-{cuda}"


@dataclass(frozen=True, slots=True)
class KernelEntry:
    """One prebuilt binary in manifest.json."""

    name: str
    torch: str
    cuda: str
    python_abi: str
    platform: str
    arch: tuple[str, ...]
    path: str  # relative to the manifest's directory
    sha256: str
    source: str  # sha256 over the kernel's sources (source_digest) when it was built

    def __post_init__(self) -> None:
        if not self.arch:
            raise ValueError(f"manifest entry {self.name!r} lists no arch")
        for arch in self.arch:
            if not _ARCH_PATTERN.match(arch):
                raise ValueError(f"manifest entry {self.name!r}: arch {arch!r} is not smNN or computeNN")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"manifest entry {self.name!r}: sha256 must be 64 lowercase hex digits")

    @classmethod
    def from_json(cls, item: dict[str, object]) -> KernelEntry:
        arch = item["arch"]
        if isinstance(arch, str):
            arch = [arch]
        return cls(
            name=str(item["name"]),
            torch=str(item["torch"]),
            cuda=str(item["cuda"]),
            python_abi=str(item["python_abi"]),
            platform=str(item["platform"]),
            arch=tuple(str(a) for a in arch),  # type: ignore[union-attr]
            path=str(item["path"]),
            sha256=str(item["sha256"]),
            source=str(item.get("source", "")),
        )

    def to_json(self) -> dict[str, object]:
        item = asdict(self)
        item["arch"] = list(self.arch)
        return item

    def sort_key(self) -> tuple[str, ...]:
        return (self.name, self.torch, self.cuda, self.python_abi, self.platform, ",".join(self.arch), self.path)


@dataclass(slots=True)
class LoadResult:
    """How one kernel library was (or was not) loaded; `how` is "prebuilt", "jit" or "torch"."""

    name: str
    how: str
    path: Path | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        where = f" {self.path}" if self.path else ""
        extra = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{self.name}: {self.how}{where}{extra}"


# ---------------------------------------------------------------------------------------------
# The running environment


def current_cuda_arch() -> str | None:
    """The first visible GPU as "sm90", "sm86", ...; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def python_abi_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def public_torch_version() -> str:
    return torch.__version__.split("+", 1)[0]


def current_context() -> KernelContext:
    return KernelContext(
        torch=public_torch_version(),
        cuda=torch.version.cuda,
        python_abi=python_abi_tag(),
        platform=platform_tag(),
        arch=current_cuda_arch(),
    )


def source_digest(name: str, source_dir: Path = CUDA_SOURCE_DIR) -> str:
    """sha256 over a library's translation units and every shared header, in a fixed order."""
    units = kernel_sources(name, source_dir)
    headers = sorted(source_dir.glob("*.cuh")) + sorted(source_dir.glob("*.h"))
    digest = hashlib.sha256()
    for path in [*units, *headers]:
        digest.update(path.name.encode())
        digest.update(b"\0")
        # Normalise line endings so a Windows checkout does not mark every binary stale.
        digest.update(path.read_bytes().replace(b"\r\n", b"\n"))
        digest.update(b"\0")
    return digest.hexdigest()


def kernel_sources(name: str, source_dir: Path = CUDA_SOURCE_DIR) -> list[Path]:
    if name not in KERNEL_SOURCES:
        raise KeyError(f"unknown kernel library {name!r}; known: {', '.join(sorted(KERNEL_SOURCES))}")
    return [source_dir / unit for unit in KERNEL_SOURCES[name]]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Manifest


def read_manifest(path: Path = DEFAULT_MANIFEST) -> list[KernelEntry]:
    """The manifest's entries; a missing file is an empty manifest."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    items = data.get("kernels", []) if isinstance(data, dict) else data
    return [KernelEntry.from_json(item) for item in items]


def write_manifest(entries: Sequence[KernelEntry], path: Path = DEFAULT_MANIFEST) -> None:
    """Write entries sorted and de-duplicated (a later entry for the same binary path wins)."""
    by_path: dict[str, KernelEntry] = {}
    for entry in entries:
        by_path[entry.path] = entry
    ordered = sorted(by_path.values(), key=KernelEntry.sort_key)
    payload = {"format": 1, "kernels": [entry.to_json() for entry in ordered]}
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def _arch_number(arch: str) -> tuple[str, int] | None:
    match = _ARCH_PATTERN.match(arch)
    return (match.group(1), int(match.group(2))) if match else None


def arch_match_rank(entry_arch: str, device_arch: str) -> int | None:
    """How well one of an entry's archs fits the device: 2 exact machine code, 1 PTX the driver can
    compile (computeNN with NN <= the device's), None no fit."""
    entry = _arch_number(entry_arch)
    device = _arch_number(device_arch)
    if entry is None or device is None or device[0] != "sm":
        return None
    kind, number = entry
    if kind == "sm":
        return 2 if number == device[1] else None
    return 1 if number <= device[1] else None


def select_entry(entries: Sequence[KernelEntry], name: str, context: KernelContext) -> KernelEntry | None:
    """The best manifest entry for `name` in `context`: exact environment, then the best arch fit
    (exact sm over PTX; among PTX the newest compute capability not above the device's)."""
    if context.arch is None or context.cuda is None:
        return None
    best: tuple[int, int, KernelEntry] | None = None
    for entry in entries:
        if (entry.name, entry.torch, entry.cuda, entry.python_abi, entry.platform) != (
            name,
            context.torch,
            context.cuda,
            context.python_abi,
            context.platform,
        ):
            continue
        for arch in entry.arch:
            rank = arch_match_rank(arch, context.arch)
            if rank is None:
                continue
            number = _arch_number(arch)
            assert number is not None
            candidate = (rank, number[1], entry)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    return best[2] if best else None


# ---------------------------------------------------------------------------------------------
# Loading


_loaded: dict[str, LoadResult] = {}


def loaded_kernels() -> dict[str, LoadResult]:
    """The libraries loaded (or found unavailable) so far in this process, by name."""
    return dict(_loaded)


def load_precompiled_kernel_if_available(
    name: str,
    manifest_path: Path = DEFAULT_MANIFEST,
    context: KernelContext | None = None,
    notes: list[str] | None = None,
) -> Path | None:
    """Load the manifest's binary for `name` if one matches this environment and passes its checks;
    return its path, or None (with the reason appended to `notes` and logged as a warning)."""
    context = context or current_context()
    notes = notes if notes is not None else []
    entry = select_entry(read_manifest(manifest_path), name, context)
    if entry is None:
        notes.append(
            f"no prebuilt binary for torch {context.torch}, cuda {context.cuda}, {context.python_abi}, "
            f"{context.platform}, {context.arch}"
        )
        return None
    path = (manifest_path.parent / entry.path).resolve()
    if not path.exists():
        _refuse(notes, f"manifest lists {entry.path} but the file is missing")
        return None
    actual = file_sha256(path)
    if actual != entry.sha256:
        _refuse(notes, f"{entry.path} has sha256 {actual[:12]}..., manifest says {entry.sha256[:12]}...; refusing it")
        return None
    current_source = source_digest(name)
    if entry.source and entry.source != current_source:
        _refuse(notes, f"{entry.path} was built from other sources than this checkout's; refusing it")
        return None
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        _refuse(notes, f"{entry.path} did not load: {error}")
        return None
    return path


def _refuse(notes: list[str], message: str) -> None:
    log.warning("albatross kernels: %s", message)
    notes.append(message)


def missing_build_tools(cuda_home: str | None, ninja_available: bool, torch_cuda: str | None) -> list[str]:
    """What a JIT build lacks, in words a user can act on (empty: nothing missing)."""
    missing: list[str] = []
    if torch_cuda is None:
        missing.append(
            f"a CUDA build of torch (this is {torch.__version__}, a CPU-only build; install a CUDA build such as +cu130)"
        )
    if cuda_home is None or not (Path(cuda_home) / "bin" / "nvcc").exists():
        missing.append("nvcc (the CUDA toolkit; set CUDA_HOME or put nvcc on PATH)")
    if not ninja_available:
        missing.append("ninja (pip install ninja)")
    return missing


def cache_dir(name: str, context: KernelContext) -> Path:
    root = Path(os.environ.get("ALBATROSS_KERNEL_CACHE", Path.home() / ".cache" / "albatross" / "kernels"))
    tag = f"{context.torch_tag}-{context.python_abi}-{context.platform}-{context.arch}"
    return root / tag / f"{name}-{source_digest(name)[:16]}"


def arch_gencode_flags(archs: Sequence[str]) -> list[str]:
    """nvcc -gencode flags: smNN emits machine code, computeNN emits PTX."""
    flags: list[str] = []
    for arch in archs:
        parsed = _arch_number(arch)
        if parsed is None:
            raise ValueError(f"arch {arch!r} is not smNN or computeNN")
        kind, number = parsed
        code = f"sm_{number}" if kind == "sm" else f"compute_{number}"
        flags.append(f"-gencode=arch=compute_{number},code={code}")
    return flags


def jit_build(name: str, context: KernelContext | None = None) -> Path:
    """Compile `name` for the current GPU into the cache directory (reused when present) and load it."""
    from torch.utils import cpp_extension  # imported here: it is slow and only needed to build

    context = context or current_context()
    missing = missing_build_tools(cpp_extension.CUDA_HOME, cpp_extension.is_ninja_available(), torch.version.cuda)
    if missing:
        raise KernelBuildError(f"cannot JIT-build the CUDA kernel {name!r}: missing " + "; ".join(missing))
    if context.arch is None:
        raise KernelBuildError(f"cannot JIT-build the CUDA kernel {name!r}: no CUDA GPU is visible")
    build_dir = cache_dir(name, context)
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"albatross_{name}.so"
    if not library.exists():
        log.warning(
            "albatross kernels: compiling %s for %s into %s (first use only; this takes a minute)",
            name,
            context.arch,
            build_dir,
        )
    try:
        path = cpp_extension.load(
            name=f"albatross_{name}",
            sources=[str(p) for p in kernel_sources(name)],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=[*NVCC_FLAGS, *arch_gencode_flags([context.arch])],
            extra_include_paths=[str(CUDA_SOURCE_DIR)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, subprocess.CalledProcessError) as error:
        raise KernelBuildError(f"JIT build of the CUDA kernel {name!r} failed: {error}") from error
    return Path(path) if path else library


def build_in_child_process(name: str, context: KernelContext, cache_root: Path) -> str:
    """JIT-build `name` for `context.arch` in a child process with its cache under `cache_root`
    and return the library's path: the child loads it, so this process can build the same library
    for several archs without registering its ops twice."""
    assert context.arch is not None
    script = (
        "import sys; from pathlib import Path; from albatross import kernel_loader as k; "
        "ctx = k.current_context().__class__(*sys.argv[2:7]); "
        "print(k.jit_build(sys.argv[1], ctx))"
    )
    args = [sys.executable, "-c", script, name, context.torch, str(context.cuda), context.python_abi, context.platform, context.arch]
    env = dict(os.environ, ALBATROSS_KERNEL_CACHE=str(cache_root))
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KernelBuildError(f"building {name} for {context.arch} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def load_kernel(name: str, manifest_path: Path = DEFAULT_MANIFEST, allow_jit: bool = True) -> LoadResult:
    """Load one kernel library by the documented order; never raises for a missing GPU (the result
    says "torch"). A JIT build that cannot start raises KernelBuildError when a GPU is present."""
    if name in _loaded:
        return _loaded[name]
    if name not in KERNEL_SOURCES:
        raise KeyError(f"unknown kernel library {name!r}; known: {', '.join(sorted(KERNEL_SOURCES))}")
    context = current_context()
    notes: list[str] = []
    if context.arch is None or context.cuda is None:
        result = LoadResult(name, "torch", notes=["no CUDA GPU; using the pure-torch ops"])
    else:
        path = load_precompiled_kernel_if_available(name, manifest_path, context, notes)
        if path is not None:
            result = LoadResult(name, "prebuilt", path, notes=[f"manifest match for {context.arch}, sha256 verified"])
        elif allow_jit:
            result = LoadResult(name, "jit", jit_build(name, context), notes=notes)
        else:
            result = LoadResult(name, "torch", notes=[*notes, "JIT disabled"])
    _loaded[name] = result
    log.info("albatross kernels: %s", result.describe())
    return result


def load_kernels(names: Sequence[str] = tuple(KERNEL_SOURCES), manifest_path: Path = DEFAULT_MANIFEST, allow_jit: bool = True) -> dict[str, LoadResult]:
    return {name: load_kernel(name, manifest_path, allow_jit) for name in names}
