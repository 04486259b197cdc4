"""remove_orphaned_containers beside other test processes cleaning up at the same moment.

The docker engine is replaced by a stand-in client: what is pinned here is how the
clean-up reads docker's answers, not docker. tests/compose/test_etcd_containers.py runs it
against the real engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests import etcd_containers


class _ApiError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"{status_code} Client Error")
        self.status_code = status_code


@dataclass
class _Container:
    id: str
    owner: str
    answer: int | None = None  # the status docker answers the removal with; None: removed
    removals: int = 0

    @property
    def labels(self) -> dict[str, str]:
        return {"org.etcd-elastic.kind": "test-etcd", "org.etcd-elastic.owner-pid": self.owner}

    def remove(self, *, force: bool, v: bool) -> None:
        assert force and v
        self.removals += 1
        if self.answer is not None:
            raise _ApiError(self.answer)


@dataclass
class _Client:
    listed: list[_Container]
    closed: bool = False
    containers: _Client = field(init=False)

    def __post_init__(self) -> None:
        self.containers = self

    def list(self, *, all: bool, filters: dict[str, str]) -> list[_Container]:
        assert all and filters == {"label": "org.etcd-elastic.kind"}
        return self.listed

    def close(self) -> None:
        self.closed = True


def _run(monkeypatch: pytest.MonkeyPatch, *containers: _Container) -> tuple[list[str], _Client]:
    client = _Client(list(containers))
    monkeypatch.setattr(etcd_containers, "_docker_client", lambda: client)
    monkeypatch.setattr(etcd_containers, "_alive", lambda pid: pid == 1)
    return etcd_containers.remove_orphaned_containers(), client


def test_an_orphan_gone_or_being_removed_by_another_process_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = _Container("gone", owner="7", answer=404)
    in_progress = _Container("in-progress", owner="8", answer=409)
    orphan = _Container("orphan", owner="9")
    live = _Container("live", owner="1")
    removed, client = _run(monkeypatch, gone, in_progress, orphan, live)
    assert removed == ["orphan"]
    assert (gone.removals, in_progress.removals, orphan.removals, live.removals) == (1, 1, 1, 0)
    assert client.closed


def test_any_other_refusal_still_fails_the_clean_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(_ApiError, match="500 Client Error"):
        _run(monkeypatch, _Container("broken", owner="", answer=500))
