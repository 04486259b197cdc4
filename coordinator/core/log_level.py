"""The ``LOGLEVEL`` environment variable both programs read (``etcdrun``, ``rdzvctl``).

``logging.basicConfig(level="LOUD")`` raises ``ValueError`` from deep inside logging, so a
typo in an environment variable ended either program with a traceback before it had
parsed its command line. Checked here instead, the mistake is one line naming the
variable and the values it takes.
"""

from __future__ import annotations

import logging

__all__ = ["LOGLEVEL_ENV", "log_level"]

LOGLEVEL_ENV = "LOGLEVEL"
_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str | None, default: str) -> int:
    """The logging level ``text`` names (a name, any case, or a number; empty or None:
    ``default``).

    Raises:
        ValueError: not a level; the message names ``LOGLEVEL`` and what it takes.
    """
    value = (text or "").strip() or default
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if value.upper() in (*_NAMES, "WARN", "FATAL") and isinstance(level, int):
        return level
    raise ValueError(
        f"{LOGLEVEL_ENV}={text!r} is not a log level: use one of {', '.join(_NAMES)} "
        "(or a number), or unset it"
    )
