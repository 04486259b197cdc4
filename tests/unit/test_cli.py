"""``etcdrun``'s command line: misuse ends with one pinned line and exit code 2, before
anything starts; good command lines produce the expected ``LaunchConfig``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import agent.cli.etcdrun as cli
from agent.cli.configure import scheduler_run_id
from agent.cli.etcdrun import main, parse_args
from agent.config import LaunchConfig

ROOT = Path(__file__).resolve().parents[2]
KNOWN_KEYS = (
    "ca_cert, close_timeout, events_limit, is_host, join_timeout, keep_alive_interval, "
    "keep_alive_max_attempt, key_prefix, last_call_timeout, lease_ttl, password, password_file, "
    "protocol, rank, read_timeout, retention, ssl_cert, ssl_cert_key, store_type, timeout, user"
)
REDIRECT_HINT = (
    "give e.g. 3 (stdout and stderr of every worker) or 0:1,1:2 (stdout of rank 0, stderr "
    "of rank 1)"
)


@pytest.fixture(autouse=True)
def _in_tmp_with_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every case in a folder holding ``train.py``, with no ``PET_*`` variables."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records what main() starts: the embedded etcd and the agent (neither really runs)."""
    calls: list[str] = []

    @contextlib.contextmanager
    def fake_embedded() -> Iterator[str]:
        calls.append("etcd")
        yield "127.0.0.1:23790"

    def fake_launch(config: LaunchConfig, metrics: object = None) -> int:
        calls.append(f"launch {config.rdzv_endpoint}")
        return 7

    monkeypatch.setattr(cli, "_embedded", fake_embedded)
    monkeypatch.setattr(cli, "_launch", fake_launch)
    return calls


MISUSE = [
    (["--nnodes=4:2", "train.py"],
     "--nnodes: minimum 4 is greater than maximum 2; give MIN:MAX with MIN <= MAX"),
    (["--nnodes=0", "train.py"],
     "--nnodes: '0' allows 0 nodes; a job needs at least 1, e.g. 2 or 1:4"),
    (["--nnodes=a", "train.py"],
     "--nnodes: 'a' is not a number of nodes; give N or MIN:MAX, e.g. 2 or 1:4"),
    (["--nnodes=1:2:3", "train.py"], "--nnodes: '1:2:3' is not N or MIN:MAX; give e.g. 2 or 1:4"),
    (["--nproc-per-node=abc", "train.py"],
     "--nproc-per-node: 'abc' is not a number of workers; give a positive integer, 'gpu', "
     "'cpu' or 'auto'"),
    (["--nproc_per_node=0", "train.py"],
     "--nproc-per-node: 0 workers per node is not possible; give at least 1"),
    (["--nproc-per-node=gpu", "train.py"],
     "--nproc-per-node: 'gpu' needs CUDA devices but none are visible; give a number, 'cpu' "
     "or 'auto' instead"),
    (["--max-restarts=-1", "train.py"],
     "--max-restarts: -1 is out of range; give 0 or more restarts"),
    (["--max-restarts=two", "train.py"],
     "--max-restarts: 'two' is not a whole number; give 0 or more restarts"),
    (["--monitor-interval=0", "train.py"],
     "--monitor-interval: '0' is out of range; give a number of seconds above 0"),
    (["--exit-barrier-timeout=-1", "train.py"],
     "--exit-barrier-timeout: '-1' is out of range; give 0 or more seconds"),
    (["--rdzv-conf=foo=1", "train.py"],
     f"--rdzv-conf: unknown key 'foo'; known keys: {KNOWN_KEYS}"),
    (["--rdzv-conf=join_timeuot=1", "train.py"],
     "--rdzv-conf: unknown key 'join_timeuot' (did you mean 'join_timeout'?); known keys: "
     f"{KNOWN_KEYS}"),
    (["--rdzv-conf=join_timeout", "train.py"],
     "--rdzv-conf: 'join_timeout' is not key=value; give pairs separated by commas, e.g. "
     "join_timeout=600,lease_ttl=5"),
    (["--rdzv-conf=join_timeout=", "train.py"],
     "--rdzv-conf: 'join_timeout' has no value; give join_timeout=<value>"),
    (["--rdzv-conf=lease_ttl=abc", "train.py"],
     "--rdzv-conf: lease_ttl='abc' is not a whole number of seconds"),
    (["missing.py"],
     "script: 'missing.py' does not exist (relative to {cwd}); give the path of the training "
     "script, or -m for a module, or --no-python for a program"),
    ([], "script: missing; give the training script and its arguments after the options, "
         "e.g. etcdrun --nproc-per-node=2 train.py --epochs 3"),
    (["--nnodes=2", "--rdzv-endpoint=host:notaport", "train.py"],
     "--rdzv-endpoint: 'host:notaport': 'notaport' is not a port number (1-65535); give the "
     "etcd members as host:port[,host:port...]"),
    (["--nnodes=1:4", "train.py"],
     "--rdzv-endpoint: missing; a job of up to 4 nodes needs a shared etcd: give "
     "--rdzv-endpoint=host:port[,host:port...], or --standalone for one node"),
    (["--standalone", "--rdzv-endpoint=h:2379", "train.py"],
     "--standalone: starts its own etcd, so --rdzv-endpoint=h:2379 makes no sense with it; "
     "drop one of the two"),
    (["--standalone", "--nnodes=2", "train.py"],
     "--nnodes: --standalone runs one node but --nnodes=2 allows 2; drop --standalone and "
     "give --rdzv-endpoint of an etcd all nodes can reach"),
    (["--rdzv-id=job/x", "train.py"],
     "--rdzv-id: 'job/x' is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - starting "
     "with a letter or digit"),
    (["--rdzv-backend=c10d", "train.py"],
     "--rdzv-backend: 'c10d' is not supported; use etcd-v2 or etcd-v3 (both are this "
     "project's etcd v3 rendezvous)"),
    (["-r", "5", "train.py"],
     f"--redirects: '5' is neither 0-3 nor LOCAL_RANK:0-3 pairs; {REDIRECT_HINT}"),
    (["--tee=0:4", "train.py"],
     f"--tee: '0:4' is neither 0-3 nor LOCAL_RANK:0-3 pairs; {REDIRECT_HINT}"),
    (["--local-ranks-filter=a", "train.py"],
     "--local-ranks-filter: 'a' is not a list of local ranks; give comma-separated numbers, "
     "e.g. 0,1"),
    (["--master-port=70000", "train.py"],
     "--master-port: 70000 is out of range; give a port 1-65535"),
    (["--start-method=thread", "train.py"],
     "--start-method: 'thread' is not spawn, fork or forkserver"),
    (["-m", "--no-python", "pkg.mod"],
     "--no-python: cannot be combined with -m/--module; drop one of them"),
    (["--frobnicate", "train.py"],
     "--frobnicate: unknown option; see etcdrun --help (arguments for the script go after "
     "the script)"),
    (["--max-restarts"], "--max-restarts: expected one argument"),
    (["--hang-timeout=-3", "train.py"],
     "--hang-timeout: '-3' is out of range; give a number of seconds of at least 1 (leave "
     "the flag out: off)"),
    (["--hang-timeout=0.5", "train.py"],
     "--hang-timeout: '0.5' is out of range; give a number of seconds of at least 1 (leave "
     "the flag out: off)"),
    (["--hang-timeout=nan", "train.py"],
     "--hang-timeout: 'nan' is out of range; give a number of seconds of at least 1 (leave "
     "the flag out: off)"),
    (["--hang-timeout=soon", "train.py"],
     "--hang-timeout: 'soon' is not a number; give a number of seconds of at least 1 (leave "
     "the flag out: off)"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), MISUSE, ids=[" ".join(a) or "-" for a, _ in MISUSE])
def test_misuse_is_one_line_and_exit_code_2(
    argv: list[str],
    message: str,
    started: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("agent.cli.devices.cuda_device_count", lambda: 0)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"etcdrun: error: {message.format(cwd=os.getcwd())}\n"
    assert started == [], "nothing may start before the command line is valid"


def test_console_path_prints_one_line_and_exits_2() -> None:
    # torch warns at import when numpy is missing; that is not our output.
    env = dict(os.environ, PYTHONWARNINGS="ignore:Failed to initialize NumPy:UserWarning")
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "--max-restarts=-1", "--nnodes=4:2", "x.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "etcdrun: error: --nnodes: minimum 4 is greater than maximum 2; "
        "give MIN:MAX with MIN <= MAX\n"
    )
    assert proc.stdout == ""


def _parse(argv: list[str], **kw: object) -> LaunchConfig:
    return parse_args(argv, device_count=lambda: 0, cpu_count=lambda: 4, **kw)  # type: ignore[arg-type]


def test_both_spellings_mean_the_same() -> None:
    common = ["--nnodes=1:3", "--rdzv-id=job-1"]
    dashes = _parse(
        [
            *common,
            "--nproc-per-node=2",
            "--rdzv-endpoint=e1:2379,e2:2379",
            "--max-restarts=3",
            "--monitor-interval=0.5",
            "--rdzv-conf=lease_ttl=3",
            "--local-ranks-filter=0",
            "--master-port=29500",
            "--no-python",
            "--log-dir=logs",
            "--exit-barrier-timeout=60",
            "train.py",
        ]
    )
    unders = _parse([*common, "--nproc_per_node=2", "--rdzv_endpoint=e1:2379,e2:2379",
                     "--max_restarts=3", "--monitor_interval=0.5", "--rdzv_conf=lease_ttl=3",
                     "--local_ranks_filter=0", "--master_port=29500", "--no_python",
                     "--log_dir=logs", "--exit_barrier_timeout=60", "train.py"])  # fmt: skip
    assert dashes == unders
    assert dashes == LaunchConfig(
        min_nodes=1,
        max_nodes=3,
        nproc_per_node=2,
        entrypoint="train.py",
        rdzv_endpoint="e1:2379,e2:2379",
        rdzv_id="job-1",
        rdzv_conf={"lease_ttl": "3"},
        max_restarts=3,
        monitor_interval=0.5,
        no_python=True,
        log_dir="logs",
        redirects={0: 0, 1: 0},
        tee={0: 0, 1: 0},
        local_ranks_filter=frozenset({0}),
        master_port=29500,
        exit_barrier_timeout=60.0,
    )


def test_script_arguments_are_passed_untouched() -> None:
    config = _parse(["--standalone", "train.py", "--nnodes=9", "-r", "x", "--", "--lr"])
    assert config.entrypoint == "train.py"
    assert config.args == ("--nnodes=9", "-r", "x", "--", "--lr")
    assert config.min_nodes == config.max_nodes == 1


def test_rdzv_conf_pairs_are_trimmed_and_kept_as_strings() -> None:
    conf = " join_timeout = 60 ,last_call_timeout=5,,key_prefix=/jobs"
    config = _parse(
        ["--nnodes=2", "--rdzv-endpoint=h", "--rdzv-id=j", "--rdzv-conf", conf, "train.py"]
    )
    assert config.rdzv_conf == {
        "join_timeout": "60",
        "last_call_timeout": "5",
        "key_prefix": "/jobs",
    }


@pytest.mark.parametrize(
    ("flag", "nproc", "expected"),
    [
        ("3", "2", {0: 3, 1: 3}),
        ("0:1,1:2", "2", {0: 1, 1: 2}),
        ("1:2", "3", {0: 0, 1: 2, 2: 0}),  # ranks not named: nothing redirected
        ("0:3,5:1", "2", {0: 3, 1: 0}),  # ranks beyond this node's workers: ignored
    ],
)
def test_redirects_and_tee_forms(flag: str, nproc: str, expected: dict[int, int]) -> None:
    config = _parse([f"--nproc-per-node={nproc}", "-r", flag, "--tee", flag, "train.py"])
    assert config.redirects == expected
    assert config.tee == expected


def test_one_node_without_endpoint_runs_standalone_with_a_random_run_id() -> None:
    first, second = _parse(["train.py"]), _parse(["train.py"])
    assert first.standalone and first.rdzv_endpoint == ""
    assert first.rdzv_id != second.rdzv_id
    assert _parse(["--standalone", "--rdzv-id=mine", "train.py"]).rdzv_id == "mine"


def test_module_and_program_need_no_file() -> None:
    assert _parse(["-m", "pkg.train", "--lr", "1"]).module
    assert _parse(["--no-python", "some-program"]).no_python


def test_nproc_keywords_use_the_injected_counts() -> None:
    assert (
        parse_args(["--nproc-per-node=gpu", "train.py"], device_count=lambda: 8).nproc_per_node == 8
    )
    assert _parse(["--nproc-per-node=auto", "train.py"]).nproc_per_node == 4
    assert _parse(["--nproc-per-node=cpu", "train.py"]).nproc_per_node == 4


def test_backend_names_and_shutdown_timeout() -> None:
    config = _parse(["--rdzv-backend=ETCD-V3", "--shutdown-timeout=12", "train.py"])
    assert config.rdzv_backend == "etcd-v3"
    assert config.stop_grace_period == 12.0


def test_pet_environment_supplies_defaults() -> None:
    env = {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "2", "PET_STANDALONE": "1"}
    config = _parse(["train.py"], environ=env)
    assert (config.nproc_per_node, config.max_restarts, config.standalone) == (3, 2, True)
    assert _parse(["--max-restarts=0", "train.py"], environ=env).max_restarts == 0


def test_ignored_torchrun_flags_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.cli.etcdrun"):
        _parse(["--numa-binding=node", "--virtual-local-rank", "train.py"])
    text = caplog.text
    assert "--numa-binding='node' is accepted for torchrun compatibility and ignored" in text
    assert "--virtual-local-rank=True is accepted for torchrun compatibility and ignored" in text


def test_main_starts_embedded_etcd_for_standalone_and_returns_the_agent_code(
    started: list[str],
) -> None:
    assert main(["--standalone", "--nproc-per-node=2", "train.py"]) == 7
    assert started == ["etcd", "launch 127.0.0.1:23790"]


def test_main_uses_the_given_endpoint(started: list[str]) -> None:
    assert main(["--nnodes=1:2", "--rdzv-endpoint=e1:2379", "--rdzv-id=j", "train.py"]) == 7
    assert started == ["launch e1:2379"]


def test_help_groups_flags_and_shows_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("rendezvous (etcd):", "restarts and monitoring:", "(default: 1:1)",
                 "etcdrun --standalone --nproc-per-node=2 train.py"):  # fmt: skip
        assert text in out


def test_standalone_without_an_etcd_binary_is_one_line_and_exit_code_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    launched: list[LaunchConfig] = []
    monkeypatch.setattr(cli, "_launch", launched.append)
    monkeypatch.setenv("ETCD_BINARY", str(tmp_path / "no-etcd"))
    assert main(["--standalone", "train.py"]) == 1
    assert capsys.readouterr().err == (
        f"etcdrun: error: --standalone: ETCD_BINARY={tmp_path / 'no-etcd'} is not an "
        "executable file; point it at an etcd server binary\n"
    )
    assert launched == []


# -- run ids -------------------------------------------------------------------------------


def test_a_multi_node_job_without_a_run_id_is_refused_before_anything_starts(
    started: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two unrelated jobs without an id would share run 'none': refused (exit 2)."""
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "PET_RDZV_ID"):
        monkeypatch.delenv(name, raising=False)
    for argv in (["--nnodes=2"], ["--nnodes=1:4", "--rdzv-id=none"], ["--nnodes=2", "--rdzv-id="]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--rdzv-endpoint=e1:2379", "train.py"])
        assert info.value.code == 2
        maximum = argv[0].rsplit(":", 1)[-1].removeprefix("--nnodes=")
        assert capsys.readouterr().err == (
            f"etcdrun: error: --rdzv-id: missing; a job of up to {maximum} nodes needs a run "
            "id that all its nodes share and no other job uses (two jobs without one would "
            "share a run): give e.g. --rdzv-id=job42 (under Slurm, SLURM_JOB_ID gives one)\n"
        )
    assert started == []


def test_a_run_id_comes_from_slurm_or_is_random_for_one_node() -> None:
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}
    argv = ["--nnodes=2", "--rdzv-endpoint=h", "train.py"]
    assert _parse(argv, environ=slurm).rdzv_id == "slurm-4242.3"
    assert _parse(argv, environ={"SLURM_JOB_ID": "4242"}).rdzv_id == "slurm-4242"
    assert _parse([*argv[:-1], "--rdzv-id=mine", "train.py"], environ=slurm).rdzv_id == "mine"
    assert _parse(argv, environ={"PET_RDZV_ID": "from-pet"}).rdzv_id == "from-pet"
    one = _parse(["--nnodes=1", "--rdzv-endpoint=h", "train.py"], environ={})
    two = _parse(["--nnodes=1", "--rdzv-endpoint=h", "train.py"], environ={})
    assert one.rdzv_id != two.rdzv_id and len(one.rdzv_id) == 36
    assert scheduler_run_id({"SLURM_JOB_ID": "x/y"}) is None  # not a valid run id


def test_drain_signal_takes_a_name_or_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--nnodes=2", "--rdzv-endpoint=h", "--rdzv-id=j"]
    assert _parse([*base, "train.py"]).drain_signal is None
    assert _parse([*base, "--drain-signal=SIGUSR1", "train.py"]).drain_signal is signal.SIGUSR1
    assert _parse([*base, "--drain-signal", "usr2", "train.py"]).drain_signal is signal.SIGUSR2
    assert _parse([*base, "--drain_signal=10", "train.py"]).drain_signal is signal.SIGUSR1
    with pytest.raises(SystemExit) as info:
        _parse([*base, "--drain-signal=SIGNOPE", "train.py"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "etcdrun: error: --drain-signal: 'SIGNOPE' is not a signal; give a name such as "
        "SIGUSR1 or USR1, or a number\n"
    )


def test_hang_timeout_is_off_unless_given() -> None:
    assert _parse(["train.py"]).hang_timeout is None
    assert _parse(["--hang-timeout=2.5", "train.py"]).hang_timeout == 2.5
    assert _parse(["--hang_timeout", "1", "train.py"]).hang_timeout == 1.0
