"""The worker's progress API and the file the agent reads it from (etcd_elastic.progress)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from etcd_elastic.progress import PROGRESS_FILE_ENV, ProgressFile

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter per case: the API resolves its slot once per process.
    full = {k: v for k, v in os.environ.items() if k not in (PROGRESS_FILE_ENV, "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**full, **env}, cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_fresh_file_has_no_report(tmp_path: Path) -> None:
    f = ProgressFile(3, str(tmp_path))
    try:
        assert f.read() == [None, None, None]
    finally:
        f.close()
    assert not Path(f.path).exists()
    f.close()  # idempotent


def test_each_worker_writes_its_own_slot_and_reset_forgets(tmp_path: Path) -> None:
    f = ProgressFile(2, str(tmp_path))
    try:
        # os._exit: no exit handler, so the slot keeps what the worker wrote last
        code = "import os; from etcd_elastic import report_progress as r; r(7); r(8); os._exit(0)"
        out = _run(code, {PROGRESS_FILE_ENV: f.path, "LOCAL_RANK": "1"})
        assert out.returncode == 0, out.stderr
        assert out.stderr == ""
        assert f.read() == [None, (8, 2)]  # the last step, and two calls
        f.reset()
        assert f.read() == [None, None]
    finally:
        f.close()


def test_without_the_agent_the_call_does_nothing(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from etcd_elastic import report_progress\n"
        "for i in range(1000): report_progress(i)\n"
        "import etcd_elastic.progress as p\n"
        "assert p._slots is None and p._resolved\n"
        "assert 'torch' not in sys.modules and 'coordinator' not in sys.modules\n"
    )
    out = _run(code, {})
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


@pytest.mark.parametrize(
    ("make", "rank", "why"),
    [
        (lambda d: str(d / "missing"), "0", "No such file or directory"),
        (lambda d: _junk(d), "0", "not a progress file with a slot for LOCAL_RANK 0"),
        (
            lambda d: ProgressFile(1, str(d)).path,
            "1",
            "not a progress file with a slot for LOCAL_RANK 1",
        ),
    ],
    ids=["missing", "foreign", "no-slot"],
)
def test_a_bad_file_is_one_line_and_training_goes_on(
    tmp_path: Path, make: object, rank: str, why: str
) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    code = "from etcd_elastic import report_progress as r; r(1); r(2); print('trained')"
    out = _run(code, {PROGRESS_FILE_ENV: path, "LOCAL_RANK": rank})
    assert out.returncode == 0
    assert out.stdout == "trained\n"
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"etcd_elastic.progress: not reporting progress ({path}: "
    )
    assert why in lines[0]


def _junk(directory: Path) -> str:
    path = directory / "junk"
    path.write_bytes(b"x" * 256)
    return str(path)


def _one_slot(directory: Path) -> str:
    path = directory / "one-slot"
    path.write_bytes((b"EEPROG1\0" + (1).to_bytes(4, "little")).ljust(128, b"\0"))
    return str(path)


def test_a_file_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="a progress file needs at least one slot, got 0"):
        ProgressFile(0)


def test_every_call_counts_whatever_the_step(tmp_path: Path) -> None:
    f = ProgressFile(1, str(tmp_path))
    try:
        code = "import os; from etcd_elastic import report_progress as r; r(0); os._exit(0)"
        assert _run(code, {PROGRESS_FILE_ENV: f.path, "LOCAL_RANK": "0"}).returncode == 0
        assert f.read() == [(0, 1)]
        code = (
            "import os; from etcd_elastic import report_progress as r\n"
            "r(-5); r(-5); r(-5); os._exit(0)"
        )
        assert _run(code, {PROGRESS_FILE_ENV: f.path, "LOCAL_RANK": "0"}).returncode == 0
        assert f.read() == [(-5, 3)]
    finally:
        f.close()


def test_a_paused_worker_is_not_watched_until_it_reports_again(tmp_path: Path) -> None:
    f = ProgressFile(1, str(tmp_path))
    try:
        env = {PROGRESS_FILE_ENV: f.path, "LOCAL_RANK": "0"}
        code = (
            "import os\n"
            "from etcd_elastic import pause_progress as p, report_progress as r\n"
            "r(1); r(2); p(); print('paused', flush=True)\n"
            "r(3); os._exit(0)\n"  # no exit handler: the slot keeps step 3
        )
        assert _run(code, env).stdout == "paused\n"
        assert f.read() == [(3, 3)]  # the count goes on from where it was
        code = "from etcd_elastic import pause_progress as p, report_progress as r; r(1); p()"
        assert _run(code, env).returncode == 0
        assert f.read() == [None]
        code = "from etcd_elastic import report_progress as r; r(9)"  # exits normally
        assert _run(code, env).returncode == 0
        assert f.read() == [None], "the interpreter's exit pauses the worker"
        code = "from etcd_elastic import pause_progress as p; p()"  # before any report
        assert _run(code, {}).returncode == 0
    finally:
        f.close()
