"""etcd refusing the nodes' role for a while: a node that had the permission waits for it
(issue 21, "etcd refusing a role"; coordinator/core/join_retry.py).

An operator (or a configuration tool) revokes the role's permission on the run's keys and
grants it again: a role re-created, a grant re-applied. A healthy job needs nothing but
its keep-alives, which etcd still answers, so it does not notice. A re-formation meets
it: the job's restart count and every node's key are refused. A node that wrote its key
before waits for the grant: its counted restart for read_timeout (one etcd call, as the
client waits for etcd away), its join until the join's deadline; then it stops with the
permission's one line. A node that never had it stops at once (a role without the grant
is a mistake to fix, not to wait out). The chaos kind ``etcd_role_revoked`` does the same
to real agents (tests/chaos/faults_edges.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.restart_budget import RestartCount
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.errors import EtcdAuthError
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.etcd_auth import Grant, enable_auth, etcdctl
from tests.rdzv_helpers import Joins, make_handler

pytestmark = pytest.mark.integration

REFUSED_S = 3.0  # how long the grant is away while the nodes re-form


@pytest.fixture
def own_etcd() -> Iterator[EtcdCluster]:
    """A single member of this test's own: it gets auth enabled."""
    with EtcdCluster(1, no_fsync=True, stop_grace=1.0) as cluster:
        yield cluster


class _Role:
    """The nodes' role ``trainer``, readwrite on one run's keys, with root to change it."""

    def __init__(self, cluster: EtcdCluster, run_id: str) -> None:
        self.endpoint = cluster.endpoints[0]
        prefix = RunKeys(DEFAULT_KEY_PREFIX, run_id).run_prefix.decode()
        self.range = (prefix, prefix[:-1] + "0")  # "0" is the byte after "/"
        self.root = f"root:{uuid.uuid4().hex}"
        self.password = uuid.uuid4().hex
        grant = Grant("readwrite", *self.range)
        enable_auth(self.endpoint, self.root.split(":")[1], {"trainer": (self.password, [grant])})

    def revoke(self) -> None:
        etcdctl(self.endpoint, f"--user={self.root}", "role", "revoke-permission", "trainer",
                *self.range)  # fmt: skip

    def grant(self) -> None:
        etcdctl(self.endpoint, f"--user={self.root}", "role", "grant-permission", "trainer",
                "readwrite", *self.range)  # fmt: skip

    def handler(self, run_id: str, **conf: object) -> EtcdRendezvousHandler:
        return make_handler(
            self.endpoint, run_id, 2, 2, user="trainer", password=self.password, **conf
        )


def _joined_then_revoked(
    cluster: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler], **conf: object
) -> tuple[_Role, EtcdRendezvousHandler, EtcdRendezvousHandler]:
    """Two nodes of the role trained in round 1; then the role's permission is revoked."""
    role = _Role(cluster, run_id)
    a, b = role.handler(run_id, **conf), role.handler(run_id, **conf)
    handlers += [a, b]
    Joins([a, b]).start().infos()
    role.revoke()
    return role, a, b


def test_nodes_that_had_the_permission_wait_for_it_through_a_re_formation(
    own_etcd: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    role, a, b = _joined_then_revoked(own_etcd, run_id, handlers)
    # A worker failed while the role is refused: each agent counts the restart for the
    # job, then re-rendezvouses (as agent/loop/agent.py does).
    ended: dict[str, object] = {}

    def restart(h: EtcdRendezvousHandler) -> None:
        try:
            count = h.count_restart(1)
            ended[h.node_id] = (count, h.next_rendezvous())
        except BaseException as exc:  # recorded for the assertion below
            ended[h.node_id] = exc

    threads = [threading.Thread(target=restart, args=(h,), daemon=True) for h in (a, b)]
    for thread in threads:
        thread.start()
    time.sleep(REFUSED_S)
    assert not ended, f"a restart ended while the role was refused: {ended}"
    role.grant()
    for thread in threads:
        thread.join(60)
    assert set(ended) == {a.node_id, b.node_id}, ended
    outcomes = [ended[h.node_id] for h in (a, b)]
    assert all(isinstance(o, tuple) for o in outcomes), outcomes
    counts = [o[0] for o in outcomes if isinstance(o, tuple)]
    ranks = sorted(o[1].rank for o in outcomes if isinstance(o, tuple))
    assert ranks == [0, 1]
    assert a.last_round == b.last_round == 2
    assert all(isinstance(c, RestartCount) and c.used == 1 for c in counts), counts  # once


def test_a_refused_permission_ends_a_join_at_once_if_never_had_and_at_the_deadline_if_had(
    own_etcd: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    role, a, _ = _joined_then_revoked(own_etcd, run_id, handlers, join_timeout=6)
    newcomer = role.handler(run_id)
    handlers.append(newcomer)
    started = time.monotonic()
    with pytest.raises(EtcdAuthError) as info:
        newcomer.next_rendezvous()
    assert time.monotonic() - started < 5, "a node that never had the permission waited"
    assert "etcd user 'trainer' may not watch key" in str(info.value)

    started = time.monotonic()
    with pytest.raises(EtcdAuthError) as info:
        a.next_rendezvous()
    waited = time.monotonic() - started
    assert 5 <= waited < 20, f"a node that had the permission gave up after {waited:.1f} s"
    assert str(info.value).startswith("etcd user 'trainer' is not permitted to put on key ")
    assert str(info.value).endswith(
        "(etcdserver: permission denied); grant the user's role readwrite on the key prefix"
    )


def test_a_healthy_job_does_not_notice_the_role_refused(
    own_etcd: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    role, a, b = _joined_then_revoked(own_etcd, run_id, handlers)
    time.sleep(3 * 3 + 1)  # three lease TTLs: the keep-alives must still be answered
    assert [h.num_nodes_waiting() for h in (a, b)] == [0, 0]
    assert [h.departed_participants() for h in (a, b)] == [[], []]
    role.grant()
    infos = Joins([a, b]).start().infos()
    assert sorted(i.rank for i in infos.values()) == [0, 1]
    assert a.last_round == b.last_round == 2
