"""The ``rdzvctl`` command line: parser and value checks (no I/O).

Every bad value ends the program before anything connects, with exit code 2 and one
line ``rdzvctl: error: <flag>: <what is wrong and what to do>``. The checks reuse the
rendezvous' own validators (run id, key prefix, endpoints), so ``rdzvctl`` accepts
exactly what ``etcdrun`` accepts.

Start-up: ``rdzvctl --help`` must not pay for grpc and the etcd client (about 150 ms of
imports), so this module imports neither; the checks that need the client's config type
import it once the command line has parsed (see :func:`_etcd_config`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NoReturn

from coordinator.core.errors import ConfigError
from coordinator.core.keys import (
    DEFAULT_KEY_PREFIX,
    validate_key_prefix,
    validate_node_id,
    validate_run_id,
)

if TYPE_CHECKING:
    from coordinator.core.etcd_client import EtcdConfig

__all__ = [
    "COMMANDS",
    "DEFAULT_ENDPOINT",
    "DEFAULT_READ_TIMEOUT",
    "EXIT_BAD_ARGS",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "PASSWORD_ENV",
    "PROG",
    "Options",
    "UsageError",
    "build_parser",
    "parse_args",
    "parse_duration",
]

PROG = "rdzvctl"
COMMANDS = ("status", "watch", "events", "timeline", "list", "close", "drain", "gc")
# What rdzvctl timeline can write (matplotlib's formats that open anywhere).
TIMELINE_FORMATS = (".png", ".svg", ".pdf")
DEFAULT_ENDPOINT = "127.0.0.1:2379"
DEFAULT_READ_TIMEOUT = 10.0
PASSWORD_ENV = "RDZVCTL_PASSWORD"
# etcdrun's variable (coordinator.core.settings.PASSWORD_ENV; not imported: that loads
# grpc), read after ours so one variable serves both programs.
SHARED_PASSWORD_ENV = "ETCD_ELASTIC_PASSWORD"
# One unary RPC attempt never waits longer than this; --read-timeout bounds the retries.
_MAX_REQUEST_TIMEOUT = 5.0

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_ARGS = 2
EXIT_UNREACHABLE = 3

_DESCRIPTION = """\
Inspect and manage etcd-elastic runs: the rendezvous state that etcdrun agents keep in
etcd (v3 API). Read commands (status, watch, list, gc --dry-run) never write; close,
drain and gc write only with compare-and-swap on the state key, and never touch a live
node's key."""

_EPILOG = f"""\
commands:
  status RUN        round, state, participants with rank, host, pid, workers and lease
                    time left; wait, redundancy and lost lists; closed; nodes alive
  watch RUN         one line per change, as it happens, until Ctrl-C (or --count/--timeout)
  events RUN        the run's timeline in order: joins, departures with their cause,
                    rounds with ranks, restarts with their root cause, closes;
                    --follow prints new ones until Ctrl-C; --json one object per line;
                    of the newest incarnation (--incarnation N: that one)
  timeline RUN -o F draw that timeline (F: .png, .svg or .pdf): nodes against time,
                    rounds as bands, faults marked (needs matplotlib)
  list              every run under --key-prefix with its state
  close RUN         end the run: agents finish their current attempt and exit 0;
                    no node joins it again (once all have left, the same run id
                    starts a new incarnation)
  drain RUN NODE    ask one node to leave: its workers get the agent's --drain-signal
                    and grace, its lease is revoked at once, the others re-form
                    without it (not a counted restart), and that agent exits 0
  gc --older-than D remove the keys of closed or abandoned runs (no node alive) whose
                    last round completed at least D ago (90s, 10m, 2h, 7d); --dry-run
                    lists what would go. A run with a live node key is never touched.

connection flags (--endpoints, --key-prefix, --protocol, --ca-cert, --cert, --key,
--user, --password-file, --read-timeout, --json) go before or after the command. The
password comes from --password-file FILE, else ${PASSWORD_ENV}, else ${SHARED_PASSWORD_ENV};
--password PASSWORD works too but every user of the machine sees it in ps.

exit codes:
  0  done
  1  run not found, a value under the run does not decode, or the operation failed
  2  bad command line (one line: rdzvctl: error: ...)
  3  etcd unreachable, TLS or credentials refused (the message names the endpoints)"""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90``, ``30s``, ``10m``, ``2h``, ``7d`` or sums like ``1h30m``.

    Raises:
        ValueError: not a duration; the message names the text and shows the forms.
    """
    rest = text.strip().lower()
    total = 0.0
    pos = 0
    while pos < len(rest):
        match = _DURATION_PART.match(rest, pos)
        if match is None:
            total = -1.0
            break
        total += float(match[1]) * _UNIT_SECONDS[match[2]]
        pos = match.end()
    if not rest or total < 0:
        raise ValueError(f"{text!r} is not a duration; give e.g. 90s, 10m, 2h, 7d or 1h30m")
    return total


class UsageError(ValueError):
    """A command-line value is invalid: ``flag`` names the option, ``reason`` the fix."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_ABOUT_FLAG = re.compile(r"argument (-[^/ :]+)(?:/[^ :]+)?: (.*)")
_INVALID_CHOICE = re.compile(r"argument (\w+): invalid choice: '([^']*)'.*")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line ``rdzvctl: error: <message>`` and exit code 2,
    from the main parser and from every command's parser alike."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        unknown = _UNRECOGNIZED.fullmatch(message)
        about_flag = _ABOUT_FLAG.fullmatch(message)
        bad_choice = _INVALID_CHOICE.fullmatch(message)
        if unknown:
            message = f"{unknown[1]}: unknown argument; see {PROG} --help"
        elif bad_choice and bad_choice[1] == "COMMAND":
            message = f"{bad_choice[2]!r} is not a command; use one of {', '.join(COMMANDS)}"
        elif message.startswith("the following arguments are required: COMMAND"):
            message = f"give a command: one of {', '.join(COMMANDS)}; see {PROG} --help"
        elif message.startswith("the following arguments are required: "):
            missing = message.split(": ", 1)[1]
            message = f"{missing}: missing; see {self.prog} --help"
        elif about_flag:
            message = f"{about_flag[1]}: {about_flag[2]}"
        self.exit(EXIT_BAD_ARGS, f"{PROG}: error: {message}\n")


def _add_common(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a flag given before the command must not be reset by the command's
    # parser; defaults are filled in once both have parsed.
    group = parser.add_argument_group("connection")
    s = argparse.SUPPRESS
    group.add_argument(
        "--endpoints", "--rdzv-endpoint", "--rdzv_endpoint", dest="endpoints", default=s,
        metavar="HOST:PORT[,HOST:PORT...]",
        help=f"etcd members, port 2379 unless given (default: {DEFAULT_ENDPOINT})",
    )  # fmt: skip
    group.add_argument(
        "--key-prefix", dest="key_prefix", default=s, metavar="PREFIX",
        help=f"etcd folder holding every run (default: {DEFAULT_KEY_PREFIX})",
    )  # fmt: skip
    group.add_argument(
        "--protocol", dest="protocol", default=s, metavar="http|https",
        help="http or https (default: https if an endpoint says https://, else http)",
    )  # fmt: skip
    group.add_argument("--ca-cert", dest="ca_cert", default=s, metavar="FILE",
                       help="CA bundle that signed the etcd server certificates")  # fmt: skip
    group.add_argument("--cert", dest="cert", default=s, metavar="FILE",
                       help="client certificate (with --key)")  # fmt: skip
    group.add_argument("--key", dest="key", default=s, metavar="FILE",
                       help="client certificate's key (with --cert)")  # fmt: skip
    group.add_argument("--user", dest="user", default=s, metavar="NAME",
                       help="etcd user (its password: --password-file or "
                       f"${PASSWORD_ENV} or ${SHARED_PASSWORD_ENV})")  # fmt: skip
    group.add_argument("--password-file", dest="password_file", default=s, metavar="FILE",
                       help="file holding the etcd password (one line)")  # fmt: skip
    group.add_argument(
        "--password", dest="password", default=s, metavar="PASSWORD",
        help="etcd password; avoid it: the command line is visible to other users",
    )  # fmt: skip
    group.add_argument(
        "--read-timeout", dest="read_timeout", default=s, metavar="SECONDS",
        help=f"how long one etcd call may retry, failover included "
        f"(default: {DEFAULT_READ_TIMEOUT:g})",
    )  # fmt: skip
    group.add_argument("--json", dest="json", action="store_true", default=s,
                       help="print JSON (watch: one JSON object per line)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``rdzvctl`` parser; every value is a string, checked by :func:`parse_args`."""
    parser = _Parser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        _add_common(sub)
        return sub

    status = command("status", "show one run: round, participants, lists, nodes alive")
    status.add_argument("run", metavar="RUN", help="the run id (--rdzv-id of the agents)")
    watch = command("watch", "print one line per change of a run, until Ctrl-C")
    watch.add_argument("run", metavar="RUN", help="the run id (--rdzv-id of the agents)")
    watch.add_argument("--count", metavar="N", default=None,
                       help="stop after N changes")  # fmt: skip
    watch.add_argument("--timeout", metavar="SECONDS", default=None,
                       help="stop after this many seconds")  # fmt: skip
    events = command("events", "print a run's timeline in order (joins, rounds, faults)")
    events.add_argument("run", metavar="RUN", help="the run id (--rdzv-id of the agents)")
    events.add_argument("--follow", "-f", dest="follow", action="store_true",
                        help="then print new events as they are written, until Ctrl-C")  # fmt: skip
    timeline = command("timeline", "draw a run's timeline: nodes against time, rounds, faults")
    timeline.add_argument("run", metavar="RUN", help="the run id (--rdzv-id of the agents)")
    timeline.add_argument("-o", "--output", dest="output", metavar="FILE", required=True,
                          help="the picture to write: .png, .svg or .pdf")  # fmt: skip
    for sub in (events, timeline):
        sub.add_argument("--incarnation", metavar="N", default=None,
                         help="that start of the run (default: the newest)")  # fmt: skip
    command("list", "list the runs under the key prefix with their state")
    close = command("close", "end a run: agents finish their current attempt and exit 0")
    close.add_argument("run", metavar="RUN", help="the run id (--rdzv-id of the agents)")
    close.add_argument("--reason", metavar="TEXT", default=None,
                       help="shown to every agent and in status (default: closed by an "
                       "operator with rdzvctl on <host>)")  # fmt: skip
    drain = command("drain", "ask one node of a run to leave gracefully; its agent exits 0")
    drain.add_argument("run", metavar="RUN", help="the run id (--rdzv-id of the agents)")
    drain.add_argument("node", metavar="NODE", help="the node id (see rdzvctl status RUN)")
    gc = command("gc", "remove the keys of closed or abandoned runs older than an age")
    gc.add_argument("--older-than", dest="older_than", metavar="DURATION", required=True,
                    help="least age since the last round completed: 90s, 10m, 2h, 7d")  # fmt: skip
    gc.add_argument("--dry-run", dest="dry_run", action="store_true",
                    help="list what would be removed, remove nothing")  # fmt: skip
    return parser


@dataclass(frozen=True)
class Options:
    """A checked ``rdzvctl`` command line."""

    command: str
    etcd: EtcdConfig
    key_prefix: str
    json: bool = False
    run: str | None = None
    node: str | None = None
    count: int | None = None
    timeout: float | None = None
    reason: str | None = None
    older_than: float = 0.0
    dry_run: bool = False
    follow: bool = False
    output: str | None = None
    incarnation: int | None = None


def _reword(exc: ConfigError, old: str, new: str) -> str:
    # The shared validators name etcdrun's settings; rdzvctl's flags are named otherwise.
    text = str(exc)
    return new + text[len(old) :] if text.startswith(old) else text


def _positive_seconds(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(flag, f"{text!r} is not a number of seconds above 0")
    return value


def _file(flag: str, path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise UsageError(flag, f"{path!r}: no such file")
    if not os.access(path, os.R_OK):
        raise UsageError(flag, f"{path!r}: file is not readable by this user")
    return path


def _output(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in TIMELINE_FORMATS:
        raise UsageError("-o", f"{path!r}: give a file ending in {', '.join(TIMELINE_FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError("-o", f"{path!r}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError("-o", f"{path!r}: folder {folder} is not writable by this user")
    if os.path.isdir(path):
        raise UsageError("-o", f"{path!r} is a folder: give a file name")
    return path


def _protocol(given: str | None, endpoints_text: str) -> Literal["http", "https"]:
    schemes = {
        item.strip().lower().split("://", 1)[0]
        for item in endpoints_text.split(",")
        if "://" in item
    }
    scheme = schemes.pop() if len(schemes) == 1 else None
    chosen = (given or scheme or "http").strip().lower()
    if chosen not in ("http", "https"):
        raise UsageError("--protocol", f"{given!r} is not http or https")
    if scheme is not None and chosen != scheme:
        raise UsageError(
            "--protocol", f"{given!r} but --endpoints uses {scheme}://: make them agree"
        )
    return "https" if chosen == "https" else "http"


def _etcd_config(ns: Mapping[str, object], environ: Mapping[str, str]) -> EtcdConfig:
    # Here, not at the top: both modules load grpc (core.settings through the etcd
    # client package), which only a command that connects needs.
    from coordinator.core.etcd_client import EtcdConfig
    from coordinator.core.settings import parse_endpoints

    def text(name: str) -> str | None:
        value = ns.get(name)
        return value if isinstance(value, str) and value else None

    given = ns.get("endpoints")
    endpoints_text = given if isinstance(given, str) else DEFAULT_ENDPOINT
    try:
        endpoints = parse_endpoints(endpoints_text)
    except ConfigError as exc:
        raise UsageError("--endpoints", _reword(exc, "rdzv_endpoint ", "")) from None
    protocol = _protocol(text("protocol"), endpoints_text)
    ca_cert, cert, key = (
        _file(f"--{n.replace('_', '-')}", text(n)) for n in ("ca_cert", "cert", "key")
    )
    if (cert is None) != (key is None):
        given, missing = ("--cert", "--key") if cert else ("--key", "--cert")
        raise UsageError(given, f"is set without {missing}: give both or neither")
    if protocol == "http" and (ca_cert or cert):
        flag = "--ca-cert" if ca_cert else "--cert"
        raise UsageError(flag, "is set but the protocol is http: add --protocol=https")
    user = text("user")
    password_file = _file("--password-file", text("password_file"))
    if text("password") is not None and password_file is not None:
        raise UsageError("--password", "and --password-file are both set: keep --password-file")
    password = (
        None
        if password_file is not None
        else text("password")
        or environ.get(PASSWORD_ENV)
        or environ.get(SHARED_PASSWORD_ENV)
        or None
    )
    for flag, given in (("--password", text("password")), ("--password-file", password_file)):
        if user is None and given is not None:
            raise UsageError(flag, "is set without --user: give both or neither")
    if user is not None and password is None and password_file is None:
        raise UsageError(
            "--user",
            f"is set without a password: give --password-file FILE or set ${PASSWORD_ENV} "
            f"or ${SHARED_PASSWORD_ENV}",
        )
    read_timeout = _positive_seconds("--read-timeout", text("read_timeout") or "10")
    return EtcdConfig(
        endpoints=endpoints,
        protocol=protocol,
        ca_cert=ca_cert,
        cert=cert,
        cert_key=key,
        user=user,
        password=password if user is not None else None,
        password_file=password_file if user is not None else None,
        request_timeout=min(_MAX_REQUEST_TIMEOUT, read_timeout),
        retry_budget=read_timeout,
    )


def _check(ns: argparse.Namespace, environ: Mapping[str, str]) -> Options:
    values = vars(ns)
    etcd = _etcd_config(values, environ)
    try:
        key_prefix = validate_key_prefix(values.get("key_prefix") or DEFAULT_KEY_PREFIX)
    except ConfigError as exc:
        raise UsageError("--key-prefix", _reword(exc, "rdzv_conf key_prefix=", "")) from None
    run = values.get("run")
    if run is not None:
        try:
            validate_run_id(run)
        except ConfigError as exc:
            raise UsageError("RUN", _reword(exc, "rdzv_id ", "")) from None
    node = values.get("node")
    if node is not None:
        try:
            validate_node_id(node)
        except ConfigError as exc:
            raise UsageError("NODE", _reword(exc, "node id ", "")) from None
    count = None
    if values.get("count") is not None:
        text = values["count"]
        if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
            raise UsageError("--count", f"{text!r} is not a whole number of changes above 0")
        count = int(text)
    timeout = None
    if values.get("timeout") is not None:
        timeout = _positive_seconds("--timeout", values["timeout"])
    older_than = 0.0
    if values.get("older_than") is not None:
        try:
            older_than = parse_duration(values["older_than"])
        except ValueError as exc:
            raise UsageError("--older-than", str(exc)) from None
    incarnation = values.get("incarnation")
    if incarnation is not None and not re.fullmatch(r"\s*[1-9]\d{0,9}\s*", incarnation):
        raise UsageError("--incarnation", f"{incarnation!r} is not a whole number above 0")
    reason = values.get("reason")
    if reason is not None and not reason.strip():
        raise UsageError("--reason", "is empty: say why the run ends, or leave it out")
    return Options(
        command=ns.command,
        etcd=etcd,
        key_prefix=key_prefix,
        json=bool(values.get("json", False)),
        run=run,
        node=node,
        count=count,
        timeout=timeout,
        reason=" ".join(reason.split()) if reason is not None else None,
        older_than=older_than,
        dry_run=bool(values.get("dry_run", False)),
        follow=bool(values.get("follow", False)),
        output=_output(values["output"]) if values.get("output") is not None else None,
        incarnation=int(incarnation) if incarnation is not None else None,
    )


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Options:
    """Parse and check a command line.

    Raises:
        SystemExit: code 2 after printing one ``rdzvctl: error: …`` line (bad syntax or
            value), or code 0 after ``--help``.
    """
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    try:
        return _check(ns, os.environ if environ is None else environ)
    except (UsageError, ConfigError) as exc:
        parser.error(str(exc))
