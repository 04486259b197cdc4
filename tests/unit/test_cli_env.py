"""etcdrun configured only through the PET_* variables a scheduler sets (Kubeflow Trainer
v2's torch runtime, the legacy PyTorchJob with elasticPolicy) behaves as the flags would;
a flag on the command line wins; a bad value names the variable it came from."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.cli.etcdrun import parse_args
from agent.config import LaunchConfig

SCRIPT = str(Path(__file__))  # any file that exists


def _parse(argv: list[str], environ: dict[str, str]) -> LaunchConfig:
    return parse_args(argv, device_count=lambda: 0, cpu_count=lambda: 4, environ=environ)


def _error(argv: list[str], environ: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        _parse(argv, environ)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


BASE = {"PET_RDZV_ENDPOINT": "e1:2379", "PET_RDZV_ID": "job"}

# (variable, value, the same as a flag)
OPTIONS = [
    ("PET_NNODES", "2:4", "--nnodes=2:4"),
    ("PET_NPROC_PER_NODE", "3", "--nproc-per-node=3"),
    ("PET_RDZV_BACKEND", "etcd-v3", "--rdzv-backend=etcd-v3"),
    ("PET_RDZV_CONF", "lease_ttl=7,join_timeout=90", "--rdzv-conf=lease_ttl=7,join_timeout=90"),
    ("PET_MAX_RESTARTS", "3", "--max-restarts=3"),
    ("PET_MONITOR_INTERVAL", "0.5", "--monitor-interval=0.5"),
    ("PET_EXIT_BARRIER_TIMEOUT", "60", "--exit-barrier-timeout=60"),
    ("PET_SHUTDOWN_TIMEOUT", "9", "--shutdown-timeout=9"),
    ("PET_DRAIN_SIGNAL", "SIGUSR1", "--drain-signal=SIGUSR1"),
    ("PET_HANG_TIMEOUT", "120", "--hang-timeout=120"),
    ("PET_ROLE", "trainer", "--role=trainer"),
    ("PET_LOG_DIR", "/tmp/logs", "--log-dir=/tmp/logs"),
    ("PET_REDIRECTS", "3", "--redirects=3"),
    ("PET_TEE", "1", "--tee=1"),
    ("PET_LOCAL_RANKS_FILTER", "0", "--local-ranks-filter=0"),
    ("PET_METRICS_PORT", "9400", "--metrics-port=9400"),
    ("PET_LOCAL_ADDR", "10.0.0.7", "--local-addr=10.0.0.7"),
    ("PET_WARM_POOL_SIZE", "1", "--warm-pool-size=1"),
    ("PET_START_METHOD", "fork", "--start-method=fork"),
]


@pytest.mark.parametrize(("variable", "value", "flag"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_each_variable_means_its_flag(variable: str, value: str, flag: str) -> None:
    from_env = _parse([SCRIPT], {**BASE, variable: value})
    from_flag = _parse([flag, SCRIPT], BASE)
    assert from_env == from_flag


@pytest.mark.parametrize(("variable", "value", "flag"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_a_flag_beats_its_variable(variable: str, value: str, flag: str) -> None:
    # The environment says something else; the command line's flag is what counts.
    other = {"PET_NNODES": "1:8", "PET_RDZV_BACKEND": "etcd-v2", "PET_DRAIN_SIGNAL": "SIGUSR2",
             "PET_ROLE": "other", "PET_START_METHOD": "spawn",
             "PET_LOCAL_ADDR": "10.9.9.9", "PET_LOG_DIR": "/tmp/other"}  # fmt: skip
    environ = {**BASE, variable: other.get(variable, "5")}
    assert _parse([flag, SCRIPT], environ) == _parse([flag, SCRIPT], BASE)


@pytest.mark.parametrize(
    ("variable", "flag"),
    [
        ("PET_STANDALONE", "--standalone"),
        ("PET_MODULE", "--module"),
        ("PET_NO_PYTHON", "--no-python"),
        ("PET_RUN_PATH", "--run-path"),
        ("PET_NO_WARM_START", "--no-warm-start"),
        ("PET_HEALTH_CHECK", "--health-check"),
    ],
)
def test_switches_read_1_as_on_and_0_or_empty_as_off(variable: str, flag: str) -> None:
    # A standalone run gets a random run id: fix it, so two parses compare equal.
    environ = {"PET_RDZV_ID": "solo"} if flag == "--standalone" else BASE
    script = SCRIPT  # an existing file: so the parse with the switch off is valid too
    on = _parse([flag, script], environ)
    for text in ("1", "true", "YES"):
        assert _parse([script], {**environ, variable: text}) == on
    off = _parse([script], environ)
    for text in ("0", "", "false", "no"):
        assert _parse([script], {**environ, variable: text}) == off


def test_a_switch_value_that_is_neither_names_the_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _error([SCRIPT], {**BASE, "PET_HEALTH_CHECK": "maybe"}, capsys) == (
        "etcdrun: error: --health-check (from PET_HEALTH_CHECK): 'maybe' is not a switch "
        "value; give 1 (on) or 0 (off)"
    )


def test_a_bad_value_from_the_environment_names_the_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _error([SCRIPT], {**BASE, "PET_MAX_RESTARTS": "x"}, capsys) == (
        "etcdrun: error: --max-restarts (from PET_MAX_RESTARTS): 'x' is not a whole number; "
        "give 0 or more restarts"
    )
    # The same value on the command line names the flag alone.
    assert _error(["--max-restarts=x", SCRIPT], BASE, capsys) == (
        "etcdrun: error: --max-restarts: 'x' is not a whole number; give 0 or more restarts"
    )
    assert _error([SCRIPT], {**BASE, "PET_RDZV_BACKEND": "c10d"}, capsys) == (
        "etcdrun: error: --rdzv-backend (from PET_RDZV_BACKEND): 'c10d' is not supported; use "
        "etcd-v2 or etcd-v3 (both are this project's etcd v3 rendezvous)"
    )


def test_the_metrics_address_comes_with_its_port() -> None:
    environ = {**BASE, "PET_METRICS_PORT": "9400", "PET_METRICS_ADDR": "0.0.0.0"}
    flags = ["--metrics-port=9400", "--metrics-addr=0.0.0.0"]
    assert _parse([SCRIPT], environ) == _parse([*flags, SCRIPT], BASE)


def test_an_empty_variable_is_an_unset_one(capsys: pytest.CaptureFixture[str]) -> None:
    # A scheduler's template with no value: the built-in default, and an error about a
    # missing value names the flag alone.
    assert _parse([SCRIPT], {**BASE, "PET_MAX_RESTARTS": ""}).max_restarts == 0
    environ = {"PET_RDZV_ENDPOINT": "e1:2379", "PET_RDZV_ID": " "}
    assert _error(["--nnodes=2", SCRIPT], environ, capsys).startswith(
        "etcdrun: error: --rdzv-id: missing; a job of up to 2 nodes needs a run id"
    )


def test_nnodes_alone_is_a_fixed_size() -> None:
    fixed = _parse([SCRIPT], {**BASE, "PET_NNODES": "4"})
    assert (fixed.min_nodes, fixed.max_nodes) == (4, 4)


def test_a_schedulers_master_address_is_ignored_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {**BASE, "PET_MASTER_ADDR": "job42-node-0-0.job42", "PET_MASTER_PORT": "29500"}
    with caplog.at_level(logging.INFO):
        config = _parse([SCRIPT], environ)
    assert (config.master_addr, config.master_port) == (None, None)
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == [
        "PET_MASTER_ADDR=job42-node-0-0.job42 ignored: this run's group rank 0 publishes the "
        "workers' master address (torchrun ignores it too outside its static rendezvous)",
        "PET_MASTER_PORT=29500 ignored: this run's group rank 0 publishes the workers' master "
        "address (torchrun ignores it too outside its static rendezvous)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if "ignored" in r.getMessage())
    # As flags they keep etcdrun's meaning: what group rank 0 publishes.
    flags = _parse(["--master-addr=m", "--master-port=29501", SCRIPT], environ)
    assert (flags.master_addr, flags.master_port) == ("m", 29501)


def test_a_node_rank_from_the_scheduler_is_an_info_line_and_from_the_user_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        _parse([SCRIPT], {**BASE, "PET_NODE_RANK": "3"})
        _parse(["--node-rank=2", SCRIPT], BASE)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "node-rank" in r.getMessage()]
    assert said == [
        (logging.INFO, "--node-rank=3 is only used by torch's static rendezvous; ignored here "
                       "(from PET_NODE_RANK, set by the scheduler)"),
        (logging.WARNING, "--node-rank=2 is only used by torch's static rendezvous; ignored here"),
    ]  # fmt: skip


def test_kubeflow_trainer_v2s_environment_equals_the_same_run_given_as_flags() -> None:
    trainer = {
        "PET_NNODES": "4", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "job42-node-0-0.job42", "PET_MASTER_PORT": "29500",
        "PET_RDZV_ID": "job42", "PET_RDZV_CONF": "lease_ttl=5",
    }  # fmt: skip
    runtime = [
        "--rdzv-backend=etcd-v2", "--rdzv-endpoint=etcd-0:2379,etcd-1:2379", "--max-restarts=3"
    ]
    flags = [
        "--nnodes=4", "--nproc-per-node=auto", "--rdzv-id=job42", "--rdzv-conf=lease_ttl=5",
        "--node-rank=2",  # recorded, with no effect either way
    ]  # fmt: skip
    assert _parse([*runtime, SCRIPT], trainer) == _parse([*runtime, *flags, SCRIPT], {})


def test_a_legacy_pytorchjobs_environment_equals_the_same_run_given_as_flags() -> None:
    operator = {
        "PET_RDZV_BACKEND": "etcd-v2", "PET_RDZV_ENDPOINT": "etcd-client.etcd-elastic.svc:2379",
        "PET_NNODES": "2:4", "PET_MAX_RESTARTS": "3", "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_ID": "job43", "PET_RDZV_CONF": "lease_ttl=5",
    }  # fmt: skip
    flags = [
        "--rdzv-backend=etcd-v2", "--rdzv-endpoint=etcd-client.etcd-elastic.svc:2379",
        "--nnodes=2:4", "--max-restarts=3", "--nproc-per-node=1", "--rdzv-id=job43",
        "--rdzv-conf=lease_ttl=5",
    ]  # fmt: skip
    assert _parse([SCRIPT], operator) == _parse([*flags, SCRIPT], {})
