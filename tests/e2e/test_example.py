"""The example training end to end: under stock torchrun, under etcdrun --standalone with
a worker crash and a resume, with restarts exhausted, and the demo script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TORCHRUN_ENV = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


def _run(argv: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run a launcher in its own session; on timeout kill that whole session."""
    env = dict(os.environ)
    # mkdtemp() below the test's folder: a leaked etcd data directory would show there.
    env["TMPDIR"] = str(tmp_path)
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy:UserWarning")
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv[0]} did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _report(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _no_etcd_left(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("etcd-elastic-etcd-*")), "embedded etcd data left behind"


def test_example_runs_under_stock_torchrun(tmp_path: Path) -> None:
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.jsonl"
    result = _run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(EXAMPLE),
         "--epochs", "2", "--steps-per-epoch", "5", "--checkpoint-dir", str(ckpt),
         "--report", str(report)],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    lines = _report(report)
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert {r["world_size"] for r in lines} == {2}
    assert "epoch 2/2" in result.stdout


def test_etcdrun_restarts_a_crashed_worker_and_resumes(tmp_path: Path) -> None:
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.jsonl"
    result = _run(
        [str(BIN / "etcdrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         str(EXAMPLE), "--epochs", "3", "--steps-per-epoch", "5", "--checkpoint-dir",
         str(ckpt), "--report", str(report), "--fail-once-at-epoch", "1", "--fail-rank", "1"],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    lines = _report(report)
    attempts = sorted((r["restart_count"], r["rank"], r["start_epoch"]) for r in lines)
    assert attempts == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    for line in lines:
        missing = [name for name in TORCHRUN_ENV if line["env"].get(name) is None]
        assert not missing, f"torchrun variables missing in a worker: {missing}"
        assert line["env"]["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert (ckpt / "failed-once.marker").exists()
    assert "epoch 3/3" in result.stdout
    _no_etcd_left(tmp_path)


def test_etcdrun_fails_with_the_root_cause_when_restarts_run_out(tmp_path: Path) -> None:
    report = tmp_path / "report.jsonl"
    result = _run(
        [str(BIN / "etcdrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         str(EXAMPLE), "--epochs", "2", "--steps-per-epoch", "5", "--always-fail-rank", "1",
         "--report", str(report)],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-4000:]
    assert "rank 1: failing on purpose (--always-fail-rank)" in result.stdout
    assert sorted({r["restart_count"] for r in _report(report)}) == [0, 1]
    _no_etcd_left(tmp_path)


def test_demo_trains_through_a_worker_crash(tmp_path: Path) -> None:
    result = _run([str(ROOT / "scripts" / "demo")], tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "demo: finished; the job survived a worker crash" in result.stdout
    assert "epoch 4/4" in result.stdout
    _no_etcd_left(tmp_path)


def test_sigterm_stops_workers_and_removes_the_implicit_standalone_etcd(tmp_path: Path) -> None:
    """No --rdzv-endpoint on one node means --standalone, as torchrun; SIGTERM ends it all."""
    report = tmp_path / "report.jsonl"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [str(BIN / "etcdrun"), "--nproc-per-node=2", str(EXAMPLE), "--epochs", "1000",
         "--sleep-per-step", "0.1", "--report", str(report)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        started = 0
        for line in proc.stdout:  # ends at EOF if etcdrun dies early; the asserts say so
            seen.append(line)
            started += "attempt 0: rank" in line
            if started == 2:
                break
        assert started == 2, "".join(seen)[-4000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (("".join(seen)) + out)[-4000:]
    for record in _report(report):
        with pytest.raises(ProcessLookupError):
            os.kill(record["pid"], 0)
    _no_etcd_left(tmp_path)
