"""Build the albatross CUDA kernel libraries and record them in manifest.json.

    python build_kernels.py [--torch-root DIR] [--arch sm75,sm80,sm86,sm89,sm90,sm100,sm120,compute100]
                            [--kernels wkv7,sampler,fused] [--layout fat|per-arch]
                            [--output-root backend-python/albatross/kernels] [--manifest manifest.json]

`--torch-root` is a torch tree to build against (a directory holding `torch/`: site-packages, or an
unpacked wheel); the running torch by default. Only its headers and libraries are used, never
Python. The binaries run on that torch release and later 2.x ones (the stable ABI), so build
against the oldest release they must serve. Each library is one nvcc command
(albatross.kernel_build) for every arch at once: a fat binary, the default, smaller than one file
per arch (docs/kernels.md); `--layout per-arch` makes one file per arch. `smNN` builds a cubin,
`computeNN` PTX for the driver to compile on newer GPUs. Binaries go to
`<output-root>/torch<release>-cu<CUDA major>/<platform>[/<arch>]/<name>.so`; each replaces the
manifest entries of the same library and environment whose archs it covers.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT / "backend-python"))

from albatross import kernel_build, kernel_loader  # noqa: E402  (needs the path above)

DEFAULT_ARCHS = "sm75,sm80,sm86,sm89,sm90,sm100,sm120,compute100"


def _entry(name: str, archs: list[str], tree: kernel_build.TorchTree, target: Path, manifest: Path) -> kernel_loader.KernelEntry:
    assert tree.cuda is not None
    return kernel_loader.KernelEntry(
        name=name,
        torch=tree.release,
        cuda=tree.cuda.split(".")[0],
        platform=kernel_build.platform_tag(),
        arch=tuple(archs),
        path=target.resolve().relative_to(manifest.resolve().parent).as_posix(),
        sha256=kernel_loader.file_sha256(target),
        source=kernel_build.source_digest(name),
    )


def _supersedes(new: kernel_loader.KernelEntry, old: kernel_loader.KernelEntry) -> bool:
    same = (new.name, new.torch, new.cuda, new.platform) == (old.name, old.torch, old.cuda, old.platform)
    return old.path == new.path or (same and bool(set(new.arch) & set(old.arch)))


def build(
    kernels: list[str], archs: list[str], tree: kernel_build.TorchTree, layout: str, output_root: Path, manifest: Path
) -> list[kernel_loader.KernelEntry]:
    problems = tree.problems()
    if problems:
        raise SystemExit(f"torch tree {tree.root} cannot build the kernels: missing " + "; ".join(problems))
    assert tree.cuda is not None
    base = output_root / f"torch{tree.release}-cu{tree.cuda.split('.')[0]}" / kernel_build.platform_tag()
    groups = [archs] if layout == "fat" else [[arch] for arch in archs]
    jobs = [(name, group, base / (group[0] if layout == "per-arch" else "") / f"{name}.so") for name in kernels for group in groups]
    workers = min(len(jobs), os.cpu_count() or 1)
    threads = max(1, (os.cpu_count() or 1) // workers)  # nvcc compiles the archs of one job in parallel

    def run(job: tuple[str, list[str], Path]) -> kernel_loader.KernelEntry:
        name, group, target = job
        print(f"building {name} for {','.join(group)} against torch {tree.version} (CUDA {tree.cuda}) ...", flush=True)
        kernel_build.compile_library(name, group, tree, target, threads)
        entry = _entry(name, group, tree, target, manifest)
        print(f"  {name} -> {entry.path} ({target.stat().st_size / 1e6:.2f} MB, sha256 {entry.sha256[:12]}...)", flush=True)
        return entry

    with ThreadPoolExecutor(max_workers=workers) as executor:
        built = list(executor.map(run, jobs))
    try:
        kept = kernel_loader.read_manifest(manifest)
    except ValueError as error:  # an older manifest format: start a new one
        print(f"note: {error}; writing a new manifest", flush=True)
        kept = []
    kept = [old for old in kept if not any(_supersedes(new, old) for new in built)]
    kernel_loader.write_manifest([*kept, *built], manifest)
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=DEFAULT_ARCHS, help=f"comma-separated smNN (cubin) / computeNN (PTX); default {DEFAULT_ARCHS}")
    parser.add_argument("--torch-root", type=Path, help="directory holding torch/ to build against (default: the running torch)")
    parser.add_argument("--kernels", default=",".join(kernel_build.KERNEL_SOURCES), help="which kernel libraries")
    parser.add_argument("--layout", choices=("fat", "per-arch"), default="fat", help="one file for all archs, or one per arch")
    parser.add_argument("--output-root", type=Path, default=kernel_loader.KERNELS_DIR)
    parser.add_argument("--manifest", type=Path, default=kernel_loader.DEFAULT_MANIFEST)
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    kernel_build.arch_gencode_flags(archs)  # rejects a malformed arch before any compiling
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for name in kernels:
        kernel_build.kernel_sources(name)  # an unknown name lists the known ones
    tree = kernel_build.TorchTree.at(args.torch_root.resolve()) if args.torch_root else kernel_build.TorchTree.running()
    built = build(kernels, archs, tree, args.layout, args.output_root, args.manifest)
    print(f"built {len(built)} binaries; manifest {args.manifest} updated")


if __name__ == "__main__":
    main()
