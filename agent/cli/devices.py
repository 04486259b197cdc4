"""How many workers ``--nproc-per-node`` asks for on this machine.

Same meaning as ``torchrun``: a positive integer is taken as is; ``gpu`` is the number of
visible CUDA devices (an error when there is none); ``cpu`` is the number of CPUs this
process may run on; ``auto`` is the number of CUDA devices when there is at least one,
otherwise the CPU count. The decision is a pure function of the counts, which callers pass
in (:func:`cuda_device_count` and :func:`cpu_count` read the machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["NPROC_KEYWORDS", "cpu_count", "cuda_device_count", "resolve_nproc"]

NPROC_KEYWORDS = ("gpu", "cpu", "auto")


def resolve_nproc(
    value: str,
    *,
    cuda_device_count: Callable[[], int],
    cpu_count: Callable[[], int],
) -> int:
    """Turn a ``--nproc-per-node`` value into a worker count.

    Args:
        value: a positive integer, ``gpu``, ``cpu`` or ``auto``.
        cuda_device_count: returns the number of visible CUDA devices; called only for
            ``gpu`` and ``auto`` (so an integer value never needs torch).
        cpu_count: returns the number of usable CPUs; called only for ``cpu`` and ``auto``.

    Returns:
        The number of workers to start on this node, at least 1.

    Raises:
        ValueError: the value is not one of the forms above, is not positive, or is
            ``gpu`` on a machine without CUDA devices. The message names the value and
            what to give instead; it does not name the flag.
    """
    text = value.strip()
    if text == "gpu":
        gpus = cuda_device_count()
        if gpus < 1:
            raise ValueError(
                "'gpu' needs CUDA devices but none are visible; "
                "give a number, 'cpu' or 'auto' instead"
            )
        return gpus
    if text == "cpu":
        return max(1, cpu_count())
    if text == "auto":
        gpus = cuda_device_count()
        return gpus if gpus > 0 else max(1, cpu_count())
    try:
        count = int(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is not a number of workers; give a positive integer, 'gpu', 'cpu' or 'auto'"
        ) from None
    if count < 1:
        raise ValueError(f"{count} workers per node is not possible; give at least 1")
    return count


def cuda_device_count() -> int:
    """The number of CUDA devices this process can see (0 without CUDA)."""
    # Imported here: torch takes seconds to import and an integer --nproc-per-node
    # (the common case) must not pay for it.
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def cpu_count() -> int:
    """The number of CPUs this process may run on (affinity and cgroup cpusets respected)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
