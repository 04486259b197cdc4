"""The ``torchrun.handlers`` entry point (``torchrun --rdzv-backend=etcd-v3``).

torch loads entry points and calls them while its rendezvous package is still importing,
possibly in the middle of importing one of our modules (``coordinator.core.errors`` imports
torch's rendezvous API). Importing our handler then would find our own modules
half-initialised, so the creator imports it only when torch creates a handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )

__all__ = ["handler_factory"]


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Return the creator torch registers under ``etcd-v3``."""

    def create(params: RendezvousParameters) -> RendezvousHandler:
        from coordinator.torch_adapter.handler import create_handler

        return create_handler(params)

    return create
