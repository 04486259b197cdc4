"""A fleet process: simulated agents as threads, each the real :class:`agent.loop.agent.Agent`
with its own rendezvous handler, with stand-in workers (:mod:`benchmarks.fleet.standin`).

Run as ``python -m benchmarks.fleet.host``. The driver (:mod:`benchmarks.fleet.fleet`)
writes one JSON object per line on stdin; this process answers with one per line on
stdout (every event carries ``t``, a ``time.monotonic()`` stamp, system-wide on Linux):

- first line, the process's settings: ``{"endpoint", "step_s", "epoch", "client",
  "log_dir"}``; answered ``{"event": "up", "pid"}``;
- ``{"cmd": "build", "id", "agents": [AgentSpec, ...]}``: builds a handler and an
  ``Agent`` per spec (see :func:`_config`); answers ``{"event": "ready", "id"}``;
- ``{"cmd": "run", "id", "at"}``: every agent built and not yet run calls ``run()`` at
  ``at``; each then reports ``{"event": "started", "agent", "run", "round", "rank",
  "world", "formed_s", "t"}`` whenever its workers start, ``{"event": "stopped",
  "agent", "t"}`` when it stopped them, and ``{"event": "exited", "agent", "code", "t"}``
  when ``run()`` returned (and it left the run);
- ``{"cmd": "fail", "id", "agent", "code"}``, ``{"cmd": "stall", "id", "agent"}``: its
  worker of local rank 0 exits with ``code`` / every worker stops reporting progress;
  answered ``{"event": "done", "id", "agent", "t"}``;
- ``{"cmd": "finish", "id"}``: every running worker of this process exits 0 (the
  training is over), and so does every worker started later; answered
  ``{"event": "finished", "id", "t"}``;
- ``{"cmd": "release", "id"}``: agents whose ``run()`` returned are let go (their client
  closed); answered ``{"event": "released", "id"}``;
- ``{"cmd": "stats", "id"}``: ``{"event": "stats", "id", "cpu_s", "threads"}``;
- ``{"cmd": "exit"}`` or the end of input: the process exits at once.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.observe.metrics import RunMetrics
from benchmarks.node import _describe, _emit  # one JSON line a message, as node processes

__all__ = ["main"]

log = logging.getLogger(__name__)


@dataclass
class _Sim:
    """One simulated agent: its handler, its agent, its launcher, its thread."""

    index: int
    run_id: str
    handler: Any
    agent: Any
    launcher: Any
    formed_s: list[float] = field(default_factory=list)
    thread: threading.Thread | None = None
    done: bool = False


class _FormedTimes(RunMetrics):
    """The agent's metrics, of which only the formation times are kept."""

    def __init__(self) -> None:
        self.formed: list[float] = []

    def round_formed(self, round_number: int, nodes: int, seconds: float) -> None:
        self.formed.append(seconds)


def _config(spec: dict[str, Any], endpoint: str, log_dir: str) -> Any:
    """The agent's ``LaunchConfig`` from an AgentSpec: ``{"index", "run_id", "min",
    "max", "conf": {rdzv_conf}, "hang_timeout", "health_check", "monitor_interval"}``."""
    from agent.config import LaunchConfig

    hang = spec.get("hang_timeout")
    return LaunchConfig(
        min_nodes=int(spec["min"]),
        max_nodes=int(spec["max"]),
        nproc_per_node=1,
        entrypoint="stand-in",
        rdzv_backend="etcd-v3",
        rdzv_endpoint=endpoint,
        rdzv_id=str(spec["run_id"]),
        rdzv_conf={str(k): str(v) for k, v in spec.get("conf", {}).items()},
        max_restarts=1000,
        monitor_interval=float(spec.get("monitor_interval", 0.1)),
        local_addr="127.0.0.1",
        log_dir=log_dir,
        warm_start=False,
        stop_grace_period=0.0,
        hang_timeout=None if hang is None else float(hang),
        health_check=bool(spec.get("health_check", False)),
    )


class Host:
    """The agents of this process and what the driver asks of them."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from benchmarks.fleet.standin import Trainer

        self._endpoint = str(settings["endpoint"])
        self._log_dir = str(settings["log_dir"])
        self._shared = settings.get("client") == "per-process"
        self._trainer = Trainer(float(settings["step_s"]), float(settings["epoch"]))
        self._sims: dict[int, _Sim] = {}
        self._client: Any = None

    def _handler(self, config: Any) -> Any:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from agent.cli.launcher import build_handler
        from coordinator.core.etcd_client import EtcdClient
        from coordinator.core.settings import RendezvousSettings
        from coordinator.torch_adapter.handler import create_handler

        if not self._shared:
            return build_handler(config)  # its own client, as on a machine of its own
        params = RendezvousParameters(
            backend=config.rdzv_backend,
            endpoint=config.rdzv_endpoint,
            run_id=config.rdzv_id,
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            local_addr=config.local_addr,
            **config.rdzv_conf,
        )
        if self._client is None:
            self._client = EtcdClient(RendezvousSettings.from_parameters(params).etcd_config())
        return create_handler(
            params,
            client=self._client,
            local_world_size=config.nproc_per_node,
            role=config.role,
        )

    def build(self, specs: list[dict[str, Any]]) -> None:
        from agent.loop.agent import Agent
        from benchmarks.fleet.standin import StandInLauncher

        for spec in specs:
            index = int(spec["index"])
            config = _config(spec, self._endpoint, self._log_dir)
            metrics = _FormedTimes()
            launcher = StandInLauncher(
                self._trainer, self._on_start(index, str(spec["run_id"])), self._on_stop(index)
            )
            handler = self._handler(config)
            agent = Agent(
                config,
                handler,
                base_env={**os.environ, "OMP_NUM_THREADS": "1"},
                metrics=metrics,
                launcher=launcher,
            )
            self._sims[index] = _Sim(
                index, str(spec["run_id"]), handler, agent, launcher, metrics.formed
            )

    def _on_start(self, index: int, run_id: str) -> Any:
        from agent.observe.journal import ROUND_ENV

        def started(group: Any) -> None:
            sim = self._sims.get(index)
            env = group.launches[0].env if group.launches else {}
            _emit(
                {
                    "event": "started",
                    "agent": index,
                    "run": run_id,
                    "round": int(env.get(ROUND_ENV, -1)),
                    "rank": int(env.get("GROUP_RANK", -1)),
                    "world": int(env.get("GROUP_WORLD_SIZE", 0)),
                    "formed_s": sim.formed_s[-1] if sim is not None and sim.formed_s else None,
                    "t": group.started_at,
                }
            )

        return started

    @staticmethod
    def _on_stop(index: int) -> Any:
        def stopped(group: Any) -> None:
            _emit({"event": "stopped", "agent": index, "t": group.stopped_at})

        return stopped

    def run(self, at: float) -> None:
        for sim in self._sims.values():
            if sim.thread is None:
                sim.thread = threading.Thread(
                    target=self._run_one, args=(sim, at), name=f"agent-{sim.index}", daemon=True
                )
                sim.thread.start()

    def _run_one(self, sim: _Sim, at: float) -> None:
        delay = at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the common start
        code = -1
        try:
            code = sim.agent.run()
        except Exception:
            log.exception("agent %d: run() raised", sim.index)
        finally:
            try:
                sim.handler.leave()  # as etcdrun's launch() does once the agent returns
            except Exception:
                log.exception("agent %d: could not leave", sim.index)
            sim.done = True
            _emit({"event": "exited", "agent": sim.index, "code": code, "t": time.monotonic()})

    def _group(self, index: int) -> Any:
        sim = self._sims.get(index)
        return None if sim is None else sim.launcher.group

    def fail(self, index: int, code: int) -> None:
        group = self._group(index)
        if group is not None:
            group.exit_worker(0, code)

    def stall(self, index: int) -> None:
        group = self._group(index)
        if group is not None:
            group.stall()

    def finish(self) -> None:
        for sim in self._sims.values():
            sim.launcher.finished = True  # and a group started later ends at once too
            group = sim.launcher.group
            if group is not None and not sim.done:
                group.exit_all(0)

    def release(self) -> None:
        for index in [i for i, sim in self._sims.items() if sim.done]:
            sim = self._sims.pop(index)
            if sim.thread is not None:
                sim.thread.join(timeout=30)
        if not self._sims and self._client is not None:
            # An agent's run() can return while a phase it abandoned still runs (an exit
            # barrier a lost peer ended still retries its add): in etcdrun the process
            # exits, here the shared client must close, or that thread writes on into
            # the next job's windows. (An agent's own client closes when it leaves.)
            self._client.close()
            self._client = None

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "threads": threading.active_count(),
            "agents": sum(1 for sim in self._sims.values() if not sim.done),
        }


def _serve(settings: dict[str, Any]) -> None:
    # The agents' temporary files (progress files, default log folders) go into the run's
    # folder, which the driver removes: a SIGKILLed agent cannot remove its own.
    tempfile.tempdir = str(settings["log_dir"])
    host = Host(settings)
    _emit({"event": "up", "pid": os.getpid(), "t": time.monotonic()})
    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd["cmd"]
        now = time.monotonic()
        if kind == "exit":
            return
        if kind == "build":
            try:
                host.build(list(cmd["agents"]))
            except Exception as exc:
                log.exception("build failed")
                _emit({"event": "fatal", "id": cmd["id"], "error": _describe(exc)})
                return
            _emit({"event": "ready", "id": cmd["id"], "t": time.monotonic()})
        elif kind == "run":
            host.run(float(cmd["at"]))
        elif kind == "fail":
            host.fail(int(cmd["agent"]), int(cmd.get("code", 1)))
            _emit({"event": "done", "id": cmd["id"], "agent": cmd["agent"], "t": now})
        elif kind == "stall":
            host.stall(int(cmd["agent"]))
            _emit({"event": "done", "id": cmd["id"], "agent": cmd["agent"], "t": now})
        elif kind == "finish":
            host.finish()
            _emit({"event": "finished", "id": cmd["id"], "t": now})
        elif kind == "release":
            host.release()
            _emit({"event": "released", "id": cmd["id"], "t": time.monotonic()})
        elif kind == "stats":
            _emit({"event": "stats", "id": cmd["id"], "t": now, **host.stats()})


def main() -> None:
    """Entry point; see the module docstring for the protocol."""
    logging.basicConfig(
        level=os.environ.get("FLEET_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    from agent.health import preflight
    from benchmarks.fleet.standin import StandInCheck

    # The pre-flight check's process imports torch; a thousand of them do not fit on two
    # cores. Its stand-in answers at once; the exchange through etcd is the real one.
    if not hasattr(preflight, "CheckProcess"):
        raise RuntimeError("agent.health.preflight.CheckProcess is gone: update the stand-in")
    setattr(preflight, "CheckProcess", StandInCheck)  # noqa: B010
    _serve(json.loads(sys.stdin.readline()))
    sys.stdout.flush()
    # Agent threads and their clients are not ours to join: the fleet is over.
    os._exit(0)


if __name__ == "__main__":
    main()
