"""When the imports replacing the interpreters a worker start took begin: after a quiet
spell, a few seconds later (the new workers load their checkpoint first); in a burst of
starts, at once (``agent.loop.warmup.refill_defer``, pure)."""

from __future__ import annotations

import pytest

from agent.loop.warmup import refill_defer


@pytest.mark.parametrize(
    ("now", "previous", "defer"),
    [
        pytest.param(100.0, None, 5.0, id="the first start of the agent"),
        pytest.param(100.0, 40.0, 5.0, id="a minute after the last start"),
        pytest.param(100.0, 80.0, 5.0, id="exactly 20 s after: quiet"),
        pytest.param(100.0, 80.1, 0.0, id="just under 20 s after: a burst"),
        pytest.param(100.0, 97.0, 0.0, id="3 s after: a re-formation right after a formation"),
        pytest.param(100.0, 100.0, 0.0, id="at once"),
    ],
)
def test_refill_defer(now: float, previous: float | None, defer: float) -> None:
    assert refill_defer(now, previous) == defer
