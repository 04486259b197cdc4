"""The ``etcdrun`` argument parser: torchrun's flags, grouped, with defaults from ``PET_*``.

Only the syntax lives here; :mod:`agent.cli.etcdrun` checks the values. Every value is read as a
string so that the checks, not argparse, word the error messages.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from agent.cli.options import IGNORED_FLAGS, add_options

__all__ = [
    "IGNORED_FLAGS",
    "PROG",
    "build_parser",
    "environment_source",
    "from_environment",
]

PROG = "etcdrun"

# argparse's own wordings, reworded to start with the flag like every other error.
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_ABOUT_FLAG = re.compile(r"argument (-[^/ :]+)(?:/[^ :]+)?: (.*)")

_DESCRIPTION = """\
Start the workers of one node of an elastic PyTorch job, like torchrun, with the
rendezvous kept in etcd (v3 API). Run the same command on every node; nodes that share
--rdzv-endpoint and --rdzv-id form one job. Every flag also takes its default from the
environment variable PET_<FLAG> (e.g. PET_NPROC_PER_NODE=2), and every --flag-name can
be written --flag_name, as in torchrun."""

_EPILOG = """\
examples:
  one machine, two workers, embedded etcd:
    etcdrun --standalone --nproc-per-node=2 train.py --epochs 3
  one to four machines, one worker per GPU, a three-member etcd cluster:
    etcdrun --nnodes=1:4 --nproc-per-node=gpu --rdzv-id=job42 \\
            --rdzv-endpoint=etcd1:2379,etcd2:2379,etcd3:2379 train.py --lr 0.1

exit codes: 0 every worker succeeded; 1 the job failed (restarts exhausted, rendezvous
error); 2 bad command line; 128+N ended by signal N (docs/user-guide.md: every
ending)."""


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def _given(namespace: argparse.Namespace) -> set[str]:
    given: set[str] = namespace.__dict__.setdefault("_given", set())
    return given


class _Store(argparse.Action):
    """Stores a value and notes that the command line gave it (it beats ``PET_*``)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: object, option_string: str | None = None,
    ) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        _given(namespace).add(self.dest)


class _Switch(argparse.Action):
    """A flag without a value (``store_true``) that notes it was given."""

    def __init__(
        self, option_strings: list[str], dest: str, default: object = False,
        help: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: object, option_string: str | None = None,
    ) -> None:  # fmt: skip
        setattr(namespace, self.dest, True)
        _given(namespace).add(self.dest)


def environment_source(ns: argparse.Namespace, dest: str) -> str | None:
    """The ``PET_*`` variable ``dest``'s value came from; None when the command line gave
    it or it is the built-in default."""
    sources: dict[str, str] = getattr(ns, "_from_env", {})
    return sources.get(dest)


def from_environment(ns: argparse.Namespace, flag: str) -> str | None:
    """:func:`environment_source` of the option spelt ``flag`` (e.g. ``--max-restarts``)."""
    return environment_source(ns, flag.lstrip("-").replace("-", "_"))


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line: ``etcdrun: error: <message>``, exit code 2.

    Remembers which defaults came from ``PET_*`` variables (:attr:`env_sources`); after
    parsing, the namespace says which of them the command line did not override
    (:func:`environment_source`), and each switch's text from the environment is read
    as torchrun does (``1``/``0``; ``true``/``false``, ``yes``/``no`` and an empty value
    too), any other text being an error naming the variable."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.env_sources: dict[str, str] = {}
        self.switches: dict[str, str] = {}  # dest -> the flag's name

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        given = _given(ns)
        ns._from_env = {d: v for d, v in self.env_sources.items() if d not in given}
        for dest, flag in self.switches.items():
            value = getattr(ns, dest)
            if isinstance(value, str):
                text = value.strip().lower()
                if text not in _ON + _OFF:
                    self.error(
                        f"{flag} (from {self.env_sources[dest]}): {value!r} is not a switch "
                        "value; give 1 (on) or 0 (off)"
                    )
                setattr(ns, dest, text in _ON)
        return ns, extras

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        unknown = _UNRECOGNIZED.fullmatch(message)
        about_flag = _ABOUT_FLAG.fullmatch(message)
        if unknown:
            message = (
                f"{unknown[1]}: unknown option; see {self.prog} --help "
                "(arguments for the script go after the script)"
            )
        elif about_flag:
            message = f"{about_flag[1]}: {about_flag[2]}"
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Lists each option once, dash spelling only, with its value name once."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        # The underscore spellings work too (the description says so); listing them
        # would double every line of the help.
        names = ", ".join(n for n in action.option_strings if "_" not in n)
        if action.nargs == 0:
            return names
        default = self._get_default_metavar_for_optional(action)
        return f"{names} {self._format_args(action, default)}"


def _dest(names: tuple[str, ...]) -> str:
    long = next((n for n in names if n.startswith("--")), names[0])
    return long.lstrip("-").replace("-", "_")


def build_parser(*, environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Return the ``etcdrun`` argument parser.

    Args:
        environ: where ``PET_<FLAG>`` defaults are read from; default ``os.environ``.

    Returns:
        A parser whose ``error()`` prints one line and exits with code 2. Option values
        are strings (flags are booleans); ``training_script`` may be None (checked later)
        and ``training_script_args`` holds everything after the script.
    """
    env = os.environ if environ is None else environ
    parser = _Parser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )

    def option(
        group: argparse._ArgumentGroup,
        *names: str,
        default: str | None,
        help: str,
        metavar: str | None = None,
        show_default: bool = True,
    ) -> None:
        dest = _dest(names)
        variable = f"PET_{dest.upper()}"
        # An empty variable is an unset one (a scheduler's template with no value).
        given = env.get(variable, "").strip() != ""
        value = env[variable] if given else default
        if given:
            parser.env_sources[dest] = variable
        shown = f" (default: {default or 'none'})" if show_default and default is not None else ""
        group.add_argument(
            *names, dest=dest, default=value, metavar=metavar, help=help + shown, action=_Store
        )

    def flag(group: argparse._ArgumentGroup, *names: str, help: str) -> None:
        dest = _dest(names)
        variable = f"PET_{dest.upper()}"
        if env.get(variable, "").strip():
            parser.env_sources[dest] = variable
        parser.switches[dest] = next(n for n in names if n.startswith("--"))
        default: object = env.get(variable, False)  # the text is read after parsing
        group.add_argument(*names, dest=dest, action=_Switch, default=default, help=help)

    add_options(parser, option, flag)
    return parser
