"""The values of ``etcdrun``'s flags: each parser takes the text of one flag and returns
its value, or raises :class:`UsageError` naming the flag, what is wrong and what to give.

Pure functions (no I/O), kept apart from :mod:`agent.cli.etcdrun`, which wires them to argparse.
"""

from __future__ import annotations

import math
import re
import signal

from agent.config import Std

__all__ = [
    "MIN_HANG_TIMEOUT",
    "UsageError",
    "parse_hang_timeout",
    "parse_metrics",
    "parse_modules",
    "parse_nnodes",
    "parse_ranks_filter",
    "parse_rdzv_conf",
    "parse_seconds",
    "parse_signal",
    "parse_std_map",
    "parse_whole",
]

_STD_VALUE = re.compile(r"[0-3]")
_STD_MAPPING = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


class UsageError(ValueError):
    """A command-line value is invalid: ``flag`` names the option, ``reason`` the fix."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


def parse_nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) > 2:
        raise UsageError("--nnodes", f"{text!r} is not N or MIN:MAX; give e.g. 2 or 1:4")
    numbers: list[int] = []
    for part in parts:
        try:
            numbers.append(int(part))
        except ValueError:
            raise UsageError(
                "--nnodes", f"{text!r} is not a number of nodes; give N or MIN:MAX, e.g. 2 or 1:4"
            ) from None
    low, high = numbers[0], numbers[-1]
    if low < 1:
        raise UsageError(
            "--nnodes", f"{text!r} allows {low} nodes; a job needs at least 1, e.g. 2 or 1:4"
        )
    if low > high:
        raise UsageError(
            "--nnodes",
            f"minimum {low} is greater than maximum {high}; give MIN:MAX with MIN <= MAX",
        )
    return low, high


def parse_whole(flag: str, text: str, *, low: int, high: int | None = None, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(flag, f"{text!r} is not a whole number; give {what}") from None
    if value < low or (high is not None and value > high):
        raise UsageError(flag, f"{value} is out of range; give {what}")
    return value


def parse_seconds(flag: str, text: str, *, zero_ok: bool) -> float:
    what = "0 or more seconds" if zero_ok else "a number of seconds above 0"
    try:
        value = float(text)
    except ValueError:
        raise UsageError(flag, f"{text!r} is not a number; give {what}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise UsageError(flag, f"{text!r} is out of range; give {what}")
    return value


MIN_HANG_TIMEOUT = 1.0
"""The shortest --hang-timeout: progress reaches etcd at most once a second, and the
node that declares a hang must see the others' last steps to name who stopped first."""


def parse_hang_timeout(text: str) -> float:
    """``--hang-timeout``: seconds, at least :data:`MIN_HANG_TIMEOUT`."""
    what = f"a number of seconds of at least {MIN_HANG_TIMEOUT:g} (leave the flag out: off)"
    try:
        value = float(text)
    except ValueError:
        raise UsageError("--hang-timeout", f"{text!r} is not a number; give {what}") from None
    if not math.isfinite(value) or value < MIN_HANG_TIMEOUT:
        raise UsageError("--hang-timeout", f"{text!r} is out of range; give {what}")
    return value


def parse_rdzv_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise UsageError(
                "--rdzv-conf",
                f"{item!r} is not key=value; give pairs separated by commas, "
                "e.g. join_timeout=600,lease_ttl=5",
            )
        if not value:
            raise UsageError("--rdzv-conf", f"{key!r} has no value; give {key}=<value>")
        conf[key] = value
    return conf


def parse_std_map(flag: str, text: str, nproc: int) -> dict[int, Std]:
    """torch's ``Std.from_str`` then ``to_map``: every local rank gets a value."""
    text = text.strip()
    if _STD_VALUE.fullmatch(text):
        return dict.fromkeys(range(nproc), int(text))
    if _STD_MAPPING.fullmatch(text):
        given = {int(r): int(v) for r, v in (pair.split(":") for pair in text.split(","))}
        # As in torch: ranks not named get 0 (nothing redirected); ranks beyond this
        # node's worker count are ignored, so one command line fits nodes of any size.
        return {rank: given.get(rank, 0) for rank in range(nproc)}
    raise UsageError(
        flag,
        f"{text!r} is neither 0-3 nor LOCAL_RANK:0-3 pairs; give e.g. 3 (stdout and stderr "
        "of every worker) or 0:1,1:2 (stdout of rank 0, stderr of rank 1)",
    )


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        ranks = frozenset({-1})
    if min(ranks) < 0:
        raise UsageError(
            "--local-ranks-filter",
            f"{text!r} is not a list of local ranks; give comma-separated numbers, e.g. 0,1",
        )
    return ranks


def parse_modules(flag: str, text: str) -> tuple[str, ...]:
    """A comma-separated list of dotted module names (``torch,numpy``); empty: none.

    Raises:
        UsageError: a name that is not a dotted Python identifier.
    """
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if not all(piece.isidentifier() for piece in name.split(".")):
            raise UsageError(flag, f"{name!r} is not a module name; give e.g. torch,numpy")
    return names


def parse_signal(flag: str, text: str) -> signal.Signals:
    """A signal by name (``SIGUSR1``, ``USR1``, any case) or number."""
    name = text.strip().upper()
    try:
        if name.isdigit():
            return signal.Signals(int(name))
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise UsageError(
            flag, f"{text!r} is not a signal; give a name such as SIGUSR1 or USR1, or a number"
        ) from None


def parse_metrics(port: str | None, addr: str) -> tuple[int | None, str]:
    """``--metrics-port`` (None or empty: off) and ``--metrics-addr`` -> (port, address)."""
    addr = addr.strip()
    if not addr:
        raise UsageError("--metrics-addr", "is empty; give an address, e.g. 127.0.0.1 or 0.0.0.0")
    if port is None or not port.strip():
        if addr != "127.0.0.1":
            raise UsageError(
                "--metrics-addr",
                f"{addr} serves nothing without --metrics-port; add --metrics-port=PORT "
                "(0: any free port)",
            )
        return None, addr
    what = "a port 0-65535 (0: any free one)"
    return parse_whole("--metrics-port", port, low=0, high=65535, what=what), addr
