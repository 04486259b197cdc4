"""Which etcd failures a node's join outlasts, and which end it at once.

A join (and the counted restart before it) needs etcd: the node's key, its first watch,
the state's restart count. When etcd fails one of those calls, :func:`retry_until` tries
it again until the join's deadline, or gives up now:

* **etcd unreachable** (``EtcdConnectionError``): tried again with a backoff; etcd comes
  back (DESIGN §9: the agent waits, bounded by a documented setting, ``join_timeout``).
* **a wrong credential or a TLS mismatch** (``EtcdAuthError``, ``EtcdTLSError``): given up
  at once: it does not heal by waiting (a password being rotated through its file is
  already read again by the etcd client, for up to ``read_timeout``).
* **a permission refused** (``EtcdPermissionError``) to a node that had it (it wrote its
  key before): tried again, as etcd being away is. The role's grant was there and can come
  back without the node changing anything: an operator's or a configuration tool's RBAC
  change (a permission revoked and granted again, a role deleted and created again).
  Said once per episode. Refused to a node that never had it (a role without the grant):
  given up at once, naming the permission.

Pure but for ``sleep``; the clock and the jitter are injected.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import TypeVar

from coordinator.core.errors import (
    EtcdAuthError,
    EtcdConnectionError,
    EtcdPermissionError,
    EtcdTLSError,
)
from coordinator.core.etcd_client import backoff_delay

__all__ = ["retry_until"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def retry_until(
    call: Callable[[], T],
    deadline: float,
    *,
    doing: str,
    permitted: Callable[[], bool],
    unreachable_too: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    jitter: Callable[[], float] = lambda: secrets.randbelow(1000) / 1000,
) -> T:
    """``call()``, tried again after the failures above until ``deadline`` (then the last
    one is raised).

    Args:
        doing: what the call does, for the log ("node X: asking for round 3 of run Y").
        permitted: whether this node was ever allowed what it asks (it wrote its key).
        unreachable_too: whether etcd unreachable is tried again too (False: only a
            permission that came back is waited for).

    Raises:
        EtcdConnectionError: the last failure, once ``deadline`` passed (or at once, see
            the module's docstring).
    """
    failures = 0
    refused = False
    while True:
        try:
            result = call()
        except EtcdPermissionError as exc:
            if not permitted() or clock() >= deadline:
                raise
            if not refused:
                log.warning(
                    "%s: etcd refuses it (%s); this node had that permission: waiting for "
                    "it to be granted again, up to %.0f s", doing, exc, deadline - clock(),
                )  # fmt: skip
            refused = True
            delay = _delay(failures, deadline, clock, jitter)
        except (EtcdAuthError, EtcdTLSError):
            raise  # a wrong credential does not heal by waiting
        except EtcdConnectionError as exc:
            if not unreachable_too or clock() >= deadline:
                raise
            delay = _delay(failures, deadline, clock, jitter)
            log.warning("%s failed (%s); trying again in %.1f s", doing, exc, delay)
        else:
            if refused:
                log.warning("%s: etcd permits it again", doing)
            return result
        sleep(delay)
        failures += 1


def _delay(
    failures: int, deadline: float, clock: Callable[[], float], jitter: Callable[[], float]
) -> float:
    """The back-off after ``failures`` failed tries, never past ``deadline``."""
    return max(0.0, min(deadline - clock(), backoff_delay(failures, jitter())))
