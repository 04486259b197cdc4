"""The recovery scenario: from a failure to the first step of the next attempt, real torch.

``python -m benchmarks recovery [--cases a,b,c] [--runs N] [--checkpoint-mb M] --json``

Each job runs ``benchmarks/recovery_worker.py`` (imports torch, ``init_process_group``
with gloo, loads a checkpoint, one all_reduce per step) under real agents on this
machine: ours (``etcdrun``, etcd v3, warm restarts and the agent-hosted bootstrap store
at their defaults) and ``torchrun`` with its c10d backend, on the same script, in the
same invocation, runs interleaved (ours, torchrun, ours, ...). Cases:

    a  a worker crash (global rank 1 exits 1), 1 node x 2 workers
    b  a worker crash, 2 nodes x 2 workers
    c  node loss: the agent holding global rank 0 and every process under it SIGKILLed
       at once, 3 nodes x 2 workers (the job may shrink to 2 nodes), lease_ttl 5 s

Each run is a fresh job: agents start, the first attempt completes a step, the job's
processes go quiet (imports over, ours' warm pool refilled), then the failure; the run
ends at the next attempt's first completed step or at its bound. The breakdown is in
:mod:`benchmarks.recovery_breakdown`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.observe.journal import read_journal
from benchmarks.procs import RunError
from benchmarks.recovery_breakdown import (
    Breakdown,
    breakdown,
    check_target,
    median_breakdown,
)
from benchmarks.recovery_job import Job, JobSpec
from benchmarks.recovery_report import markdown
from benchmarks.runner import environment
from benchmarks.stats import ratio, summarize
from benchmarks.systems import System, make_system
from coordinator.etcd_server import free_port

__all__ = ["CASES", "Case", "recovery"]

SYSTEMS = ("etcd-v3", "c10d")
_WARM_POOL = 2  # etcdrun's default --warm-pool-size
NAMES = {"etcd-v3": "ours (etcdrun)", "c10d": "torchrun c10d"}


@dataclass(frozen=True)
class Case:
    """One failure to recover from."""

    key: str
    title: str
    nnodes: int
    nproc: int
    min_nodes: int
    node_loss: bool


CASES = {
    "a": Case("a", "worker crash, 1 node x 2 workers", 1, 2, 1, False),
    "b": Case("b", "worker crash, 2 nodes x 2 workers", 2, 2, 2, False),
    "c": Case("c", "node loss (agent SIGKILLed), 3 nodes x 2 workers", 3, 2, 2, True),
}


def _checkpoint(folder: Path, megabytes: float) -> Path:
    import torch

    path = folder / "checkpoint.pt"
    floats = max(1, int(megabytes * 1024 * 1024 / 4))
    torch.save({"weights": torch.zeros(floats), "step": torch.tensor(0)}, path)
    return path


def _one_run(
    system: System, case: Case, checkpoint: Path, lease_ttl: int, timeout: float
) -> tuple[Breakdown, bool]:
    """One fresh job: the breakdown, and whether the job was quiet before the failure."""
    out = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    # torchrun's agents host their store but for node loss (see JobSpec.argv).
    external = system.name == "etcd-v3" or case.node_loss
    spec = JobSpec(
        system=system.name,
        endpoint=system.endpoint() if external else f"127.0.0.1:{free_port()}",
        external_store=external,
        run_id=f"bench-rec-{uuid.uuid4().hex[:8]}",
        nnodes=case.nnodes,
        nproc=case.nproc,
        min_nodes=case.min_nodes,
        lease_ttl=lease_ttl,
    )
    world = case.nnodes * case.nproc
    job = Job(spec, out, checkpoint, {"RECOVERY_CRASH_RANK": "1"})
    try:
        start_deadline = time.monotonic() + 120.0
        first = job.wait_step(0.0, world, start_deadline, "the first attempt")
        # Ours keeps --warm-pool-size (2) interpreters per local worker: the failure
        # comes once they are all imported, as minutes into a real job.
        idle = case.nnodes * case.nproc * _WARM_POOL if system.name == "etcd-v3" else 0
        settled = job.settle(start_deadline + 60.0, idle)
        if case.node_loss:
            t_fail = job.kill_node_of(first[0].pid)
            world -= case.nproc
        else:
            t_fail = job.crash_worker(time.monotonic() + 30.0)
        try:
            recovered = job.wait_step(t_fail, world, t_fail + timeout, "the next attempt")
        except RunError as exc:
            raise RunError(f"did not recover within {timeout:g} s: {exc}") from None
        events = read_journal(job.history) if spec.system == "etcd-v3" else []
        before = [w for w in job.workers() if w.times["start"] < t_fail]
        return breakdown(t_fail, recovered, events, before), settled
    except RunError as exc:
        raise RunError(f"{exc}\n{job.log_tail()}") from None
    finally:
        job.stop()
        shutil.rmtree(out, ignore_errors=True)


def _system_entry(
    name: str, got: list[tuple[Breakdown, bool]], errors: list[str]
) -> dict[str, Any]:
    runs = [run for run, _ in got]
    entry: dict[str, Any] = {
        "name": NAMES[name],
        **summarize([r.total for r in runs]),
        "samples": [round(r.total, 4) for r in runs],
        "breakdown": {k: round(v, 4) for k, v in median_breakdown(runs).items()},
        "runs": [
            {
                "total": round(r.total, 4),
                "components": {k: round(v, 4) for k, v in r.components.items()},
                "restarts": r.restarts,
                "world": r.world,
                "quiet_before_failure": settled,
            }
            for r, settled in got
        ],
        "restarts": [r.restarts for r in runs],
        "errors": errors,
    }
    return entry


def _run_case(
    case: Case,
    systems: dict[str, System],
    runs: int,
    checkpoint: Path,
    lease_ttl: int,
    timeout: float,
) -> dict[str, Any]:
    got: dict[str, list[tuple[Breakdown, bool]]] = {name: [] for name in systems}
    errors: dict[str, list[str]] = {name: [] for name in systems}
    for index in range(runs):
        for name, system in systems.items():
            # A system that failed once is not run again in this case: the same failure
            # would cost the same bound again.
            if errors[name]:
                continue
            try:
                got[name].append(_one_run(system, case, checkpoint, lease_ttl, timeout))
            except RunError as exc:
                errors[name].append(f"run {index + 1}: {exc}")
    entries = {name: _system_entry(name, got[name], errors[name]) for name in systems}
    base = entries.get("c10d", {}).get("median")
    for entry in entries.values():
        entry["ratio_vs_torch_c10d"] = ratio(base, entry["median"])
    ours = entries.get("etcd-v3", {}).get("median")
    return {
        "title": case.title,
        "nnodes": case.nnodes,
        "nproc_per_node": case.nproc,
        "failure": "node loss" if case.node_loss else "worker crash",
        "systems": entries,
        "target": check_target(case.key, ours, base, lease_ttl),
    }


def parse_cases(text: str) -> list[str]:
    """``a,b,c`` (any subset, in that order) as a list.

    Raises:
        argparse.ArgumentTypeError: an unknown case or none.
    """
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"--cases {text!r}: use a comma-separated subset of {','.join(CASES)}"
        )
    return [k for k in CASES if k in keys]


def recovery(args: argparse.Namespace) -> dict[str, Any]:
    """Run every selected case for ours and torchrun; see the module docstring."""
    cases = args.cases or (["a"] if args.smoke else list(CASES))
    megabytes = args.checkpoint_mb or (1.0 if args.smoke else 100.0)
    timeout = args.timeout
    names = [n for n in args.systems if n in SYSTEMS]
    folder = Path(tempfile.mkdtemp(prefix="bench-recovery-ckpt-"))
    systems: dict[str, System] = {}
    try:
        checkpoint = _checkpoint(folder, megabytes)
        for name in names:
            system = make_system(name, lease_ttl=args.lease_ttl)
            system.start()
            systems[name] = system
        results = {
            key: _run_case(CASES[key], systems, args.repeat, checkpoint, args.lease_ttl, timeout)
            for key in cases
        }
    finally:
        for system in systems.values():
            system.stop()
        shutil.rmtree(folder, ignore_errors=True)
    method = (
        "Real agents on this machine run benchmarks/recovery_worker.py (import torch, "
        "init_process_group(gloo), torch.load of the checkpoint, one all_reduce per step "
        "every 0.1 s). Each run is a fresh job; the failure comes once the first attempt "
        "completed a step and the job's processes went quiet. Time: from the failure "
        "(the crashing worker's stamp before os._exit, or the harness's clock before "
        "the SIGKILL of the node's agent and every process under it) to the last worker "
        "of the next attempt completing its first all_reduce. Breakdown: each milestone "
        "is when the last node or worker reached it (detect: every surviving agent has "
        "stopped its old workers, from the agents' run history; rendezvous: every "
        "agent's round formed; then the workers' own stamps), so the components add up "
        "to the total; torchrun keeps no history, so its first three are one. "
        "torchrun: --rdzv-backend=c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (with "
        "torch's default the workers reuse the agent's store, and a restart's gloo init "
        "reads the dead attempt's addresses and fails until the restarts run out); its "
        "TCPStore hosted by its first agent, as torchrun does, except for node loss, "
        "where the harness hosts it (is_host=false) so that losing the store's host "
        "leaves torchrun a rendezvous. Both: "
        "--max-restarts=3, every other setting at its default. Runs interleaved "
        f"(ours, torchrun, ours, ...), each bounded by {timeout:g} s after the failure."
    )
    return {
        "scenario": "recovery",
        "point": f"cases {','.join(cases)}, checkpoint {megabytes:g} MB",
        "unit": "seconds",
        "method": method,
        "environment": environment(),
        "lease_ttl": args.lease_ttl,
        "checkpoint_mb": megabytes,
        "cases": results,
    }


def print_human(result: dict[str, Any]) -> None:
    """The result as the Markdown table of docs/performance.md."""
    print(f"recovery: {result['point']} (load average {result['environment']['load_average_1m']})")
    print(markdown(result))
