"""``rdzvctl``'s command line: every bad value gives one pinned line and exit code 2;
good values in either position; durations; and ``--help`` answers without grpc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.rdzvctl.cli import parse_args, parse_duration

ROOT = Path(__file__).resolve().parents[2]

# -- arguments ------------------------------------------------------------------------


def error_of(
    argv: list[str], capsys: pytest.CaptureFixture[str], env: dict[str, str] | None = None
) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, environ=env or {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


COMMANDS = "status, watch, events, timeline, list, close, drain, gc"
ID_RULE = "use 1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], f"give a command: one of {COMMANDS}; see rdzvctl --help"),
        (["stats", "x"], f"'stats' is not a command; use one of {COMMANDS}"),
        (["status"], "RUN: missing; see rdzvctl status --help"),
        (["status", "a/b"], f"RUN: 'a/b' is invalid: {ID_RULE}"),
        (["status", "x", "--bogus"], "--bogus: unknown argument; see rdzvctl --help"),
        (["list", "--endpoints", "h:0"], "--endpoints: 'h:0': '0' is not a port number (1-65535)"),
        (
            ["list", "--endpoints", ""],
            "--endpoints: '' is empty: give the etcd members as host:port[,host:port...]",
        ),
        (
            ["list", "--rdzv-endpoint", "a:1,,b:2"],
            "--endpoints: 'a:1,,b:2': has an empty item (remove the extra ',')",
        ),
        (
            ["list", "--key-prefix", "etcd"],
            "--key-prefix: 'etcd' is invalid: it must start with '/'",
        ),
        (
            ["list", "--key-prefix", "/a/"],
            "--key-prefix: '/a/' is invalid: it must not end with '/'",
        ),
        (["list", "--protocol", "grpc"], "--protocol: 'grpc' is not http or https"),
        (
            ["list", "--endpoints", "https://h:1", "--protocol", "http"],
            "--protocol: 'http' but --endpoints uses https://: make them agree",
        ),
        (["list", "--read-timeout", "0"], "--read-timeout: '0' is not a number of seconds above 0"),
        (
            ["list", "--read-timeout", "soon"],
            "--read-timeout: 'soon' is not a number of seconds above 0",
        ),
        (
            ["list", "--user", "root"],
            "--user: is set without a password: give --password-file FILE or set "
            "$RDZVCTL_PASSWORD or $ETCD_ELASTIC_PASSWORD",
        ),
        (
            ["list", "--password-file", "/nonexistent/pw"],
            "--password-file: '/nonexistent/pw': no such file",
        ),
        (
            ["list", "--user", "u", "--password", "p", "--password-file", __file__],
            "--password: and --password-file are both set: keep --password-file",
        ),
        (["list", "--password", "pw"], "--password: is set without --user: give both or neither"),
        (
            ["list", "--ca-cert", "/nonexistent/ca.pem"],
            "--ca-cert: '/nonexistent/ca.pem': no such file",
        ),
        (["watch", "x", "--count", "0"], "--count: '0' is not a whole number of changes above 0"),
        (["watch", "x", "--timeout", "-1"], "--timeout: '-1' is not a number of seconds above 0"),
        (
            ["close", "x", "--reason", "  "],
            "--reason: is empty: say why the run ends, or leave it out",
        ),
        (["drain", "x"], "NODE: missing; see rdzvctl drain --help"),
        (
            ["drain", "x", "bad/node"],
            "NODE: 'bad/node' is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "starting with a letter or digit",
        ),
        (["events"], "RUN: missing; see rdzvctl events --help"),
        (
            ["events", "x", "--incarnation", "0"],
            "--incarnation: '0' is not a whole number above 0",
        ),
        (["timeline", "x"], "-o/--output: missing; see rdzvctl timeline --help"),
        (
            ["timeline", "x", "-o", "run.txt"],
            "-o: 'run.txt': give a file ending in .png, .svg, .pdf",
        ),
        (
            ["timeline", "x", "-o", "/no/such/dir/run.png"],
            "-o: '/no/such/dir/run.png': folder /no/such/dir does not exist",
        ),
        (["gc"], "--older-than: missing; see rdzvctl gc --help"),
        (
            ["gc", "--older-than", "2 weeks"],
            "--older-than: '2 weeks' is not a duration; give e.g. 90s, 10m, 2h, 7d or 1h30m",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert error_of(argv, capsys) == f"rdzvctl: error: {message}"


def test_timeline_output_must_be_a_writable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pics.png"
    folder.mkdir()
    assert error_of(["timeline", "x", "-o", str(folder)], capsys) == (
        f"rdzvctl: error: -o: {str(folder)!r} is a folder: give a file name"
    )
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert error_of(["timeline", "x", "-o", str(locked / "a.png")], capsys) == (
            f"rdzvctl: error: -o: {str(locked / 'a.png')!r}: folder {locked} is not writable "
            "by this user"
        )
    opts = parse_args(["timeline", "x", "-o", str(tmp_path / "a.SVG")], environ={})
    assert (opts.command, opts.output, opts.follow) == ("timeline", str(tmp_path / "a.SVG"), False)
    assert parse_args(["events", "x", "-f", "--json"], environ={}).follow


def test_tls_file_checks_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    assert error_of(["list", "--cert", str(pem)], capsys) == (
        "rdzvctl: error: --cert: is set without --key: give both or neither"
    )
    assert error_of(["list", "--ca-cert", str(pem)], capsys) == (
        "rdzvctl: error: --ca-cert: is set but the protocol is http: add --protocol=https"
    )


def test_good_arguments_in_either_position() -> None:
    before = parse_args(["--endpoints", "h1:1,h2", "--json", "status", "job-1"], environ={})
    after = parse_args(["status", "job-1", "--endpoints=h1:1,h2", "--json"], environ={})
    assert before == after
    assert before.etcd.endpoints == ("h1:1", "h2:2379")
    assert before.json and before.run == "job-1" and before.key_prefix == "/etcd-elastic"
    assert before.etcd.retry_budget == 10.0 and before.etcd.request_timeout == 5.0


def test_defaults_password_from_env_and_https_from_scheme() -> None:
    opts = parse_args(
        ["list", "--endpoints", "https://e:2379", "--user", "ops", "--read-timeout", "2"],
        environ={"RDZVCTL_PASSWORD": "s3cret"},
    )
    assert (opts.etcd.protocol, opts.etcd.user, opts.etcd.password) == ("https", "ops", "s3cret")
    assert (opts.etcd.request_timeout, opts.etcd.retry_budget) == (2.0, 2.0)
    plain = parse_args(["list"], environ={})
    assert plain.etcd.endpoints == ("127.0.0.1:2379",) and plain.etcd.password is None


def test_command_options() -> None:
    watch = parse_args(["watch", "r", "--count", "3", "--timeout", "1.5"], environ={})
    assert (watch.count, watch.timeout) == (3, 1.5)
    close = parse_args(["close", "r", "--reason", " maintenance   window "], environ={})
    assert close.reason == "maintenance window"
    gc = parse_args(["gc", "--older-than", "1h30m", "--dry-run"], environ={})
    assert (gc.older_than, gc.dry_run) == (5400.0, True)
    assert parse_args(["events", "r", "--incarnation", "2"], environ={}).incarnation == 2
    assert parse_args(["events", "r"], environ={}).incarnation is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("30s", 30),
        ("10m", 600),
        ("2h", 7200),
        ("7d", 604800),
        ("1h30m", 5400),
        ("0", 0),
        ("1.5m", 90),
        ("2H", 7200),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1w", "-1s", "1 h", "1h-"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


# -- start-up ------------------------------------------------------------------------


def test_help_answers_without_grpc_or_the_etcd_client() -> None:
    # rdzvctl --help must start fast (docs/performance.md): it needs the parser only, not
    # grpc, protobuf or the etcd client, which the commands that connect import later.
    heavy = ("grpc", "etcd3", "google.protobuf", "torch", "coordinator.core.etcd_client")
    code = (
        "import sys\n"
        "from coordinator.rdzvctl import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: rdzvctl ")
    assert done.stdout.splitlines()[-1] == "[]"


def test_password_file_and_the_shared_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.core.settings import PASSWORD_ENV
    from coordinator.rdzvctl.cli import SHARED_PASSWORD_ENV

    assert SHARED_PASSWORD_ENV == PASSWORD_ENV
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    env = {"ETCD_ELASTIC_PASSWORD": "shared", "RDZVCTL_PASSWORD": "own"}
    by_file = parse_args(["list", "--user", "ops", "--password-file", str(secret)], environ=env)
    assert (by_file.etcd.password, by_file.etcd.password_file) == (None, str(secret))
    own = parse_args(["list", "--user", "ops"], environ=env)
    assert own.etcd.password == "own" and "own" not in repr(own)
    shared = parse_args(["list", "--user", "ops"], environ={"ETCD_ELASTIC_PASSWORD": "shared"})
    assert shared.etcd.password == "shared" and "shared" not in repr(shared)
    with pytest.raises(SystemExit):
        parse_args(["list", "--password-file", str(secret)], environ={})
    assert capsys.readouterr().err == (
        "rdzvctl: error: --password-file: is set without --user: give both or neither\n"
    )
