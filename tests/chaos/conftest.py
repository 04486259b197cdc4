"""The chaos suite's marker: ``-m chaos`` selects (or ``-m 'not chaos'`` skips) its runs."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos: a seeded fault-injection run on real agents and a real etcd"
    )
