"""The GPU check: real agents and real CUDA workers, on the machine it runs on.

    scripts/gpu_check            # on a machine with GPUs: NCCL, --nproc-per-node=gpu
    scripts/gpu_check --cpu      # the same steps with gloo on CPU: tries the script itself

Starts a one-member etcd, then runs examples/train_ddp.py under etcdrun and prints one
table row per check:

  devices          --nproc-per-node=gpu resolves to torch.cuda.device_count()
  pre-flight       --health-check's device test passes on every local device
  two agents       two agents (the GPUs split between them) train on NCCL to the end
  warm restart     a worker crashes; its replacement starts from the warm pool and uses
                   CUDA after the handover (its report says cuda and warm)
  warm pool idle   no interpreter of the warm pool holds a GPU context (nvidia-smi)
  node loss        one of two agents is SIGKILLed mid-run; the other re-forms and finishes

With one GPU there is one agent where two are asked for (NCCL refuses two ranks on one
device), and the rows that need two say so. Exit code 0 when no row failed. Every
process it starts is stopped when it ends, whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.etcd_server import EtcdCluster  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_ddp.py"
ETCDRUN = Path(sys.executable).parent / "etcdrun"


@dataclass
class Row:
    check: str
    result: str  # passed | FAILED | skipped
    detail: str
    seconds: float = 0.0


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Check:
    """One run of the check: its etcd, its folder, the agents it started."""

    def __init__(self, args: argparse.Namespace, work: Path, endpoint: str) -> None:
        self.cpu = bool(args.cpu)
        self.timeout = float(args.timeout)
        self.work = work
        self.endpoint = endpoint
        self.agents: list[Agent] = []
        self.gpus = 0 if self.cpu else _device_count()

    # -- agents ---------------------------------------------------------------------------

    def start(self, name: str, run_id: str, flags: Sequence[str], script_args: Sequence[str],
              gpus: Sequence[int] | None = None) -> Agent:  # fmt: skip
        env = dict(os.environ)
        env["ETCD_ELASTIC_JOURNAL"] = str(self.work / f"{run_id}.journal.jsonl")
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        nproc = "2" if self.cpu else "gpu"
        log = self.work / f"{run_id}-{name}.log"
        argv = [str(ETCDRUN), f"--nproc-per-node={nproc}", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={run_id}", "--rdzv-conf=lease_ttl=3,last_call_timeout=2",
                *flags, str(EXAMPLE), *script_args]  # fmt: skip
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        agent = Agent(name, proc, log)
        self.agents.append(agent)
        return agent

    def wait(self, agent: Agent, timeout: float | None = None) -> int:
        try:
            return agent.proc.wait(timeout or self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(agent.proc)
            raise

    def stop_all(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for agent in self.agents:
            try:
                agent.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(agent.proc)

    def split(self) -> tuple[list[int], list[int]] | None:
        """Two disjoint halves of the GPUs (None: fewer than two)."""
        if self.cpu:
            return [], []
        if self.gpus < 2:
            return None
        half = self.gpus // 2
        return list(range(half)), list(range(half, self.gpus))

    # -- the checks -----------------------------------------------------------------------

    def devices(self) -> Row:
        if self.cpu:
            return Row("devices", "skipped", "--cpu: no GPU asked for")
        from agent.cli.etcdrun import parse_args

        config = parse_args(["--nproc-per-node=gpu", "--standalone", str(EXAMPLE)], environ={})
        ok = config.nproc_per_node == self.gpus
        return Row("devices", "passed" if ok else "FAILED",
                   f"--nproc-per-node=gpu -> {config.nproc_per_node} workers, "
                   f"torch.cuda.device_count() = {self.gpus}")  # fmt: skip

    def preflight(self) -> Row:
        run = "gpu-check-preflight"
        agent = self.start("a", run, ["--nnodes=1", "--health-check"],
                           ["--epochs=1", "--steps-per-epoch=5"])  # fmt: skip
        code = self.wait(agent)
        checks = [e for e in _journal(self.work / f"{run}.journal.jsonl")
                  if e["event"] == "health_check"]  # fmt: skip
        nodes = [n for e in checks for n in e.get("nodes", [])]
        devices = sorted({str(d) for n in nodes for d in _as_list(n.get("devices"))})
        passed = bool(nodes) and all(n.get("passed") for n in nodes) and code == 0
        want = "cpu" if self.cpu else "cuda"
        passed = passed and any(want in d for d in devices)
        return Row("pre-flight", "passed" if passed else "FAILED",
                   f"exit {code}; devices checked: {', '.join(devices) or 'none'}")  # fmt: skip

    def two_agents_and_warm_restart(self) -> tuple[Row, Row, Row]:
        run = "gpu-check-train"
        report = self.work / f"{run}.report.jsonl"
        ckpt = self.work / f"{run}-ckpt"
        halves = self.split()
        script = [
            "--epochs=3", "--steps-per-epoch=30", f"--report={report}",
            f"--checkpoint-dir={ckpt}", "--fail-once-at-epoch=1", "--fail-rank=0",
        ]  # fmt: skip
        flags = ["--max-restarts=1"]
        if halves is None:
            agents = [self.start("a", run, ["--nnodes=1", *flags], script)]
            what = "one GPU: one agent (NCCL allows one rank per device)"
        else:
            agents = [self.start(name, run, ["--nnodes=2", *flags], script, gpus=half)
                      for name, half in zip("ab", halves, strict=True)]  # fmt: skip
            what = "two agents"
        idle = self._gpu_holders_while(agents, report, self.work / f"{run}.journal.jsonl")
        codes = [self.wait(agent) for agent in agents]
        lines = _journal(report)
        backends = sorted({line["backend"] for line in lines})
        worlds = sorted({line["world_size"] for line in lines})
        ok = codes == [0] * len(agents) and bool(lines)
        want = "gloo" if self.cpu else "nccl"
        ok = ok and backends == [want]
        train = Row("two agents" if halves is not None else "one agent",
                    "passed" if ok else "FAILED",
                    f"{what}; exits {codes}; backend {', '.join(backends)}; world size "
                    f"{worlds}")  # fmt: skip
        restarted = [line for line in lines if line["restart_count"] >= 1]
        warm = [line for line in restarted if line.get("warm")]
        on_device = [line for line in warm if str(line.get("device", "")).startswith(
            "cpu" if self.cpu else "cuda")]  # fmt: skip
        ok = bool(on_device) and codes == [0] * len(agents)
        restart = Row("warm restart", "passed" if ok else "FAILED",
                      f"{len(restarted)} worker(s) restarted, {len(warm)} from the warm pool, "
                      f"{len(on_device)} on {'cpu' if self.cpu else 'cuda'} after the "
                      "handover")  # fmt: skip
        return train, restart, idle

    def _gpu_holders_while(self, agents: list[Agent], report: Path, journal: Path) -> Row:
        """While the workers train, every process holding a GPU context is a worker.

        A worker is what an agent's journal says it started (``workers_started``), read
        after the query: the crash at epoch 1 can hand a warm interpreter over between the
        first report and the query, and that replacement is a worker before it reports.
        """
        if self.cpu:
            return Row("warm pool idle", "skipped", "--cpu")
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return Row("warm pool idle", "skipped", "nvidia-smi not found")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not _journal(report):
            if all(a.proc.poll() is not None for a in agents):
                return Row("warm pool idle", "FAILED", "the agents ended before training")
            time.sleep(0.5)
        time.sleep(2)  # every worker of the first attempt holds its context now
        out = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        holders = {int(p) for p in out.stdout.split() if p.strip().isdigit()}
        workers = {line["pid"] for line in _journal(report)} | {
            pid for e in _journal(journal) if e.get("event") == "workers_started"
            for pid in e.get("pids", [])
        }  # fmt: skip
        ours = {pid for a in agents for pid in _descendants(a.proc.pid)}
        strangers = (holders & ours) - workers
        ok = bool(holders & workers) and not strangers
        return Row("warm pool idle", "passed" if ok else "FAILED",
                   f"GPU contexts held by {len(holders & workers)} worker(s); by other "
                   f"processes of the agents: {sorted(strangers) or 'none'}")  # fmt: skip

    def node_loss(self) -> Row:
        halves = self.split()
        if halves is None:
            return Row("node loss", "skipped", "needs two GPUs (one agent each)")
        run = "gpu-check-loss"
        report = self.work / f"{run}.report.jsonl"
        ckpt = self.work / f"{run}-ckpt"
        script = ["--epochs=4", "--steps-per-epoch=20", "--sleep-per-step=0.1",
                  f"--report={report}", f"--checkpoint-dir={ckpt}"]  # fmt: skip
        a, b = (self.start(name, run, ["--nnodes=1:2"], script, gpus=half)
                for name, half in zip("ab", halves, strict=True))  # fmt: skip
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and len({r["world_size"] for r in _journal(report)
                                                   if r["group_rank"] == 1}) == 0:  # fmt: skip
            time.sleep(0.5)
        time.sleep(3)  # a few steps of the two-node round
        killed_at = time.time()
        _kill_group(b.proc)
        code = self.wait(a)
        after = [r for r in _journal(report) if r["time"] > killed_at]
        alone = sorted({r["world_size"] for r in after})
        ok = code == 0 and bool(after)
        return Row("node loss", "passed" if ok else "FAILED",
                   f"survivor exit {code}; world size after the loss {alone}")  # fmt: skip


def _device_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value] if value else []


def _journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def table(rows: Sequence[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check'.ljust(width)}  result   seconds  detail"]
    lines += [f"{r.check.ljust(width)}  {r.result.ljust(7)}  {r.seconds:7.1f}  {r.detail}"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


@contextlib.contextmanager
def _etcd(work: Path) -> Iterator[str]:
    with EtcdCluster(1, base_dir=work / "etcd") as cluster:
        yield cluster.endpoint_list


def run(args: argparse.Namespace) -> int:
    if not args.cpu and _device_count() == 0:
        print("gpu_check: no CUDA device is visible (torch.cuda.device_count() is 0); run it "
              "on a machine with GPUs, or with --cpu to try the script itself", file=sys.stderr)
        return 2
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, _etcd(Path(tmp)) as endpoint:
        check = Check(args, Path(tmp), endpoint)
        try:
            for step in (check.devices, check.preflight, check.two_agents_and_warm_restart,
                         check.node_loss):  # fmt: skip
                began = time.monotonic()
                try:
                    got = step()
                except Exception as exc:  # a step that breaks is a failed row, not a crash
                    got = Row(step.__name__, "FAILED", f"{type(exc).__name__}: {exc}")
                took = time.monotonic() - began
                added = list(got) if isinstance(got, tuple) else [got]
                for row in added:
                    row.seconds = took
                rows += added
                for line in table(rows).splitlines()[-len(added) :]:
                    print(line, flush=True)
        finally:
            check.stop_all()
            if args.keep_logs:
                dest = Path(args.keep_logs)
                shutil.copytree(tmp, dest, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("etcd"))  # fmt: skip
    print()
    print(table(rows))
    return 1 if any(r.result == "FAILED" for r in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU: try the script itself")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds one training run may take (default 240)")  # fmt: skip
    parser.add_argument("--keep-logs", default=None, metavar="DIR",
                        help="copy the agents' logs, journals and reports to DIR")  # fmt: skip
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
