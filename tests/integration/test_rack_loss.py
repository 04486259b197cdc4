"""Half of a job lost at once (a rack) while etcd's leader changes (issue 20, item 4).

etcd spreads the expiries of many leases (at most about 1,000 a second), and a new leader
renews every lease it inherits, so the dead nodes' leases live up to one more TTL after a
leader change. Through all of it the survivors must keep their own leases (their
keep-alives move to another member), hear of the loss, and form a round of exactly
themselves once the last dead lease is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 3
HALF = 6  # nodes in the rack (one process), and as many survivors (threads here)

# The rack: HALF nodes in one process, which the test SIGKILLs (no lease is revoked).
_RACK = textwrap.dedent(
    """
    import sys, threading, time
    from tests.rdzv_helpers import Joins, make_handler
    endpoints, run_id, ttl, half = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    handlers = [
        make_handler(
            endpoints, run_id, half, 2 * half, lease_ttl=ttl, last_call_timeout=30,
            join_timeout=120,
        )
        for _ in range(half)
    ]
    infos = Joins(handlers).start().infos(120)
    print("joined", sorted(i.rank for i in infos.values()), flush=True)
    time.sleep(600)
    """
)


def _leader(cluster: EtcdCluster) -> int:
    for i, member in enumerate(cluster.members):
        try:
            text = member.metrics()
        except OSError:
            continue
        if "\netcd_server_is_leader 1" in text:
            return i
    raise AssertionError("no etcd member says it leads")


def test_a_rack_lost_at_once_during_a_leader_change_leaves_a_round_of_the_survivors(
    fresh_cluster3: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [
        make_handler(
            fresh_cluster3,
            run_id,
            HALF,
            2 * HALF,
            lease_ttl=TTL,
            last_call_timeout=30,
            join_timeout=120,
        )
        for _ in range(HALF)
    ]
    joins = Joins(handlers).start()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rack = subprocess.Popen(
        [sys.executable, "-c", _RACK, fresh_cluster3.endpoint_list, run_id, str(TTL), str(HALF)],
        stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert rack.stdout is not None
        line = rack.stdout.readline()
        assert line.startswith("joined"), line
        first = joins.infos(120)
        assert {i.world_size for i in first.values()} == {2 * HALF}

        rack.send_signal(signal.SIGKILL)
        rack.wait(10)
        killed_at = time.monotonic()
        # The leader goes while the dead leases are counting down: the next leader
        # renews them all (they expire up to one TTL later), and the survivors' streams
        # that were on it move to another member.
        time.sleep(TTL / 2)  # the fault's moment: halfway through the dead leases' TTL
        fresh_cluster3.kill(_leader(fresh_cluster3))
        wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in handlers), 4 * TTL + 30,
                   "every survivor to hear of the loss")  # fmt: skip

        again = Joins(handlers).start().infos(4 * TTL + 60)
        took = time.monotonic() - killed_at
        print(f"\n{HALF} of {2 * HALF} lost with a leader change: survivors formed in {took:.1f} s")
        assert {i.world_size for i in again.values()} == {HALF}
        assert sorted(i.rank for i in again.values()) == list(range(HALF))
        # No survivor lost its own lease on the way (its node key is still the one it
        # joined with: a lost lease would have made it a new node, or failed its join).
        assert all(h.num_nodes_waiting() == 0 for h in handlers)
    finally:
        if rack.poll() is None:
            rack.kill()
        rack.wait(10)
