"""The ``rdzvctl`` command line's syntax: the parser, its help text and its errors.

Syntax only: every value comes out as a string, and :mod:`coordinator.rdzvctl.cli`
checks them. An error, from the main parser or a command's, is one line
``rdzvctl: error: <message>`` and exit code 2 (argparse's own wording, shortened to name
the flag and the fix). The names the help text shows (program, commands, defaults,
password variables, exit codes) live here; ``cli`` re-exports them.

Start-up: imports argparse and the key layout's default prefix only (no grpc, no etcd
client), so ``rdzvctl --help`` answers at once.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from coordinator.core.keys import DEFAULT_KEY_PREFIX

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
    "SHARED_PASSWORD_ENV",
    "build_parser",
]

PROG = "rdzvctl"
COMMANDS = ("status", "watch", "events", "timeline", "list", "close", "drain", "gc")
DEFAULT_ENDPOINT = "127.0.0.1:2379"
DEFAULT_READ_TIMEOUT = 10.0
PASSWORD_ENV = "RDZVCTL_PASSWORD"
# etcdrun's variable (coordinator.core.settings.PASSWORD_ENV; not imported: that loads
# grpc), read after ours so one variable serves both programs.
SHARED_PASSWORD_ENV = "ETCD_ELASTIC_PASSWORD"

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
    """The ``rdzvctl`` parser; every value is a string, checked by
    :func:`coordinator.rdzvctl.cli.parse_args`."""
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
