"""How a CUDA kernel library is compiled: one nvcc command per library, against a torch tree that
need not be the running one (an unpacked wheel will do), through torch's stable C ABI only.

    tree = TorchTree.at(Path(".cache/torch-2.11.0"))   # holds torch/include, torch/lib, torch/version.py
    compile_library("wkv7", ["sm75", "sm90", "compute120"], tree, Path("out/wkv7.so"))

A library registers only its CUDA kernels (the schemas are declared in albatross/ops.py) and reaches
torch through the stable ABI, targeting torch `STABLE_ABI_TARGET`: it links libtorch_cpu and
libtorch_cuda for their C functions only, no libc10, no libpython and no Python headers, so one
binary serves that torch release and every later 2.x on any CPython (docs/kernels.md). The build
of a prebuilt binary (build_kernels.py) and the JIT build of the loader are this same command.
"""

from __future__ import annotations

import hashlib
import os
import re
import runpy
import shutil
import subprocess
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CUDA_SOURCE_DIR = PACKAGE_DIR / "cuda"

# Kernel library name -> its translation units (in cuda/). Headers in cuda/ count towards every
# library's source digest, so a header edit marks all prebuilt binaries stale.
KERNEL_SOURCES: dict[str, tuple[str, ...]] = {
    "wkv7": ("wkv7.cu",),
    "sampler": ("sampler.cu",),
    "fused": ("fused.cu",),
    "int8": ("int8_gemv.cu",),
    "gemv": ("gemv.cu",),
}

# The oldest torch whose stable ABI has everything the kernels use (2.10's typed data pointers,
# the C shim's caching-allocator tensors and current CUDA stream); binaries run on it and later.
STABLE_ABI_TARGET = (2, 11)

NVCC_FLAGS: tuple[str, ...] = (
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-shared",
    "-Xcompiler=-fPIC,-fvisibility=hidden",
    "-cudart=shared",  # torch's libcudart: one CUDA runtime in the process
    "--no-device-link",  # no relocatable device code: the device-link step would only add an empty cubin per arch
)

_ARCH_PATTERN = re.compile(r"^(sm|compute)(\d+)$")


class KernelBuildError(RuntimeError):
    """A build cannot start or failed; the message says what is missing or what went wrong."""


def arch_number(arch: str) -> tuple[str, int] | None:
    """("sm", 86) for "sm86", ("compute", 120) for "compute120"; None if malformed."""
    match = _ARCH_PATTERN.match(arch)
    return (match.group(1), int(match.group(2))) if match else None


def arch_gencode_flags(archs: Sequence[str]) -> list[str]:
    """nvcc -gencode flags: smNN emits machine code (a cubin), computeNN emits PTX."""
    flags: list[str] = []
    for arch in archs:
        parsed = arch_number(arch)
        if parsed is None:
            raise ValueError(f"arch {arch!r} is not smNN or computeNN")
        kind, number = parsed
        if number < 75:
            raise ValueError(f"arch {arch!r}: CUDA 13 builds for compute capability 7.5 and newer only")
        code = f"sm_{number}" if kind == "sm" else f"compute_{number}"
        flags.append(f"-gencode=arch=compute_{number},code={code}")
    return flags


def kernel_sources(name: str, source_dir: Path = CUDA_SOURCE_DIR) -> list[Path]:
    if name not in KERNEL_SOURCES:
        raise KeyError(f"unknown kernel library {name!r}; known: {', '.join(sorted(KERNEL_SOURCES))}")
    return [source_dir / unit for unit in KERNEL_SOURCES[name]]


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_headers(units: Sequence[Path], source_dir: Path = CUDA_SOURCE_DIR) -> list[Path]:
    """The headers of `source_dir` that `units` include ("..." includes, followed through headers),
    sorted by name: a library's binary depends on these and on nothing else in the directory."""
    found: dict[str, Path] = {}
    pending = list(units)
    while pending:
        for name in _LOCAL_INCLUDE.findall(pending.pop().read_bytes()):
            header = source_dir / name.decode()
            if header.name not in found and header.exists():
                found[header.name] = header
                pending.append(header)
    return [found[name] for name in sorted(found)]


def source_digest(name: str, source_dir: Path = CUDA_SOURCE_DIR) -> str:
    """sha256 over a library's translation units and the headers they include, in a fixed order.

    Only included headers count, so a header one library adds leaves the other
    libraries' committed binaries fresh."""
    units = kernel_sources(name, source_dir)
    digest = hashlib.sha256()
    for path in [*units, *local_headers(units, source_dir)]:
        digest.update(path.name.encode())
        digest.update(b"\0")
        # Normalise line endings so a Windows checkout does not mark every binary stale.
        digest.update(path.read_bytes().replace(b"\r\n", b"\n"))
        digest.update(b"\0")
    return digest.hexdigest()


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


@dataclass(frozen=True, slots=True)
class TorchTree:
    """A torch installation to compile against: `root` holds the `torch/` package directory."""

    root: Path
    version: str  # public version, e.g. "2.11.0" (no local "+cu130" suffix)
    cuda: str | None  # e.g. "13.0"; None for a CPU build

    @classmethod
    def at(cls, root: Path) -> TorchTree:
        """The tree at `root` (site-packages, or an unpacked wheel), read without importing it."""
        version_file = root / "torch" / "version.py"
        if not version_file.exists():
            raise KernelBuildError(f"{root} is not a torch tree: {version_file} is missing")
        info = runpy.run_path(str(version_file))
        return cls(root=root, version=str(info["__version__"]).split("+", 1)[0], cuda=info.get("cuda"))

    @classmethod
    def running(cls) -> TorchTree:
        import torch

        return cls.at(Path(torch.__file__).resolve().parents[1])

    @property
    def release(self) -> str:
        """"2.11" for 2.11.0: binaries built against this tree run on this release and later."""
        return ".".join(self.version.split(".")[:2])

    @property
    def include_dir(self) -> Path:
        return self.root / "torch" / "include"

    @property
    def lib_dir(self) -> Path:
        return self.root / "torch" / "lib"

    def problems(self) -> list[str]:
        """Why this tree cannot build the kernels (empty: it can)."""
        found: list[str] = []
        if self.cuda is None:
            found.append(f"a CUDA build of torch (this is {self.version}, a CPU-only build; install a CUDA build such as +cu130)")
        major_minor = tuple(int(part) for part in self.version.split(".")[:2])
        if major_minor < STABLE_ABI_TARGET:
            target = ".".join(map(str, STABLE_ABI_TARGET))
            found.append(f"torch >= {target} (this is {self.version}; the kernels use torch {target}'s stable ABI)")
        elif not (self.include_dir / "torch" / "csrc" / "stable" / "library.h").exists():
            found.append(f"torch's C++ headers ({self.include_dir / 'torch/csrc/stable'} is missing)")
        return found


def stable_abi_define() -> str:
    major, minor = STABLE_ABI_TARGET
    return f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"


def find_cuda_home() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME or $CUDA_PATH, else the nvcc on PATH, else /usr/local/cuda."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parents[1]
    default = Path("/usr/local/cuda")
    return default if default.exists() else None


def find_nvcc(cuda_home: Path | None) -> Path | None:
    nvcc = cuda_home / "bin" / "nvcc" if cuda_home else None
    return nvcc if nvcc is not None and nvcc.exists() else None


def nvcc_release(nvcc: Path) -> str:
    """"13.0" for CUDA 13.0's nvcc."""
    done = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"release (\d+\.\d+)", done.stdout)
    if done.returncode != 0 or match is None:
        raise KernelBuildError(f"{nvcc} --version failed: {done.stdout}{done.stderr}")
    return match.group(1)


def nvcc_command(name: str, archs: Sequence[str], tree: TorchTree, output: Path, nvcc: Path, threads: int = 1) -> list[str]:
    """The one command that compiles and links library `name` for `archs` against `tree`."""
    return [
        str(nvcc),
        *NVCC_FLAGS,
        f"--threads={threads}",
        stable_abi_define(),
        f"-I{tree.include_dir}",
        f"-I{CUDA_SOURCE_DIR}",
        *arch_gencode_flags(archs),
        *(str(path) for path in kernel_sources(name)),
        "-o",
        str(output),
        f"-L{tree.lib_dir}",
        "-ltorch_cpu",
        "-ltorch_cuda",
    ]


def compile_library(name: str, archs: Sequence[str], tree: TorchTree, output: Path, threads: int = 1) -> Path:
    """Compile library `name` for `archs` against `tree` into `output` (replaced atomically)."""
    cuda_home = find_cuda_home()
    nvcc = find_nvcc(cuda_home)
    problems = tree.problems()
    if nvcc is None:
        problems.append("nvcc (the CUDA toolkit; set CUDA_HOME or put nvcc on PATH)")
    if problems:
        raise KernelBuildError(f"cannot build the CUDA kernel {name!r}: missing " + "; ".join(problems))
    assert nvcc is not None and tree.cuda is not None
    release = nvcc_release(nvcc)
    if release.split(".")[0] != tree.cuda.split(".")[0]:
        raise KernelBuildError(
            f"cannot build {name!r}: nvcc is CUDA {release} but torch {tree.version} is built for CUDA {tree.cuda} "
            "(the library would need another CUDA runtime than torch's)"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.{os.getpid()}.partial")
    command = nvcc_command(name, archs, tree, partial, nvcc, threads)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise KernelBuildError(f"building {name} for {','.join(archs)} failed:\n{' '.join(command)}\n{done.stdout}\n{done.stderr}")
    partial.replace(output)
    return output
