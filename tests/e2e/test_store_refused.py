"""An etcd user that may not write the round's Store: the agent stops with one line
(issue 21 item 2).

The role lets the user do everything under the run's prefix but write its ``store/``
keys, so the rendezvous completes and the very next etcd call, the rank exchange's first
Store write, is refused. That refusal used to leave the Store as the core's
``EtcdAuthError``, which the rank exchange does not catch: the agent died with a
traceback. It is a torch store error now, and the agent says why in one line.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.etcd_server import EtcdCluster
from tests.e2e.agents import Agents
from tests.etcd_auth import enable_auth, run_grants_without_store_writes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STARTED = 180.0


@pytest.fixture
def authed() -> Iterator[EtcdCluster]:
    with EtcdCluster(1, no_fsync=True, stop_grace=1.0) as cluster:
        yield cluster


def test_a_user_who_may_not_write_the_store_stops_the_agent_with_one_line(
    authed: EtcdCluster, run_id: str, tmp_path: Path
) -> None:
    password = uuid.uuid4().hex
    run_prefix = RunKeys(DEFAULT_KEY_PREFIX, run_id).run_prefix.decode()
    enable_auth(
        authed.endpoints[0],
        uuid.uuid4().hex,
        {"trainer": (password, run_grants_without_store_writes(run_prefix))},
    )
    agents = Agents(run_id, authed.endpoints[0], tmp_path)
    try:
        agent = agents.start(
            "a",
            ["--nnodes=1", "--nproc-per-node=1", "--rdzv-conf=user=trainer,read_timeout=5"],
            env={"ETCD_ELASTIC_PASSWORD": password},
        )
        code = agent.wait(STARTED)
        output = agent.output()
    finally:
        agents.reap()
    assert code == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "etcdrun: error:" in line]
    assert len(errors) == 1, output
    line = errors[0]
    assert (
        "etcdrun: error: round formed, but the rank exchange failed: etcd user 'trainer' " in line
    )
    assert f"is not permitted to put on key {run_prefix}store/" in line, line
    assert line.endswith(
        "(etcdserver: permission denied); grant the user's role readwrite on the key prefix"
    ), line
