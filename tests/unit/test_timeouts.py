"""How the timeouts nest (coordinator.core.timeouts, docs/timeouts.md): each refusal and
each warning pinned by its message, at etcdrun's start and for stock torchrun."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.cli.etcdrun import parse_args
from coordinator.core.errors import ConfigError
from coordinator.core.settings import RendezvousSettings
from coordinator.core.timeouts import Spans, advised_lease_ttl, nesting

SCRIPT = str(Path(__file__))
BASE = ["--nnodes=2:4", "--rdzv-endpoint=e1:2379", "--rdzv-id=job"]


def _lines(spans: Spans) -> list[tuple[bool, str]]:
    return [(f.refuse, f.line) for f in nesting(spans)]


def test_the_defaults_break_no_rule() -> None:
    assert nesting(Spans()) == []
    assert nesting(Spans(min_nodes=2, max_nodes=500, hang_timeout=120,
                         health_check_timeout=30)) == []  # fmt: skip


def test_a_last_call_that_outlasts_the_join_is_refused() -> None:
    assert _lines(Spans(last_call_timeout=60, join_timeout=60, min_nodes=2, max_nodes=4)) == [(
        True,
        "last_call_timeout=60 must be less than join_timeout=60: with fewer than 4 nodes a "
        "round forms only when its last call ends, and every join would time out first; "
        "raise join_timeout or lower last_call_timeout",
    )]  # fmt: skip
    # With a fixed size there is no last call: nothing to refuse.
    assert nesting(Spans(last_call_timeout=60, join_timeout=60, min_nodes=4, max_nodes=4)) == []


@pytest.mark.parametrize(
    ("spans", "line"),
    [
        (Spans(join_timeout=10, lease_ttl=5, last_call_timeout=1),
         "join_timeout=10 is not above twice lease_ttl=5: a join that waits for a dead "
         "node's key to expire may time out first; give join_timeout well above lease_ttl"),
        (Spans(store_timeout=6, lease_ttl=5),
         "timeout=6 (the Store's blocking waits) is not above lease_ttl=5 + 1 s: a rank "
         "exchange or exit barrier waiting on a node that died ends in a store timeout "
         "before its loss is noticed; raise timeout"),
        (Spans(max_nodes=4000, lease_ttl=5),
         "lease_ttl=5 with up to 4000 nodes renews about 2400 leases a second on etcd's "
         "leader (above 1000/s it spends noticeable CPU on them); use lease_ttl=15 or more "
         "(docs/scale.md)"),
        (Spans(hang_timeout=5, lease_ttl=5),
         "--hang-timeout=5 is not above lease_ttl=5: a node that freezes would be declared "
         "hung (a counted restart on every node) before its lease ends (a re-formation "
         "without it, not counted); give --hang-timeout above lease_ttl"),
        (Spans(hang_timeout=900),
         "--hang-timeout=900 is not below torch's default collective timeout of 600 s "
         "(NCCL): a stuck collective may fail the workers first, and no node is named; keep "
         "it below init_process_group(timeout=...)"),
        (Spans(health_check_timeout=700),
         "--health-check-timeout=700 is not below join_timeout=600: nodes that arrive during "
         "a pre-flight check wait for it to end and may time out their join; raise "
         "join_timeout"),
        (Spans(shutdown_timeout=45),
         "--shutdown-timeout=45 is not below the schedulers' default grace of 30 s "
         "(Kubernetes' terminationGracePeriodSeconds, Slurm's KillWait): the scheduler may "
         "kill the workers before they finish; keep it below your scheduler's grace"),
    ],
    ids=["join-vs-ttl", "store-vs-ttl", "ttl-vs-size", "hang-vs-ttl", "hang-vs-torch",
         "check-vs-join", "grace-vs-scheduler"],
)
def test_each_risky_combination_is_one_warning(spans: Spans, line: str) -> None:
    assert _lines(spans) == [(False, line)]


def test_the_advised_ttl_grows_with_the_job() -> None:
    assert [advised_lease_ttl(n) for n in (100, 1666, 1667, 3333, 5000, 10_000, 30_000)] == [
        5, 5, 10, 10, 15, 30, 60,
    ]  # fmt: skip


def test_etcdrun_refuses_a_combination_that_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*BASE, "--rdzv-conf=last_call_timeout=120,join_timeout=60", SCRIPT]
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, device_count=lambda: 0, cpu_count=lambda: 4, environ={})
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "etcdrun: error: --rdzv-conf: last_call_timeout=120 must be less than join_timeout=60: "
        "with fewer than 4 nodes a round forms only when its last call ends, and every join "
        "would time out first; raise join_timeout or lower last_call_timeout\n"
    )


def test_etcdrun_warns_once_per_risky_combination_and_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    argv = [*BASE, "--hang-timeout=3", "--shutdown-timeout=40", SCRIPT]
    with caplog.at_level(logging.WARNING):
        config = parse_args(argv, device_count=lambda: 0, cpu_count=lambda: 4, environ={})
    assert config.hang_timeout == 3
    warned = [r.getMessage() for r in caplog.records if r.getMessage().endswith("timeouts.md)")]
    assert [w.split(":")[0] for w in warned] == [
        "--hang-timeout=3 is not above lease_ttl=5",
        "--shutdown-timeout=40 is not below the schedulers' default grace of 30 s (Kubernetes'"
        " terminationGracePeriodSeconds, Slurm's KillWait)",
    ]


def test_stock_torchruns_settings_refuse_it_too() -> None:
    class Params:
        run_id, endpoint, min_nodes, max_nodes, local_addr = "job", "e1:2379", 1, 3, None
        config = {"last_call_timeout": "30", "join_timeout": "20"}

    with pytest.raises(ConfigError) as info:
        RendezvousSettings.from_parameters(Params())
    assert str(info.value).startswith(
        "rdzv_conf last_call_timeout=30 must be less than join_timeout=20: with fewer than 3 "
    )
