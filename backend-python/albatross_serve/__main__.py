"""`python -m albatross_serve --replicas 2 --model-path ... --state-store redis://...`: the server's
replicas on Ray Serve. Takes every flag of main.py (and its RWKV_* twins) plus the few below; `--host`
and `--port` are where Serve's HTTP proxy listens. Runs until SIGTERM or Ctrl-C, then shuts Serve
down (each replica drains for up to `--drain-timeout` and flushes its cached states).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from runner.settings import ServerSettings, build_parser, settings_from_args

log = logging.getLogger("albatross_serve")
BACKEND_DIR = Path(__file__).resolve().parents[1]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("Ray Serve")
    group.add_argument("--replicas", type=int, default=None, help="replicas (default: the cluster's GPUs / workers per replica, 1 on the CPU)")
    group.add_argument("--ray-address", default=None, help="an existing Ray cluster ('auto', 'ray://HOST:10001'); default: start a local one")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica (default 1)")
    return parser


def workers_per_replica(strategy: str | None) -> int:
    """The GPUs one replica drives: `workers=N` of an albatross strategy (1 otherwise)."""
    words = (strategy or "").split()
    if not words or words[0] not in ("albatross", "chirrup"):
        return 1
    from albatross_engine.config import parse_albatross_strategy

    return parse_albatross_strategy(strategy or "").worker_num


def replica_plan(settings: ServerSettings, resources: Mapping[str, float], replicas: int | None, replica_cpus: float) -> tuple[int, float]:
    """(replicas, GPUs per replica) for the cluster: one replica per GPU group, or one on the CPU."""
    gpus = int(resources.get("GPU", 0))
    if gpus == 0:
        return (replicas or 1), 0.0
    group = workers_per_replica(settings.strategy)
    fitting = gpus // group
    if fitting == 0:
        raise SystemExit(f"a replica needs {group} GPUs (workers={group}) but the cluster has {gpus}")
    return (replicas or fitting), float(group)


def main(argv: Sequence[str] | None = None) -> None:
    extra = serve_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(build_parser().format_help())
        print(extra.format_help())
        return
    serve_args, rest = extra.parse_known_args(argv)
    # /switch-model and /exit would reach one replica only: a Serve deployment has a fixed model.
    settings = dataclasses.replace(settings_from_args(rest), deploy=True)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.model_path:
        raise SystemExit("albatross_serve needs --model-path: every replica loads it at start")

    import ray
    from ray import serve

    from albatross_serve.deployment import APP_NAME, ReplicaShape, build_application

    env = {"RWKV_V7_ON": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(BACKEND_DIR), os.environ.get("PYTHONPATH")]))}
    os.environ.update(env)  # a local cluster's processes inherit it; a remote one gets it via runtime_env
    ray.init(address=serve_args.ray_address, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=True)
    replicas, gpus = replica_plan(settings, ray.cluster_resources(), serve_args.replicas, serve_args.replica_cpus)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    application = build_application(settings, replicas, ReplicaShape(gpus=gpus, cpus=serve_args.replica_cpus))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
    log.info("serving %d replica(s) of %s on http://%s:%d (%s GPU(s) each)", replicas, settings.model_path, settings.host, settings.port, gpus or "no")
    print(f"albatross_serve: {replicas} replica(s) ready on http://{settings.host}:{settings.port}", flush=True)
    stop.wait()
    log.info("stopping: replicas drain for up to %.0f s", settings.drain_timeout)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
