"""A bad ``LOGLEVEL`` is one line and exit code 2, in both programs, before anything
starts (it was a traceback from inside ``logging.basicConfig``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from coordinator.core.log_level import log_level


@pytest.mark.parametrize(
    ("text", "level"),
    [(None, logging.INFO), ("", logging.INFO), ("debug", logging.DEBUG), (" Warning ", 30),
     ("warn", logging.WARNING), ("15", 15)],
)  # fmt: skip
def test_names_any_case_and_numbers_are_levels(text: str | None, level: int) -> None:
    assert log_level(text, "INFO") == level


@pytest.mark.parametrize("text", ["loud", "Level 5", "-1", "NOTSET2", "INFO,DEBUG"])
def test_anything_else_names_the_variable_and_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError) as info:
        log_level(text, "INFO")
    assert str(info.value) == (
        f"LOGLEVEL={text!r} is not a log level: use one of DEBUG, INFO, WARNING, ERROR, "
        "CRITICAL (or a number), or unset it"
    )


@pytest.mark.parametrize(
    ("program", "args"),
    [("agent", ["--standalone", "--nproc-per-node=1", "train.py"]),
     ("coordinator.rdzvctl", ["list", "--endpoints", "127.0.0.1:1"])],
)  # fmt: skip
def test_a_bad_loglevel_ends_the_program_with_one_line(program: str, args: list[str]) -> None:
    env = {**os.environ, "LOGLEVEL": "loud"}
    done = subprocess.run(
        [sys.executable, "-m", program, *args], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    name = "etcdrun" if program == "agent" else "rdzvctl"
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"{name}: error: LOGLEVEL='loud' is not a log level: use one of DEBUG, INFO, "
        "WARNING, ERROR, CRITICAL (or a number), or unset it"
    ]
