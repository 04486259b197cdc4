"""Fixtures of the compose tests: a fresh stack per test, always downed with its volumes.

The tests skip when docker, compose or the images are missing, unless
``ETCD_ELASTIC_COMPOSE_REQUIRED=1`` (set by scripts/compose_test): then that is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.compose.stack import ComposeStack, missing_requirement, remove_stale_projects


@pytest.fixture(scope="session")
def compose_ready() -> None:
    """Docker answers, compose and both images are there; stale test stacks are gone."""
    reason = missing_requirement()
    if reason is not None:
        if os.environ.get("ETCD_ELASTIC_COMPOSE_REQUIRED") == "1":
            pytest.fail(f"compose tests cannot run: {reason}")
        pytest.skip(f"{reason}; scripts/compose_test builds and runs everything")
    remove_stale_projects()


@pytest.fixture
def make_stack(
    compose_ready: None, tmp_path: Path
) -> Iterator[Callable[[dict[str, str]], ComposeStack]]:
    """Returns ``make(settings)``; every stack it made is downed (``down -v``) at teardown,
    after its containers' logs were saved (printed on failure)."""
    stacks: list[ComposeStack] = []

    def make(settings: dict[str, str]) -> ComposeStack:
        stack = ComposeStack(settings, tmp_path)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        try:
            path = stack.save_logs()
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-200:])
            print(f"container logs of {stack.project} ({path}), last lines:\n{tail}")
        finally:
            stack.down()
