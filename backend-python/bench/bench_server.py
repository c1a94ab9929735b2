"""The real server, with the Albatross engine's device step swapped for a benchmark's: the HTTP
layer, admission, routes, engine and worker are the product's; only `DeviceStep` changes.

    # on a GPU: the real step, with CUDA events around every step (bench/step_profile.py)
    python bench/bench_server.py --device-step profiled --model-path random:7.2b \
        --strategy "albatross workers=1 batch=960" --port 8123
    # anywhere: a simulated device with the H200's step times (bench/simulated_device.py)
    python bench/bench_server.py --device-step simulated --model-path random:2x64 \
        --strategy "albatross workers=1 batch=960" --port 8123

then load it with `bench/albatross_api_benchmark.py --url http://127.0.0.1:8123 --device-report`.

`GET /bench/device-report` answers each worker's device report (`EngineCore.device_reports()`):
what the device did since the previous read (steps, GPU time per kind of step, the mixed steps'
time fit, the idle time between steps), so a warm-up level can be read off and dropped before the
level that is measured. The simulated device builds its tiny model on the CPU whatever the model
path says (its steps take the simulated time, not the model's); its HTTP figures against
`host_overhead.py`'s in-process ones are what the HTTP layer costs.

Every other flag is main.py's (`python main.py --help`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when started through runpy (engine_gpu_session.sh)

from fastapi import FastAPI

from runner.app import create_app, startup_model_problem
from runner.backends import BACKENDS
from runner.context import app_context
from runner.drain import DrainingServer
from runner.interface import AbstractRWKV
from runner.request_log import configure_logging
from runner.server import listening_socket, uvicorn_config
from runner.settings import ServerSettings, settings_from_args
from simulated_device import H200_DECODE_BY_ROWS, H200_DECODE_MS, H200_MIXED, SimulatedDevice
from step_profile import ProfiledDevice

DEVICE_STEPS = ("real", "profiled", "simulated")
SIMULATED_MODEL = "random:2x64"  # the simulated device's steps do not run it; it only has to load fast

_device_step: Any = None  # the factory create_backend passes on (None: the real DeviceStep)
_simulated = False


def create_backend(model_path: str, strategy: str, settings: ServerSettings) -> AbstractRWKV:
    """The registry's albatross factory (runner/backends.py): the product's, with the chosen device
    step. The simulated device stands in for a GPU: a tiny model on the CPU, the host work of step
    N overlapped with step N+1 as on a GPU (the strategy's last words win)."""
    from albatross_engine import adapter

    if _simulated:
        model_path, strategy = SIMULATED_MODEL, f"{strategy} device=cpu overlap=true"
    return adapter.create_backend(model_path, strategy, settings, device_step_factory=_device_step)


def add_report_route(app: FastAPI) -> None:
    @app.get("/bench/device-report")
    async def device_report() -> dict[str, object]:
        backend = app_context(app).manager.backend
        core = getattr(backend, "core", None)
        return {"workers": core.device_reports() if core is not None else []}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ServerSettings]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    parser.add_argument("--device-step", choices=DEVICE_STEPS, default="profiled")
    parser.add_argument("--simulated-step", default=",".join(map(str, (H200_DECODE_MS, *H200_MIXED))),
                        help="the simulated device: decode-only step ms, then a mixed step's ms, us per prompt token, us per decode row")  # fmt: skip
    parser.add_argument("--simulated-decode-per-row", type=float, default=0.0,
                        help=f"ms a decode-only step adds per row, its first number then being the base (the H200: {H200_DECODE_BY_ROWS})")  # fmt: skip
    parser.add_argument("--sync-debug", action="store_true",
                        help="log each distinct place where the process makes the host wait for the GPU (torch's sync debug mode), with its stack")  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    return args, settings_from_args(rest)


def log_synchronizing_calls(file: TextIO = sys.stderr) -> None:
    """torch warns at every call that makes the host wait for the device (`.item()`, `.tolist()`, a
    copy to pageable memory, `nonzero` ...); each distinct stack is printed once to `file`, so the
    server log names the waits inside a step. The worker's deliberate waits (the sampled ids'
    event) are event syncs, which torch does not flag. Without CUDA only the printing is set up."""
    import torch

    seen: set[tuple[str, ...]] = set()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file_=None, line=None):  # type: ignore[no-untyped-def]
        if "synchronizing" not in str(message):
            return original(message, category, filename, lineno, file_, line)
        stack = tuple(f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename)
        if stack not in seen:
            seen.add(stack)
            print(f"[sync-debug] {message}\n    " + "\n    ".join(stack[-12:]), file=file, flush=True)

    warnings.showwarning = show
    warnings.simplefilter("always", UserWarning)  # every occurrence reaches `show`, which keeps the distinct ones
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")


def main(argv: list[str] | None = None) -> None:
    global _device_step, _simulated
    args, settings = parse_args(argv)
    configure_logging(settings.log_level, settings.log_format)
    if args.sync_debug:
        log_synchronizing_calls()
    if args.device_step == "profiled":
        _device_step = ProfiledDevice()
    elif args.device_step == "simulated":
        decode_ms, *mixed = (float(x) for x in args.simulated_step.split(","))
        if len(mixed) != 3:
            sys.exit("error: --simulated-step takes four numbers: decode ms, mixed ms, us per prompt token, us per decode row")
        _device_step = SimulatedDevice(decode_ms, (mixed[0], mixed[1], mixed[2]), decode_ms_per_row=args.simulated_decode_per_row)
        _simulated = True
    albatross = dataclasses.replace(BACKENDS[0], factory=f"{__name__}:create_backend")
    if _simulated:
        albatross = dataclasses.replace(albatross, preflight=())  # the path is not what loads
    app = create_app(settings, registry=(albatross, *BACKENDS[1:]))
    add_report_route(app)
    problem = startup_model_problem(app_context(app))
    if problem is not None:
        sys.exit(f"error: {problem}")
    sock = listening_socket(settings.host, settings.port)
    server = DrainingServer(uvicorn_config(app, settings), app)
    app_context(app).request_exit = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(1)


if __name__ == "__main__":
    main()
