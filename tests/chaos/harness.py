"""One chaos run: real agents on a real 3-member etcd, a seeded plan of faults, a verdict.

``python -m tests.chaos.harness --seed S --faults N [--agents K] [--out DIR]`` (or
``scripts/chaos``) starts a 3-member etcd on loopback, one set of fault proxies and one
``etcdrun`` per agent slot (``--nproc-per-node=2``, ``tests/chaos/worker.py``), with
``ETCD_ELASTIC_JOURNAL`` pointing every agent and worker at one history file; waits for
the job to train; runs the planned faults one by one (each bounded, see
``tests/chaos/faults.py``); then stops and reaps everything (also on an error or Ctrl-C)
and checks the history (``tests/chaos/checker.py``). It prints faults and recovery per
kind, and the violations; the exit code is 0 only when there are none.

Bounded: the plan has N faults; a time budget stops injecting (the run then fails
``run_complete``); each wait has its own timeout; the workers stop by themselves at a
deadline past the budget should the harness die. Everything listens on 127.0.0.1. A
run's folder (history, plan, agent and etcd logs) is kept when the run fails or when
``--out`` names it, and removed otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from agent.observe.journal import JOURNAL_ENV, JournalWriter, read_journal
from coordinator.etcd_server import EtcdCluster
from tests.chaos.checker import Violation, check, format_violations
from tests.chaos.etcd_log import EtcdLog, fenced_commits, read_etcd_log
from tests.chaos.etcd_ops import (
    TRAINER,
    EtcdOps,
    HarnessError,
    chaos_etcd_binary,
    etcdctl_binary,
)
from tests.chaos.faults import FaultRunner, Timing
from tests.chaos.fleet import PRELOAD, Fleet, FleetConfig
from tests.chaos.opening import OPENINGS, coordinator_freeze
from tests.chaos.report import KindRow, format_table, summarize
from tests.chaos.scheduler import ALL_KINDS, NEEDS_AUTH, plan
from tests.chaos.tail import HistoryTail

__all__ = ["ChaosConfig", "ChaosResult", "main", "run_chaos"]

KEY_PREFIX = "/etcd-elastic"  # the agents' default key_prefix (docs/keys.md)


@dataclass(frozen=True)
class ChaosConfig:
    """One run's parameters."""

    seed: int
    faults: int
    agents: int = 3
    nproc: int = 2
    lease_ttl: int = 3
    step_s: float = 0.2
    kinds: tuple[str, ...] = ALL_KINDS
    out_dir: Path | None = None
    budget_s: float = 900.0  # no fault starts after this; teardown follows
    start_timeout_s: float = 180.0  # first formation: every agent and worker imports torch
    settle_timeout_s: float = 45.0
    max_failed_settles: int = 3  # in a row: the job does not recover, stop the plan
    breakage: str = ""  # a deliberately broken agent (tests/chaos/breakage), to be caught
    opening: str = ""  # a fault at the first formation (tests/chaos/opening.py)
    min_nodes_override: int = 0  # 0: one fewer than the agents

    @property
    def min_nodes(self) -> int:
        return self.min_nodes_override or max(1, self.agents - 1)

    @property
    def max_nodes(self) -> int:
        return self.agents + 1  # room for a newcomer


@dataclass
class ChaosResult:
    """What a run found."""

    violations: list[Violation]
    rows: list[KindRow]
    out_dir: Path
    history: Path
    planned: int
    executed: int
    seconds: float
    leftovers: list[int] = field(default_factory=list)
    kept: bool = True  # the run's folder is still there

    def summary(self) -> str:
        where = f"history {self.history}" if self.kept else "run folder removed (no violation)"
        return (
            f"chaos run: {self.executed} of {self.planned} faults in {self.seconds:.0f} s; "
            f"{where}\n{format_table(self.rows)}\n{format_violations(self.violations)}"
        )


def run_chaos(cfg: ChaosConfig) -> ChaosResult:
    """Run the job through the planned faults and check its history (see module doc)."""
    started = time.monotonic()
    own_dir = cfg.out_dir is None
    out = cfg.out_dir or Path(tempfile.mkdtemp(prefix=f"chaos-{cfg.seed}-"))
    out.mkdir(parents=True, exist_ok=True)
    history_path = out / "history.jsonl"
    history_path.unlink(missing_ok=True)
    faults = plan(cfg.seed, cfg.faults, cfg.kinds, n_agents=cfg.agents, lease_ttl=cfg.lease_ttl)
    (out / "plan.json").write_text(json.dumps([f.to_json() for f in faults], indent=1))
    run_id = f"chaos-{cfg.seed}-{uuid.uuid4().hex[:8]}"
    history = JournalWriter(str(history_path), "harness")
    tail = HistoryTail(history_path)
    cluster = EtcdCluster(
        3, binary=chaos_etcd_binary(), base_dir=out / "etcd", no_fsync=True, stop_grace=1.0
    )
    deadline = started + cfg.budget_s
    stall_dir = out / "stall"
    stall_dir.mkdir(exist_ok=True)
    password_file = _password_file(out) if NEEDS_AUTH & {f.kind for f in faults} else None
    fleet = Fleet(
        FleetConfig(
            run_id=run_id,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            nproc=cfg.nproc,
            lease_ttl=cfg.lease_ttl,
            out_dir=out,
            env={
                JOURNAL_ENV: str(history_path),
                "CHAOS_STEP_SECONDS": str(cfg.step_s),
                "CHAOS_CHECKPOINT_DIR": str(out / "checkpoint"),
                # Should the harness die, the workers stop by themselves well after the
                # run would have ended (the reaper kills them long before).
                "CHAOS_DEADLINE_MONO": str(deadline + cfg.start_timeout_s + 600),
                "TMPDIR": str(out),
                "CHAOS_STALL_DIR": str(stall_dir),
                **_python_path(cfg.breakage),
            },
            user=TRAINER if password_file else "",
            password_file=str(password_file or ""),
        ),
        cluster,
        history,
        tail,
    )
    etcd_ops = EtcdOps(cluster, history)
    runner = FaultRunner(
        fleet,
        etcd_ops,
        tail,
        history,
        Timing(lease_ttl=cfg.lease_ttl, settle_timeout_s=cfg.settle_timeout_s),
        agents=cfg.agents,
        nproc=cfg.nproc,
        min_nodes=cfg.min_nodes,
        state_key=f"{KEY_PREFIX}/{run_id}/state",
        stall_dir=stall_dir,
    )
    executed, aborted, leftovers = 0, "", []
    run_prefix = f"{KEY_PREFIX}/{run_id}"
    etcd_log_path = out / "etcd.jsonl"
    etcd_log: EtcdLog | None = None
    try:
        cluster.start()
        if password_file is not None:
            etcd_ops.enable_auth(f"{KEY_PREFIX}/", password_file.read_text())
        etcdctl = etcdctl_binary(cluster.binary)
        etcd_log = EtcdLog(
            etcdctl, cluster.endpoint_list, f"{run_prefix}/", etcd_log_path, user=etcd_ops.root
        )
        etcd_log.__enter__()
        history.record(
            "run_start",
            run=run_id,
            seed=cfg.seed,
            faults=cfg.faults,
            agents=cfg.agents,
            nproc=cfg.nproc,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            lease_ttl=cfg.lease_ttl,
            step_s=cfg.step_s,
            endpoints=cluster.endpoints,
            etcd=str(cluster.binary),
        )
        if cfg.opening == "coordinator_freeze":
            coordinator_freeze(
                fleet, history, etcdctl, run_prefix, cfg.lease_ttl, cfg.agents, user=etcd_ops.root
            )
        else:
            for _ in range(cfg.agents):
                fleet.start(fleet.add_slot())
        if not runner.settle(-1, since=None, timeout=cfg.start_timeout_s):
            aborted = "the job never trained with every agent"
        failed = 0
        for fault in faults if not aborted else []:
            if time.monotonic() > deadline:
                aborted = f"time budget of {cfg.budget_s:g} s spent"
                break
            failed = 0 if runner.run(fault) else failed + 1
            executed += 1
            if failed >= cfg.max_failed_settles:
                aborted = f"the job did not settle after {failed} faults in a row"
                break
    except HarnessError as exc:
        history.record("harness_error", index=-1, what=str(exc))
        aborted = str(exc)
    finally:
        history.record("teardown_start")
        try:
            leftovers = fleet.close()
        finally:
            if etcd_log is not None:
                etcd_log.__exit__(None, None, None)
            cluster.stop()
            survivors = fleet.reaper.leftovers()
            if survivors:
                # The reaper's own sweep missed them: a bug of the harness, loudly.
                history.record("harness_error", index=-1, what=f"pids {survivors} outlived the run")
                fleet.reaper.reap()
            history.record("run_end", planned=len(faults), executed=executed, aborted=aborted)
            history.close()
    events = read_journal(history_path)
    result = ChaosResult(
        violations=[
            *check(events),
            *fenced_commits(read_etcd_log(etcd_log_path), run_prefix),
        ],
        rows=summarize(events),
        out_dir=out,
        history=history_path,
        planned=len(faults),
        executed=executed,
        seconds=time.monotonic() - started,
        leftovers=leftovers,
    )
    if own_dir and not result.violations:
        shutil.rmtree(out, ignore_errors=True)
        result.kept = False
    return result


def _password_file(out: Path) -> Path:
    """A new password for the agents' etcd user, in a file only this user may read (the
    agents take it as ``password_file``, never on a command line)."""
    path = out / "etcd-password"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(16))
    return path


BREAKAGES = ("lease_timer", "blind_waits", "no_fencing", "orphans")
_BREAKAGE_DIR = Path(__file__).with_name("breakage")


def _python_path(breakage: str) -> dict[str, str]:
    """The agents' PYTHONPATH (chaos_stall, for their warm interpreters), and what puts
    the broken variant ``breakage`` into them (none for "")."""
    dirs = [str(_BREAKAGE_DIR)] if breakage else []
    dirs += [str(PRELOAD), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in dirs if p)}
    if breakage:
        env["ETCD_ELASTIC_CHAOS_BREAK"] = breakage
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/chaos", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--faults", type=int, required=True)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="keep the run's files here")
    parser.add_argument("--ttl", type=int, default=3, help="lease_ttl of the agents, seconds")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds of faults at most")
    parser.add_argument(
        "--kinds", default=",".join(ALL_KINDS), help="comma-separated fault kinds to draw from"
    )
    parser.add_argument(
        "--opening", choices=OPENINGS, default="", help="a fault at the first formation"
    )
    parser.add_argument(
        "--min-nodes", type=int, default=0, help="min_nodes of the agents (default: agents - 1)"
    )
    parser.add_argument(
        "--break",
        dest="breakage",
        choices=BREAKAGES,
        default="",
        help="run a deliberately broken agent (tests/chaos/breakage): the run must fail",
    )
    return parser


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one chaos run from the command line; 0 only with zero violations."""
    args = _parser().parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        plan(args.seed, args.faults, kinds, n_agents=args.agents, lease_ttl=args.ttl)
    except ValueError as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2
    cfg = ChaosConfig(
        seed=args.seed,
        faults=args.faults,
        agents=args.agents,
        lease_ttl=args.ttl,
        kinds=kinds,
        out_dir=args.out,
        budget_s=args.budget,
        breakage=args.breakage,
        opening=args.opening,
        min_nodes_override=args.min_nodes,
    )
    # SIGTERM (a CI job cancelled, `timeout`) unwinds like Ctrl-C, so run_chaos's
    # finally still reaps every agent, worker and etcd member it started.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run_chaos(cfg)
    except KeyboardInterrupt:
        print("chaos: interrupted; every process of the run was stopped", file=sys.stderr)
        return 130
    print(result.summary())
    if result.violations:
        print(f"chaos: FAILED; history kept in {result.history}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
