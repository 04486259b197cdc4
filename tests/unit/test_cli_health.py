"""``etcdrun``'s pre-flight check flags: defaults, values, and the one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.cli import etcdrun as cli
from agent.cli.etcdrun import main, parse_args
from agent.config import LaunchConfig


@pytest.fixture(autouse=True)
def _in_tmp_with_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> LaunchConfig:
    return parse_args(
        ["--nnodes=2:3", "--rdzv-id=job", "--rdzv-endpoint=h:2379", *argv, "train.py"],
        device_count=lambda: 0, cpu_count=lambda: 4, environ=environ or {},
    )  # fmt: skip


def test_off_by_default_and_defaults_when_on() -> None:
    off = _parse([])
    assert (off.health_check, off.health_check_timeout, off.quarantine_seconds) == (
        False, 30.0, 300.0,
    )  # fmt: skip
    on = _parse(["--health-check"])
    assert (on.health_check, on.health_check_timeout, on.quarantine_seconds) == (True, 30.0, 300.0)
    given = _parse(["--health_check", "--health-check-timeout=12.5", "--quarantine_seconds=60"])
    assert (given.health_check_timeout, given.quarantine_seconds) == (12.5, 60.0)
    env = _parse([], {"PET_HEALTH_CHECK": "1", "PET_QUARANTINE_SECONDS": "90"})
    assert (env.health_check, env.quarantine_seconds) == (True, 90.0)


MISUSE = [
    (["--health-check-timeout=10"],
     "--health-check-timeout: has no effect without --health-check; add --health-check"),
    (["--quarantine-seconds=10"],
     "--quarantine-seconds: has no effect without --health-check; add --health-check"),
    (["--health-check", "--health-check-timeout=0"],
     "--health-check-timeout: '0' is out of range; give a number of seconds above 0"),
    (["--health-check", "--health-check-timeout=soon"],
     "--health-check-timeout: 'soon' is not a number; give a number of seconds above 0"),
    (["--health-check", "--quarantine-seconds=-5"],
     "--quarantine-seconds: '-5' is out of range; give a number of seconds above 0"),
    (["--health-check", "--quarantine-seconds=inf"],
     "--quarantine-seconds: 'inf' is out of range; give a number of seconds above 0"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), MISUSE, ids=[" ".join(a) for a, _ in MISUSE])
def test_bad_values_are_one_line_and_exit_code_2(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[LaunchConfig] = []
    monkeypatch.setattr(cli, "_launch", started.append)
    with pytest.raises(SystemExit) as info:
        main(["--nnodes=2", "--rdzv-id=job", "--rdzv-endpoint=h:2379", *argv, "train.py"])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"etcdrun: error: {message}\n"
    assert started == []


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "pre-flight check (docs/health-check.md):" in out
    for flag in (
        "--health-check ",
        "--health-check-timeout SECONDS",
        "--quarantine-seconds SECONDS",
    ):
        assert flag in out
