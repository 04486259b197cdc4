"""The one exception tree of the coordinator.

Where torch defines an error a caller catches, ours subclasses it, so torch's agent and
ours handle them the same way::

    RendezvousError (torch)
    ├── RendezvousClosedError (torch)
    │   └── RunClosedError                 the run was closed; nobody may join again
    ├── RendezvousTimeoutError (torch)
    │   └── JoinTimeoutError               join_timeout passed before a round completed
    ├── RendezvousConnectionError (torch)
    │   └── EtcdConnectionError            no etcd member answered (names the endpoints)
    │       ├── EtcdAuthError              wrong user/password or not permitted
    │       └── EtcdTLSError               TLS files unreadable or handshake refused
    ├── RendezvousStateError (torch)
    │   └── CorruptValueError              a value under our prefix does not decode
    └── LeaseLostError                     our lease expired: this node left the run
    ConfigError (ValueError)               bad settings; raised before anything connects

gRPC and etcd-client errors become these in ``coordinator.etcd_client`` only
(``raise … from exc``); no ``grpc.RpcError`` leaks past that module.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

__all__ = [
    "ConfigError",
    "CorruptValueError",
    "EtcdAuthError",
    "EtcdConnectionError",
    "EtcdTLSError",
    "JoinTimeoutError",
    "LeaseLostError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RunClosedError",
]


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and the offending value."""


class RunClosedError(RendezvousClosedError):
    """The run is closed: it finished (or an operator closed it) and admits nobody."""


class JoinTimeoutError(RendezvousTimeoutError):
    """``join_timeout`` passed before this node was admitted to a completed round."""


class EtcdConnectionError(RendezvousConnectionError):
    """No etcd member answered within the retry budget. The message names the endpoints."""


class EtcdAuthError(EtcdConnectionError):
    """etcd refused the credentials, or the user lacks permission on our prefix."""


class EtcdTLSError(EtcdConnectionError):
    """A TLS file could not be read, or the TLS handshake with etcd failed."""


class CorruptValueError(RendezvousStateError):
    """A value under our key prefix is not one we wrote (foreign, truncated, or too new).

    Nothing in it is executed; the message names the key.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt value at etcd key {key!r}: {reason}")
        self.key = key
        self.reason = reason


class LeaseLostError(RendezvousError):
    """This node's lease expired or was revoked, so etcd removed its keys.

    Safety: once this is raised the node must assume it is no longer a participant; any
    rank it held may already belong to someone else.
    """
