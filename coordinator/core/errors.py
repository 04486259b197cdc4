"""The one exception tree of the core (it imports no torch)::

    EtcdElasticError
    ├── RunClosedError                 the run (this node's incarnation) was closed
    │   └── RunEndedWhileWaitingError  it finished (or was drained) while this node
    │                                  waited outside the round (a spare, wait-listed),
    │                                  or this node was drained (rdzvctl drain)
    ├── JoinTimeoutError               join_timeout passed before a round completed
    ├── EtcdConnectionError            no etcd member answered (names the endpoints)
    │   ├── EtcdAuthError              wrong user/password or not permitted
    │   │   └── EtcdPermissionError    the user's role may not use a key (a grant that
    │   │                              is missing, or was revoked)
    │   └── EtcdTLSError               TLS files unreadable or handshake refused
    ├── CorruptValueError              a value under our prefix does not decode
    ├── LeaseLostError                 our lease expired: this node left the run
    └── NodeLeftError                  this node called leave(); it takes no more part
    ConfigError (ValueError)           bad settings; raised before anything connects

gRPC and etcd-client errors become these in ``coordinator.core.etcd_client`` only
(``raise … from exc``); no ``grpc.RpcError`` leaks past that package.

Where torch defines an error its callers catch, :mod:`coordinator.torch_adapter.errors`
has a class of the same name that subclasses both this one and torch's; the handler and
the Store translate at their boundary, so torch's agent and ours see torch's types.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptValueError",
    "EtcdAuthError",
    "EtcdConnectionError",
    "EtcdElasticError",
    "EtcdPermissionError",
    "EtcdTLSError",
    "JoinTimeoutError",
    "LeaseLostError",
    "NodeLeftError",
    "RunClosedError",
]


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and the offending value."""


class EtcdElasticError(Exception):
    """The root of every runtime error of the rendezvous."""


class RunClosedError(EtcdElasticError):
    """The run is closed: it finished (or an operator closed it) and admits nobody."""


class RunEndedWhileWaitingError(RunClosedError):
    """The run finished (or an operator drained it) while this node waited outside its
    round, as a spare or on the wait list, or an operator drained this node: nothing is
    left for it to do, and nothing failed (torch's agent exits 0 on its twin,
    ``RendezvousGracefulExitError``)."""


class JoinTimeoutError(EtcdElasticError):
    """``join_timeout`` passed before this node was admitted to a completed round."""


class EtcdConnectionError(EtcdElasticError):
    """No etcd member answered within the retry budget. The message names the endpoints."""


class EtcdAuthError(EtcdConnectionError):
    """etcd refused the credentials, or the user lacks permission on our prefix."""


class EtcdPermissionError(EtcdAuthError):
    """The user was authenticated, but its role may not use a key of ours. Unlike a wrong
    password this can come back without the node changing anything (an operator's RBAC
    change: a permission revoked and granted again, a role re-created)."""


class EtcdTLSError(EtcdConnectionError):
    """A TLS file could not be read, or the TLS handshake with etcd failed."""


class CorruptValueError(EtcdElasticError):
    """A value under our key prefix is not one we wrote (foreign, truncated, or too new).

    Nothing in it is executed; the message names the key.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt value at etcd key {key!r}: {reason}")
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.key, self.reason))


class LeaseLostError(EtcdElasticError):
    """This node's lease expired or was revoked, so etcd removed its keys.

    Safety: once this is raised the node must assume it is no longer a participant; any
    rank it held may already belong to someone else.
    """


class NodeLeftError(EtcdElasticError):
    """This node has left the run (``leave()`` or ``shutdown()``); it takes no more part."""
