"""Worker processes (`worker_mode=process`): a worker killed with SIGKILL mid-stream fails only its
own requests and comes back; one that cannot come back leaves the backend unhealthy but serving;
shutdown, and the server's own death, leave no worker process behind (no zombie, no orphan)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from albatross.model import RWKV7
from albatross_engine import worker_process
from albatross_engine.adapter import AlbatrossRWKV
from albatross_engine.tasks import EngineTask
from albatross_engine.worker_process import WorkerProcess
from engine_helpers import collect, reference_tokens
from runner.interface import BackendError, GenerationEvent, GenerationRequest, OutputConstraint, SamplingParams

BACKEND_ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 180.0  # a bound against hanging on a stuck machine, never a performance threshold


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=())


def process_workers(backend: AlbatrossRWKV) -> list[WorkerProcess]:
    workers = backend.core.workers
    assert all(isinstance(w, WorkerProcess) for w in workers)
    return workers  # type: ignore[return-value]


def process_state(pid: int) -> str | None:
    """The kernel's state letter of a process (Z: a zombie), None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"still waiting for {what} after {WAIT_S:.0f} s"
        time.sleep(0.05)


@pytest.fixture
def two_processes(tiny_checkpoint: Path) -> Iterator[AlbatrossRWKV]:
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=2, batch_size=4, device="cpu", worker_mode="process")
    yield backend
    backend.shutdown()


async def _stream(backend: AlbatrossRWKV, request: GenerationRequest, started: asyncio.Event) -> list[GenerationEvent] | BackendError:
    events: list[GenerationEvent] = []
    try:
        async for event in backend.async_generate(request):
            events.append(event)
            started.set()
    except BackendError as error:
        return error
    return events


def test_a_worker_process_killed_mid_stream_fails_only_its_own_requests_and_is_started_again(
    two_processes: AlbatrossRWKV, tiny_checkpoint: Path
) -> None:
    backend = two_processes
    model = RWKV7.load(tiny_checkpoint, "cpu", progress=False)
    prompts = [[3, 1, 4], [1, 5, 9], [2, 6, 5], [3, 5, 8]]
    params = greedy(80)
    expected = [reference_tokens(model, prompt, params) for prompt in prompts]
    victim = process_workers(backend)[1]
    killed_pid = victim.pid
    assert killed_pid is not None

    async def run() -> list[list[GenerationEvent] | BackendError]:
        started = [asyncio.Event() for _ in prompts]
        streams = [asyncio.create_task(_stream(backend, GenerationRequest(p, params), s)) for p, s in zip(prompts, started)]
        for event in started:
            await event.wait()  # every request is mid-stream on its worker
        os.kill(killed_pid, signal.SIGKILL)
        return list(await asyncio.gather(*streams))

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BackendError)]
    assert len(failed) == 2, f"the killed worker held two of the four requests: {results}"
    assert all(error.status_code == 503 and "worker 1" in error.message for error in failed), [e.message for e in failed]
    for result, tokens in zip(results, expected):
        if isinstance(result, list):
            assert [t for e in result for t in e.token_ids] == tokens, "a request of the surviving worker changed"
            assert result[-1].finish_reason == "length"

    wait_until(lambda: backend.health() is None, "the killed worker to be serving again")
    assert victim.restarts == 1 and victim.pid != killed_pid
    assert process_state(killed_pid) is None, "the killed worker process was not reaped"
    again = asyncio.run(_run_all(backend, [GenerationRequest(p, params) for p in prompts]))
    assert [[t for e in events for t in e.token_ids] for events in again] == expected, "the restarted worker serves correctly"
    assert victim.metrics.snapshot().steps > 0, "the restarted worker took requests"
    pids = [w.pid for w in process_workers(backend)]
    backend.shutdown()
    assert all(pid is not None and process_state(pid) is None for pid in pids), "shutdown left a worker process"
    assert not [t.name for t in __import__("threading").enumerate() if t.name.startswith("albatross-")], "threads left"


async def _run_all(backend: AlbatrossRWKV, requests: list[GenerationRequest]) -> list[list[GenerationEvent]]:
    async def one(request: GenerationRequest) -> list[GenerationEvent]:
        return [event async for event in backend.async_generate(request)]

    return list(await asyncio.gather(*(one(r) for r in requests)))


def test_a_worker_process_that_cannot_come_back_leaves_the_backend_unhealthy_but_serving(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_process, "RESTART_LIMIT", 0)
    backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=2, batch_size=2, device="cpu", worker_mode="process")
    try:
        first, second = process_workers(backend)
        second_pid = second.pid
        assert second_pid is not None
        os.kill(second_pid, signal.SIGKILL)
        wait_until(lambda: second.state == "down", "worker 1 to give up")
        assert process_state(second_pid) is None, "the dead worker process was not reaped"
        health = backend.health()
        assert health is not None and "1" in health, health
        assert backend.status()["workers"] == ["serving", "down"]
        served = asyncio.run(_run_all(backend, [GenerationRequest([5, 6], greedy(3)) for _ in range(3)]))
        assert all(events[-1].finish_reason == "length" for events in served), "the other worker serves everything"
        os.kill(first.pid or 0, signal.SIGKILL)
        wait_until(lambda: first.state == "down", "worker 0 to give up")
        with pytest.raises(BackendError) as caught:
            asyncio.run(_run_all(backend, [GenerationRequest([5, 6], greedy(3))]))
        assert caught.value.status_code == 503 and "died" in caught.value.message, caught.value.message
    finally:
        backend.shutdown()


def test_worker_processes_exit_when_the_server_process_is_killed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(BACKEND_ROOT)!r})
        from albatross_engine.adapter import AlbatrossRWKV

        if __name__ == "__main__":
            backend = AlbatrossRWKV({str(tiny_checkpoint)!r}, worker_num=2, batch_size=2, device="cpu", worker_mode="process")
            print(" ".join(str(w.pid) for w in backend.core.workers), flush=True)
            time.sleep(600)
    """))
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        pids = [int(pid) for pid in server.stdout.readline().split()]
        assert len(pids) == 2, "the server started two worker processes"
        server.kill()
        server.wait()
        wait_until(lambda: all(process_state(pid) in (None, "Z") for pid in pids), "the orphaned workers to exit")
    finally:
        server.kill()


def test_switching_models_twice_and_unloading_leaves_no_worker_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from runner.model_manager import ModelManager
    from runner_fakes import settings_with

    manager = ModelManager(settings_with(models_dir=tiny_checkpoint.parent, state_cache_path=tmp_path / "states.sqlite3"))
    strategy = "albatross workers=2 batch=2 device=cpu worker_mode=process"
    seen: list[int] = []

    async def switch_twice_then_unload() -> None:
        for _ in range(2):
            await manager.switch(tiny_checkpoint.name, strategy)
            backend = manager.require_backend()
            assert isinstance(backend, AlbatrossRWKV) and backend.worker_mode == "process"
            seen.extend(w.pid or 0 for w in process_workers(backend))
        await manager.unload()

    asyncio.run(switch_twice_then_unload())
    assert len(set(seen)) == 4, "each load started its own two worker processes"
    assert [pid for pid in seen if process_state(pid) is not None] == [], "a switch or the unload left a worker process"


@pytest.mark.skipif("grammar" not in {f.name for f in fields(EngineTask)}, reason="EngineTask carries no grammar yet (the engine's constraints)")
def test_constrained_requests_are_enforced_by_worker_processes_as_by_a_worker_thread(tiny_checkpoint: Path) -> None:
    """The grammar crosses as text and each worker process compiles it for its own matchers: the
    answers keep to it as a worker thread's do, and the unconstrained request beside them is the same."""
    yes_or_no = OutputConstraint('start: "yes" | "no, thanks"', "test")
    requests = [
        *(GenerationRequest([5 + i, 6], SamplingParams(max_tokens=30, temperature=1.0, seed=i), constraint=yes_or_no) for i in range(4)),
        GenerationRequest([5, 6], greedy(6)),
    ]
    answers: dict[str, list[tuple[str, str | None]]] = {}
    for mode in ("thread", "process"):
        backend = AlbatrossRWKV(str(tiny_checkpoint), worker_num=2, batch_size=4, device="cpu", worker_mode=mode)
        try:
            answers[mode] = [("".join(e.text for e in events), events[-1].finish_reason) for events in collect(backend, requests)]
        finally:
            backend.shutdown()
    for mode, answered in answers.items():
        assert all(text in ("yes", "no, thanks") and reason == "stop" for text, reason in answered[:4]), mode
    assert answers["process"][4] == answers["thread"][4], "the unconstrained greedy request next to them is untouched"
