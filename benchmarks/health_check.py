"""How long the pre-flight check (``etcdrun --health-check``) takes, with real agents.

``python -m benchmarks.health_check --nodes 2 4 --repeats 2`` starts one etcd, then for
each N runs N ``etcdrun --health-check`` agents (one worker each, ``--no-warm-start`` so
that the only torch import during start-up is the check process's own) of a job whose
every worker fails once (``--max-restarts=1``), so each run has two checks:

* round 1: the check process was started when the agent started and may still be
  importing torch when the round forms (a first start);
* the next round (after the failure): its process was started ahead, during round 1's
  check, and has long finished importing (every later round is like this).

It reads each agent's log: ``total`` is the agent's time from the start of the check to
its verdict (this node's check, then waiting for every node's result), ``import_wait``
the part of it spent waiting for this node's check process to finish importing torch,
``check`` the time inside the check process (devices, matmul, pairs). Prints JSON. The
machine's load average is part of the output: on a loaded machine the first-round
numbers are mostly torch's import.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.systems import benchmark_etcd_binary
from coordinator.core.lifeline import spawn
from coordinator.etcd_server import EtcdCluster

__all__ = ["main", "measure"]

_SCRIPT = """\
import os, sys, time
marker = os.path.join(os.environ["HC_BENCH_DIR"], "failed-once-" + os.environ["RANK"])
if not os.path.exists(marker):  # every worker fails once: every node restarts
    open(marker, "w").close()
    time.sleep(25)  # the next round's check process imports meanwhile (slow under load)
    sys.exit(1)
"""
_TOTAL = re.compile(
    r"pre-flight check of round (\d+): \d+ node\(s\) passed in ([\d.]+) s \(([\d.]+) s of it"
)
_CHECK = re.compile(r"pre-flight check: node (\d+) .*, check ([\d.]+) s; passed")


def _agent(
    run_id: str, endpoint: str, n: int, script: Path, log: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-c", "import sys; from agent.cli.etcdrun import main; sys.exit(main())",
        f"--nnodes={n}", "--nproc-per-node=1", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}", "--max-restarts=1", "--no-warm-start", "--health-check",
        "--rdzv-conf=lease_ttl=5", str(script),
    ]  # fmt: skip
    with open(log, "wb") as out:
        # Through the lifeline: the agents die with this process, however it ends.
        return spawn(argv, stdout=out, stderr=subprocess.STDOUT, env=env).process


def measure(endpoint: str, n: int, workdir: Path) -> dict[str, Any]:
    """One job of ``n`` agents; the check's times per round (first, and started ahead)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"hc{n}-", dir=workdir))
    script = run_dir / "job.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "HC_BENCH_DIR": str(run_dir)}
    run_id = f"hc-{uuid.uuid4().hex[:8]}"
    logs = [run_dir / f"agent{i}.log" for i in range(n)]
    procs = [_agent(run_id, endpoint, n, script, log, env) for log in logs]
    try:
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"agents exited {codes}; logs in {run_dir}")
    rounds: dict[str, dict[str, list[float]]] = {}
    for log in logs:
        text = log.read_text(errors="replace")
        totals = [(float(s), float(w)) for _r, s, w in _TOTAL.findall(text)]
        for index, (seconds, waited) in enumerate(totals):
            fields = rounds.setdefault("first" if index == 0 else "ahead", {})
            fields.setdefault("total_s", []).append(seconds)
            fields.setdefault("import_wait_s", []).append(waited)
            fields.setdefault("total_minus_import_wait_s", []).append(seconds - waited)
        checks = [float(s) for _rank, s in _CHECK.findall(text)]
        if len(checks) >= 2 * n:
            rounds["first"].setdefault("check_s", []).extend(checks[:n])
            rounds["ahead"].setdefault("check_s", []).extend(checks[n : 2 * n])
    return rounds


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "n": len(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.health_check")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"load_average_before": os.getloadavg()[0], "results": {}}
    with (
        tempfile.TemporaryDirectory(prefix="hc-bench-") as tmp,
        EtcdCluster(1, binary=benchmark_etcd_binary(), no_fsync=True) as etcd,
    ):
        for n in args.nodes:
            merged: dict[str, dict[str, list[float]]] = {}
            for _ in range(args.repeats):
                for which, fields in measure(etcd.endpoint_list, n, Path(tmp)).items():
                    for name, values in fields.items():
                        merged.setdefault(which, {}).setdefault(name, []).extend(values)
            out["results"][str(n)] = {
                which: {name: _summary(v) for name, v in fields.items()}
                for which, fields in merged.items()
            }
    out["load_average_after"] = os.getloadavg()[0]
    out["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
