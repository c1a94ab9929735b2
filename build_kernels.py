"""Build the albatross CUDA kernel libraries for a list of GPU archs and record them in manifest.json.

    python build_kernels.py --arch sm80,sm86,sm89,sm90 [--output-root backend-python/albatross/kernels]
                            [--kernels wkv7,sampler] [--manifest manifest.json]

Each (kernel, arch) is compiled with torch.utils.cpp_extension in a child process (so one process
can build the same library for several archs), copied to
`<output-root>/<torch>-<cuda>/<platform>/<python abi>/<arch>/<kernel>.so`, and entered in the
manifest with its sha256 and the digest of the sources it was built from. The manifest is kept
sorted with one entry per binary path. `computeNN` in --arch builds PTX for chips >= NN.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT / "backend-python"))

from albatross import kernel_loader  # noqa: E402  (needs the path above)


def _build_one(
    name: str, arch: str, context: kernel_loader.KernelContext, scratch: Path, output_root: Path, manifest: Path
) -> kernel_loader.KernelEntry:
    arch_context = kernel_loader.KernelContext(context.torch, context.cuda, context.python_abi, context.platform, arch)
    print(f"building {name} for {arch} ...", flush=True)
    library = Path(kernel_loader.build_in_child_process(name, arch_context, scratch))
    target_dir = output_root / context.torch_tag / context.platform / context.python_abi / arch
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / f"{name}.so"
    shutil.copyfile(library, target)
    entry = kernel_loader.KernelEntry(
        name=name,
        torch=context.torch,
        cuda=str(context.cuda),
        python_abi=context.python_abi,
        platform=context.platform,
        arch=(arch,),
        path=target.resolve().relative_to(manifest.resolve().parent).as_posix(),
        sha256=kernel_loader.file_sha256(target),
        source=kernel_loader.source_digest(name),
    )
    print(f"  {name} {arch} -> {entry.path} ({target.stat().st_size / 1e6:.1f} MB, sha256 {entry.sha256[:12]}...)", flush=True)
    return entry


def build(kernels: list[str], archs: list[str], output_root: Path, manifest: Path) -> list[kernel_loader.KernelEntry]:
    context = kernel_loader.current_context()
    if context.cuda is None:
        raise SystemExit(f"torch {kernel_loader.torch.__version__} is a CPU build: building kernels needs a CUDA build of torch")
    entries = kernel_loader.read_manifest(manifest)
    jobs = [(name, arch) for arch in archs for name in kernels]
    with tempfile.TemporaryDirectory(prefix="albatross-build-") as scratch:
        # Each build is an nvcc process of its own: run them side by side.
        with ThreadPoolExecutor(max_workers=len(jobs)) as executor:
            futures = [executor.submit(_build_one, name, arch, context, Path(scratch) / arch, output_root, manifest) for name, arch in jobs]
            built = [future.result() for future in futures]
    kernel_loader.write_manifest([*entries, *built], manifest)
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, help="comma-separated archs: sm80,sm86,sm89,sm90 (computeNN for PTX)")
    parser.add_argument("--output-root", type=Path, default=kernel_loader.KERNELS_DIR)
    parser.add_argument("--kernels", default=",".join(kernel_loader.KERNEL_SOURCES), help="which kernel libraries")
    parser.add_argument("--manifest", type=Path, default=kernel_loader.DEFAULT_MANIFEST)
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    for arch in archs:
        kernel_loader.arch_gencode_flags([arch])  # rejects a malformed arch before any compiling
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for name in kernels:
        kernel_loader.kernel_sources(name)  # an unknown name lists the known ones
    built = build(kernels, archs, args.output_root, args.manifest)
    print(f"built {len(built)} binaries; manifest {args.manifest} updated")


if __name__ == "__main__":
    main()
