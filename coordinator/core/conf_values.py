"""How ``rdzv_conf`` values are read: seconds, whole numbers, text, a readable file, the
protocol; and which keys are unknown.

Values arrive as strings from the command line, or as numbers when a program builds
torch's ``RendezvousParameters``. Each reader returns the typed value or raises a
:class:`~coordinator.core.errors.ConfigError` naming the key and the value it got.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Set
from typing import Any, TypeVar

from coordinator.core.errors import ConfigError

__all__ = [
    "check_file",
    "check_unknown",
    "read_or_default",
    "read_protocol",
    "read_seconds",
    "read_text",
    "read_whole_number",
    "read_whole_seconds",
]

T = TypeVar("T")


def read_seconds(key: str, value: object) -> float:
    """``value`` as seconds: any finite number (``"2.5"``, ``30``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a number of seconds")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a number of seconds") from None
    if not math.isfinite(number):
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a finite number of seconds")
    return number


def read_whole_seconds(key: str, value: object) -> int:
    """``value`` as a whole number of seconds (``"5"``, ``5``, ``5.0``; not a bool)."""
    if isinstance(value, bool):
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a whole number of seconds")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ConfigError(f"rdzv_conf {key}={value!r} is not a whole number of seconds")


def read_whole_number(key: str, value: object) -> int:
    """``value`` as a whole number (of anything but seconds: the message says so)."""
    try:
        return read_whole_seconds(key, value)
    except ConfigError:
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a whole number") from None


def read_text(key: str, value: object) -> str | None:
    """``value`` as text; None when absent or empty."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"rdzv_conf {key}={value!r} must be text")
    return value or None


def check_file(key: str, path: str | None) -> None:
    """Raise unless ``path`` (when given) is a file this user can read."""
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError(f"rdzv_conf {key}={path!r}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"rdzv_conf {key}={path!r}: file is not readable by this user")


def check_unknown(conf: Mapping[str, Any], known: Set[str]) -> None:
    """Raise unless every key of ``conf`` is ``known``: the message lists the known keys
    and, for one unknown key, the closest known one."""
    unknown = sorted(k for k in conf if k not in known)
    if not unknown:
        return
    hint = ""
    if len(unknown) == 1:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"rdzv_conf has unknown key{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(repr(k) for k in unknown)}{hint}; known keys: "
        f"{', '.join(sorted(known))}"
    )


def read_or_default(
    conf: Mapping[str, Any], key: str, read: Callable[[str, object], T], default: T
) -> T:
    """``conf[key]`` read by ``read``; ``default`` when absent or None."""
    raw = conf.get(key)
    return default if raw is None else read(key, raw)


def read_protocol(conf: Mapping[str, Any], endpoint: str, scheme: str | None) -> str:
    """``protocol`` as given, else the scheme of the endpoints (``scheme``, as written in
    ``endpoint``), else http; a protocol given must agree with that scheme."""
    protocol_raw = read_text("protocol", conf.get("protocol"))
    protocol = protocol_raw.strip().lower() if protocol_raw else (scheme or "http")
    if protocol not in ("http", "https"):
        raise ConfigError(f"rdzv_conf protocol={protocol_raw!r} must be 'http' or 'https'")
    if scheme is not None and protocol != scheme:
        raise ConfigError(
            f"rdzv_endpoint {endpoint!r} uses {scheme}:// but rdzv_conf "
            f"protocol={protocol_raw!r}: make them agree"
        )
    return protocol
