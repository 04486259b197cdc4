"""A background thread that dies is never a silent freeze (issue 8 item 4, DESIGN §9).

Two nodes form a round on real etcd; then the watch thread of one node's etcd client
dies (an exception injected into its handling of the next response). That node must
leave at once (its key goes, so the other sees it), report a membership change through
``num_nodes_waiting()`` and its listener, and both must form the next round again with
fresh watches, a fresh duty and a fresh lease.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from coordinator.core.errors import LeaseLostError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration


def test_a_dead_watch_thread_makes_the_node_rejoin(
    etcd1: EtcdCluster,
    run_id: str,
    handlers: list[EtcdRendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handlers += [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    first = Joins(handlers).start().infos()
    assert sorted(info.rank for info in first.values()) == [0, 1]
    victim, other = handlers
    round1 = victim.last_round
    changed = threading.Event()
    victim.subscribe(changed.set)
    old_key = victim._current()
    assert old_key is not None
    old_revision = old_key.member.current()

    client: EtcdClient = victim._etcd()

    def broken(*_args: object) -> None:
        raise RuntimeError("injected into the watch thread")

    monkeypatch.setattr(client._watcher, "_handle", broken)
    # Any event on a watched key makes the thread handle a response, and die: the state
    # key, which every node watches, written again with the same value.
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as poker:
        kv, _ = poker.get(victim._keys.state)
        assert kv is not None
        poker.put(victim._keys.state, kv.value)
    assert changed.wait(30), "the node did not report the death"
    wait_until(lambda: victim.num_nodes_waiting() >= 1, 30, "the victim to ask for a rejoin")
    # It left: the other node sees a participant lost and re-rendezvouses too.
    wait_until(lambda: other.num_nodes_waiting() >= 1, 30, "the other node to see it go")
    monkeypatch.undo()

    second = Joins(handlers).start().infos()
    assert sorted(info.rank for info in second.values()) == [0, 1]
    assert victim.last_round == other.last_round == round1 + 1
    fresh = victim._current()
    assert fresh is not None and fresh is not old_key
    new_revision = fresh.member.current()
    assert old_revision is not None and new_revision is not None
    assert new_revision.create_revision > old_revision.create_revision  # a new key


def _lone_joiner(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> tuple[EtcdRendezvousHandler, EtcdRendezvousHandler, Joins]:
    """Two nodes of a min_nodes=2 run; the first is joining alone (waiting for its round)."""
    first, second = make_handler(etcd1, run_id, 2, 2), make_handler(etcd1, run_id, 2, 2)
    handlers += [first, second]
    waiting = Joins([first]).start()
    wait_until(lambda: first._current() is not None, 30, "the first node to start joining")
    return first, second, waiting


def _rewrite_key(poker: EtcdClient, key: str) -> None:
    """Write ``key`` again as it is: an event its watchers handle. Any response the dying
    thread handles kills it: if one came first (the node's own writes), the node has
    left already and revoked the lease this put would use."""
    kv, _ = poker.get(key)
    if kv is not None:
        with contextlib.suppress(LeaseLostError):
            poker.put(key, kv.value, lease=kv.lease)


def _both_join(first_joins: Joins, second: EtcdRendezvousHandler) -> tuple[int, int]:
    infos = Joins([second]).start().infos(60)
    joined = first_joins.infos(60)
    return infos[0].rank, joined[0].rank


def test_a_thread_death_during_a_join_starts_the_join_over(
    etcd1: EtcdCluster,
    run_id: str,
    handlers: list[EtcdRendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worst moment: a node is waiting for its round (min_nodes=2, alone so far) when
    # its watch thread dies. Its join must start over on a fresh participation, not hang
    # on the closed view until join_timeout.
    first, second, waiting = _lone_joiner(etcd1, run_id, handlers)
    old = first._current()
    client: EtcdClient = first._etcd()

    def broken(*_args: object) -> None:
        monkeypatch.undo()  # one death, as a real fault: the threads after it work
        raise RuntimeError("injected into the watch thread")

    monkeypatch.setattr(client._watcher, "_handle", broken)
    # An event the lone node (its own coordinator) watches: its key, written again as is.
    key = first._keys.node(first.node_id)
    wait_until(lambda: client.get(key)[0] is not None, 30, "the first node's key")
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as poker:
        _rewrite_key(poker, key)
    wait_until(lambda: first._current() is not old, 30, "the first node to leave")
    assert sorted(_both_join(waiting, second)) == [0, 1]
    assert first._current() is not old


def test_repeated_thread_deaths_during_a_join_still_end_in_a_round(
    etcd1: EtcdCluster,
    run_id: str,
    handlers: list[EtcdRendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fault that lasts: every watch thread the joining node starts dies on its first
    # response for a few seconds. Once it stops, the join must still end in a round.
    first, second, waiting = _lone_joiner(etcd1, run_id, handlers)
    client: EtcdClient = first._etcd()
    deaths = 0

    def broken(*_args: object) -> None:
        nonlocal deaths
        deaths += 1
        raise RuntimeError("injected into the watch thread")

    monkeypatch.setattr(client._watcher, "_handle", broken)
    key = first._keys.node(first.node_id)
    deadline = time.monotonic() + 3
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as poker:
        while time.monotonic() < deadline:
            _rewrite_key(poker, key)
            time.sleep(0.2)
    monkeypatch.undo()
    assert deaths >= 2
    assert sorted(_both_join(waiting, second)) == [0, 1]


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_is_closed_after_a_thread_death_answers_from_memory_while_etcd_is_away(
    run_id: str, handlers: list[EtcdRendezvousHandler], monkeypatch: pytest.MonkeyPatch,
    closed: bool,
) -> None:  # fmt: skip
    # The worst moment: a watch thread died (the node left, its participation is gone
    # until the next join) and etcd is away when the agent's loop asks is_closed() on
    # its next tick. It must answer from what the node saw, at once and without raising;
    # it used to build a new participation there (a watch and a read: RPCs), which
    # raised RendezvousConnectionError after read_timeout.
    with EtcdCluster(1, no_fsync=True, stop_grace=1.0) as cluster:
        node = make_handler(cluster, run_id, 1, 1, read_timeout=2)
        handlers.append(node)
        Joins([node]).start().infos()
        client: EtcdClient = node._etcd()
        monkeypatch.setattr(client._watcher, "_handle", _dies)
        if closed:
            node.set_closed("closed by the test")  # its event kills the watch thread
        else:
            with EtcdClient(EtcdConfig(endpoints=tuple(cluster.endpoints))) as poker:
                _rewrite_key(poker, node._keys.state)
        wait_until(lambda: node.num_nodes_waiting() == 1, 30, "the node to report the death")
        assert node._current() is None
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name == "rdzv-rejoin"],
            30,
            "the dead participation's teardown",
        )
        cluster.kill(0)
        began = time.monotonic()
        assert node.is_closed() is closed
        assert time.monotonic() - began < 1.0  # read_timeout is 2 s: no etcd call was made
        assert node._current() is None  # nothing was built for it


def _dies(*_args: object) -> None:
    raise RuntimeError("injected into the watch thread")
