"""A participant that misses the next round's formation learns it was left behind.

A node joins the wait list; the participants re-rendezvous (``num_nodes_waiting()``); one
whose agent is still starting its workers does not look in time, and after the last call
the next round completes without it (DESIGN §4: the slower are waited for until the last
call ends). The wait list is empty again then, and nothing said to the one left behind
that its round is over: it ran a group of a round nobody else was in, its workers waiting
for peers that never came. Found by the chaos run of ``node_keys_deleted`` (seed 3: two
deletions 0.5 s apart, the second while one agent started its workers from an empty warm
pool; that agent ran round 3's workers for 50 s while rounds 4 and 5 trained).
"""

from __future__ import annotations

import pytest

from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration


def test_a_participant_left_out_of_the_next_round_is_told_to_join_again(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    a, b, c = (make_handler(etcd1, run_id, 2, 4) for _ in range(3))
    handlers += [a, b, c]
    Joins([a, b, c]).start().infos()
    assert {h.last_round for h in (a, b, c)} == {1}

    d = make_handler(etcd1, run_id, 2, 4)
    handlers.append(d)
    newcomer = Joins([d]).start()
    wait_until(lambda: c.num_nodes_waiting() > 0, 30, "the participants to see d waiting")
    # a and b re-rendezvous; c is busy (its agent starts its workers) and does not.
    Joins([a, b]).start().infos(60)
    newcomer.infos(60)
    assert a.last_round == 2 and sorted(a.last_members) == sorted([a.node_id, b.node_id, d.node_id])
    # Round 2 formed without c and nobody waits now: c must still hear that it is out.
    assert c.last_round == 1
    wait_until(lambda: c.num_nodes_waiting() > 0, 10, "c to learn it was left behind")

    # c's agent re-rendezvouses; the others see it waiting and re-rendezvous too.
    late = Joins([c]).start()
    wait_until(lambda: a.num_nodes_waiting() > 0, 30, "the others to see c waiting")
    others = Joins([a, b, d]).start()
    infos = [*late.infos(60).values(), *others.infos(60).values()]
    assert sorted(i.rank for i in infos) == [0, 1, 2, 3]
    assert {h.last_round for h in (a, b, c, d)} == {3}
    assert all(h.num_nodes_waiting() == 0 for h in (a, b, c, d))
