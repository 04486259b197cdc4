"""The core's errors as torch's types, for torch's callers (its agent and ours).

Each class has the core's name and subclasses both the core class and the torch error a
caller catches, so ``except coordinator.core.errors.RunClosedError`` and ``except
torch…RendezvousClosedError`` both hold::

    torch RendezvousError
    ├── RendezvousClosedError      ← RunClosedError
    ├── RendezvousGracefulExitError ← RunEndedWhileWaitingError (also a RunClosedError)
    ├── RendezvousTimeoutError     ← JoinTimeoutError
    ├── RendezvousConnectionError  ← EtcdConnectionError ← EtcdAuthError, EtcdTLSError
    ├── RendezvousStateError       ← CorruptValueError
    ├── LeaseLostError
    ├── NodeLeftError
    └── RendezvousFailedError      any other core error

The Store's callers (torch's ``elastic.utils.store``, its agent, ours) catch torch's
store errors, not rendezvous errors, so a Store raises these instead::

    torch DistError (RuntimeError)
    ├── DistStoreError ─┬─ StoreConnectionError  ← EtcdConnectionError (etcd away)
    └── DistNetworkError┘  ├── StoreAuthError    ← EtcdAuthError (no permission on store/)
                           └── StoreTLSError     ← EtcdTLSError
    DistStoreError ─────── StoreFailedError      ← any other core error

:func:`torch_errors` (the handler's public methods) and :func:`store_errors` (the Store's)
are the one boundary: each re-raises a core error as its torch-typed twin (same message,
same attributes, same traceback).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from torch.distributed import DistError, DistNetworkError, DistStoreError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from coordinator.core import errors as core

__all__ = [
    "CorruptValueError",
    "EtcdAuthError",
    "EtcdConnectionError",
    "EtcdTLSError",
    "JoinTimeoutError",
    "LeaseLostError",
    "NodeLeftError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousFailedError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RunClosedError",
    "RunEndedWhileWaitingError",
    "StoreAuthError",
    "StoreConnectionError",
    "StoreFailedError",
    "StoreTLSError",
    "as_store_error",
    "as_torch_error",
    "store_errors",
    "torch_errors",
]


class RunClosedError(core.RunClosedError, RendezvousClosedError):
    """See :class:`coordinator.core.errors.RunClosedError`."""


class RunEndedWhileWaitingError(core.RunEndedWhileWaitingError, RendezvousGracefulExitError):
    """See :class:`coordinator.core.errors.RunEndedWhileWaitingError`; torch's agent
    exits 0 on it."""


class JoinTimeoutError(core.JoinTimeoutError, RendezvousTimeoutError):
    """See :class:`coordinator.core.errors.JoinTimeoutError`."""


class EtcdConnectionError(core.EtcdConnectionError, RendezvousConnectionError):
    """See :class:`coordinator.core.errors.EtcdConnectionError`."""


class EtcdAuthError(core.EtcdAuthError, EtcdConnectionError):
    """See :class:`coordinator.core.errors.EtcdAuthError`."""


class EtcdTLSError(core.EtcdTLSError, EtcdConnectionError):
    """See :class:`coordinator.core.errors.EtcdTLSError`."""


class CorruptValueError(core.CorruptValueError, RendezvousStateError):
    """See :class:`coordinator.core.errors.CorruptValueError`."""


class LeaseLostError(core.LeaseLostError, RendezvousError):
    """See :class:`coordinator.core.errors.LeaseLostError`."""


class NodeLeftError(core.NodeLeftError, RendezvousError):
    """See :class:`coordinator.core.errors.NodeLeftError`."""


class RendezvousFailedError(core.EtcdElasticError, RendezvousError):
    """Any other core error, as a torch ``RendezvousError``."""


class StoreConnectionError(core.EtcdConnectionError, DistNetworkError, DistStoreError):
    """A Store call found no etcd member answering: what torch's ``TCPStore`` raises when
    its server is gone (``DistNetworkError``), and a ``DistStoreError``, which torch's
    store utilities and our agent catch.
    See :class:`coordinator.core.errors.EtcdConnectionError`."""


class StoreAuthError(core.EtcdAuthError, StoreConnectionError):
    """A Store call was refused: the etcd user may not use the round's ``store/`` keys.
    See :class:`coordinator.core.errors.EtcdAuthError`."""


class StoreTLSError(core.EtcdTLSError, StoreConnectionError):
    """See :class:`coordinator.core.errors.EtcdTLSError`, as a Store error."""


class StoreFailedError(core.EtcdElasticError, DistStoreError):
    """Any other core error out of a Store call, as a ``DistStoreError``."""


_Twins = tuple[tuple[type[core.EtcdElasticError], type[core.EtcdElasticError]], ...]

# Most specific first: the first match wins.
_TWINS: _Twins = (
    (core.EtcdAuthError, EtcdAuthError),
    (core.EtcdTLSError, EtcdTLSError),
    (core.EtcdConnectionError, EtcdConnectionError),
    (core.RunEndedWhileWaitingError, RunEndedWhileWaitingError),
    (core.RunClosedError, RunClosedError),
    (core.JoinTimeoutError, JoinTimeoutError),
    (core.CorruptValueError, CorruptValueError),
    (core.LeaseLostError, LeaseLostError),
    (core.NodeLeftError, NodeLeftError),
    (core.EtcdElasticError, RendezvousFailedError),
)


_STORE_TWINS: _Twins = (
    (core.EtcdAuthError, StoreAuthError),
    (core.EtcdTLSError, StoreTLSError),
    (core.EtcdConnectionError, StoreConnectionError),
    (core.EtcdElasticError, StoreFailedError),
)


def as_torch_error(exc: core.EtcdElasticError) -> BaseException:
    """``exc`` as its torch-typed twin (``exc`` itself if it already is one)."""
    if isinstance(exc, RendezvousError):
        return exc
    return _twin_of(exc, _TWINS)


def as_store_error(exc: core.EtcdElasticError) -> BaseException:
    """``exc`` as the torch store error a Store's caller catches (``exc`` itself if it
    already is one)."""
    if isinstance(exc, DistError):
        return exc
    return _twin_of(exc, _STORE_TWINS)


def _twin_of(exc: core.EtcdElasticError, twins: _Twins) -> BaseException:
    for source, twin in twins:
        if isinstance(exc, source):
            copy = twin.__new__(twin)
            copy.args = exc.args
            copy.__dict__.update(exc.__dict__)
            copy.__cause__ = exc.__cause__
            copy.__suppress_context__ = exc.__suppress_context__
            return copy.with_traceback(exc.__traceback__)
    raise AssertionError("unreachable: the root has a twin")


P = ParamSpec("P")
R = TypeVar("R")


def torch_errors(method: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``method`` so a core error leaves it as its torch-typed twin."""
    return _translating(method, as_torch_error)


def store_errors(method: Callable[P, R]) -> Callable[P, R]:
    """Wrap a Store method so a core error leaves it as a torch store error."""
    return _translating(method, as_store_error)


def _translating(
    method: Callable[P, R], twin: Callable[[core.EtcdElasticError], BaseException]
) -> Callable[P, R]:
    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except core.EtcdElasticError as exc:
            raise twin(exc) from exc.__cause__

    return wrapper
