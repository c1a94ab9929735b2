"""Find, check and load the CUDA kernel libraries, in a fixed order, with one log line each.

For each kernel library (a name in `kernel_build.KERNEL_SOURCES`) the loader tries:

1. a prebuilt binary listed in `manifest.json` that fits the running environment: the same
   platform, torch of the binary's stable-ABI release or later within the same major version, the
   same CUDA major version as torch's, and code the GPU can run. By CUDA's compatibility rules a
   cubin for sm_XY runs on sm_XZ with Z >= Y (same major: an sm87 GPU runs sm86 code, sm103 runs
   sm100, sm121 runs sm120) and PTX for compute_NN runs, compiled by the driver, on any GPU of
   capability NN or above; the loader prefers the cubin of the highest minor, then the newest PTX.
   Its sha256 must equal the manifest's and its recorded source digest must equal the sources in
   this checkout; otherwise it is refused, with the reason in the log line;
2. a JIT build (kernel_build's nvcc command, for this GPU only) into a cache directory, when no
   binary fits; the log line says why and that it compiles. If it cannot start, KernelBuildError
   names what is missing (nvcc, a CUDA build of torch);
3. without a CUDA GPU, nothing: the torch twins of `albatross.ops` run.

A library registers CUDA kernels for the ops declared in `albatross.ops`, so loading one is
`torch.ops.load_library(path)`: no Python extension module, nothing tied to the CPython version.
Importing this module compiles and loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from albatross import kernel_build, ops  # noqa: F401  (ops: the schemas the libraries register kernels for)
from albatross.kernel_build import KERNEL_SOURCES, KernelBuildError, arch_number, source_digest

log = logging.getLogger("albatross.kernels")

PACKAGE_DIR = kernel_build.PACKAGE_DIR
REPO_ROOT = PACKAGE_DIR.parents[1]
DEFAULT_MANIFEST = REPO_ROOT / "manifest.json"
KERNELS_DIR = PACKAGE_DIR / "kernels"
MANIFEST_FORMAT = 2


@dataclass(frozen=True, slots=True)
class KernelContext:
    """The running environment a binary must fit."""

    torch: str  # public torch version, e.g. "2.13.0" (no local "+cu130" suffix)
    cuda: str | None  # torch.version.cuda, e.g. "13.0"; None for a CPU build of torch
    platform: str  # e.g. "linux_x86_64"
    arch: str | None  # the GPU, e.g. "sm90"; None without a usable GPU

    @property
    def torch_tag(self) -> str:
        """The name of this build of torch in cache paths: "2.13.0-cu130"."""
        cuda = f"cu{self.cuda.replace('.', '')}" if self.cuda else "cpu"
        return f"{self.torch}-{cuda}"


@dataclass(frozen=True, slots=True)
class KernelEntry:
    """One prebuilt binary in manifest.json."""

    name: str
    torch: str  # the torch release whose stable ABI it targets ("2.11"): it runs on that and later 2.x
    cuda: str  # the CUDA major version of its runtime ("13"); torch's must be the same
    platform: str
    arch: tuple[str, ...]  # the code inside: smNN cubins, computeNN PTX
    path: str  # relative to the manifest's directory
    sha256: str
    source: str  # sha256 over the kernel's sources (source_digest) when it was built

    def __post_init__(self) -> None:
        if not self.arch:
            raise ValueError(f"manifest entry {self.name!r} lists no arch")
        for arch in self.arch:
            if arch_number(arch) is None:
                raise ValueError(f"manifest entry {self.name!r}: arch {arch!r} is not smNN or computeNN")
        if not re.fullmatch(r"\d+\.\d+", self.torch):
            raise ValueError(f"manifest entry {self.name!r}: torch must be MAJOR.MINOR, got {self.torch!r}")
        if not re.fullmatch(r"\d+", self.cuda):
            raise ValueError(f"manifest entry {self.name!r}: cuda must be a major version, got {self.cuda!r}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"manifest entry {self.name!r}: sha256 must be 64 lowercase hex digits")

    @classmethod
    def from_json(cls, item: dict[str, object]) -> KernelEntry:
        arch = item["arch"]
        return cls(
            name=str(item["name"]),
            torch=str(item["torch"]),
            cuda=str(item["cuda"]),
            platform=str(item["platform"]),
            arch=tuple(str(a) for a in arch) if isinstance(arch, list) else (str(arch),),
            path=str(item["path"]),
            sha256=str(item["sha256"]),
            source=str(item.get("source", "")),
        )

    def to_json(self) -> dict[str, object]:
        item = asdict(self)
        item["arch"] = list(self.arch)
        return item

    def sort_key(self) -> tuple[str, ...]:
        return (self.name, self.torch, self.cuda, self.platform, ",".join(self.arch), self.path)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The entry a GPU takes and which of its archs the GPU runs."""

    entry: KernelEntry
    arch: str


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
    """The current GPU as "sm90", "sm86", "sm121", ...; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def public_torch_version() -> str:
    return torch.__version__.split("+", 1)[0]


def current_context() -> KernelContext:
    return KernelContext(
        torch=public_torch_version(),
        cuda=torch.version.cuda,
        platform=kernel_build.platform_tag(),
        arch=current_cuda_arch(),
    )


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
    if data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: manifest format {data.get('format')!r}, expected {MANIFEST_FORMAT}")
    return [KernelEntry.from_json(item) for item in data["kernels"]]


def write_manifest(entries: Sequence[KernelEntry], path: Path = DEFAULT_MANIFEST) -> None:
    """Write entries sorted and de-duplicated (a later entry for the same binary path wins)."""
    by_path: dict[str, KernelEntry] = {}
    for entry in entries:
        by_path[entry.path] = entry
    ordered = sorted(by_path.values(), key=KernelEntry.sort_key)
    payload = {"format": MANIFEST_FORMAT, "kernels": [entry.to_json() for entry in ordered]}
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Matching


def arch_fit(entry_arch: str, device_arch: str) -> tuple[int, int] | None:
    """How well code for `entry_arch` fits a `device_arch` GPU, larger is better: (2, NN) for a
    cubin of the same major version and a minor not above the device's, (1, NN) for PTX of a
    capability not above the device's; None if the GPU cannot run it."""
    entry = arch_number(entry_arch)
    device = arch_number(device_arch)
    if entry is None or device is None or device[0] != "sm":
        return None
    kind, number = entry
    if kind == "sm":
        same_major = number // 10 == device[1] // 10 and number % 10 <= device[1] % 10
        return (2, number) if same_major else None
    return (1, number) if number <= device[1] else None


def torch_fits(entry_torch: str, running_torch: str) -> bool:
    """A binary targeting torch MAJOR.MINOR's stable ABI runs on that release and later ones of
    the same major version."""
    built = tuple(int(part) for part in entry_torch.split(".")[:2])
    running = tuple(int(part) for part in running_torch.split(".")[:2])
    return running[0] == built[0] and running >= built


def environment_fits(entry: KernelEntry, context: KernelContext) -> bool:
    return (
        context.cuda is not None
        and entry.platform == context.platform
        and entry.cuda == context.cuda.split(".")[0]
        and torch_fits(entry.torch, context.torch)
    )


def select_entry(entries: Sequence[KernelEntry], name: str, context: KernelContext) -> KernelChoice | None:
    """The best manifest entry for library `name` in `context`, and the arch the GPU runs from it."""
    if context.arch is None:
        return None
    best: tuple[tuple[int, int], KernelChoice] | None = None
    for entry in entries:
        if entry.name != name or not environment_fits(entry, context):
            continue
        for arch in entry.arch:
            fit = arch_fit(arch, context.arch)
            if fit is not None and (best is None or fit > best[0]):
                best = (fit, KernelChoice(entry, arch))
    return best[1] if best else None


def describe_context(context: KernelContext) -> str:
    return f"torch {context.torch}, CUDA {context.cuda}, {context.platform}, {context.arch}"


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
    """Load the manifest's binary for `name` if one fits this environment and passes its checks;
    return its path, or None with the reason appended to `notes`."""
    context = context or current_context()
    notes = notes if notes is not None else []
    choice = select_entry(read_manifest(manifest_path), name, context)
    if choice is None:
        notes.append(f"no prebuilt binary fits {describe_context(context)}")
        return None
    entry = choice.entry
    path = (manifest_path.parent / entry.path).resolve()
    if not path.exists():
        notes.append(f"manifest lists {entry.path} but the file is missing")
        return None
    actual = file_sha256(path)
    if actual != entry.sha256:
        notes.append(f"refused {entry.path}: its sha256 is {actual[:12]}..., the manifest says {entry.sha256[:12]}...")
        return None
    if entry.source and entry.source != source_digest(name):
        notes.append(f"refused {entry.path}: it was built from other sources than this checkout's")
        return None
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        notes.append(f"refused {entry.path}: it did not load: {error}")
        return None
    notes.append(f"{choice.arch} code for this {context.arch} GPU")
    return path


def jit_library_path(name: str, context: KernelContext) -> Path:
    root = Path(os.environ.get("ALBATROSS_KERNEL_CACHE", Path.home() / ".cache" / "albatross" / "kernels"))
    tag = f"{context.torch_tag}-{context.platform}-{context.arch}"
    return root / tag / f"{name}-{source_digest(name)[:16]}.so"


def jit_build(name: str, context: KernelContext | None = None) -> Path:
    """Compile `name` for the current GPU against the running torch into the cache (reused when
    present) and load it."""
    context = context or current_context()
    if context.arch is None:
        raise KernelBuildError(f"cannot JIT-build the CUDA kernel {name!r}: no CUDA GPU is visible")
    library = jit_library_path(name, context)
    if not library.exists():
        kernel_build.compile_library(name, [context.arch], kernel_build.TorchTree.running(), library)
    torch.ops.load_library(str(library))
    return library


def load_kernel(name: str, manifest_path: Path = DEFAULT_MANIFEST, allow_jit: bool = True) -> LoadResult:
    """Load one kernel library by the documented order, logging one line; never raises for a
    missing GPU (the result says "torch"). A JIT build that cannot start raises KernelBuildError."""
    if name in _loaded:
        return _loaded[name]
    if name not in KERNEL_SOURCES:
        raise KeyError(f"unknown kernel library {name!r}; known: {', '.join(sorted(KERNEL_SOURCES))}")
    context = current_context()
    notes: list[str] = []
    if context.arch is None or context.cuda is None:
        result = LoadResult(name, "torch", notes=["no CUDA GPU; the torch twins run"])
        log.info("albatross kernels: %s", result.describe())
    elif (path := load_precompiled_kernel_if_available(name, manifest_path, context, notes)) is not None:
        result = LoadResult(name, "prebuilt", path, notes=notes)
        log.info("albatross kernels: %s", result.describe())
    elif allow_jit:
        library = jit_library_path(name, context)
        action = "loading the cached JIT build" if library.exists() else "compiling it for this GPU (first use only, about a minute)"
        log.warning("albatross kernels: %s: %s; %s into %s", name, "; ".join(notes), action, library.parent)
        result = LoadResult(name, "jit", jit_build(name, context), notes=notes)
    else:
        result = LoadResult(name, "torch", notes=[*notes, "JIT disabled"])
        log.warning("albatross kernels: %s", result.describe())
    _loaded[name] = result
    return result


def load_kernels(
    names: Sequence[str] = tuple(KERNEL_SOURCES), manifest_path: Path = DEFAULT_MANIFEST, allow_jit: bool = True
) -> dict[str, LoadResult]:
    return {name: load_kernel(name, manifest_path, allow_jit) for name in names}
