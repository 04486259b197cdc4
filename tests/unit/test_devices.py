"""``--nproc-per-node`` resolution: torchrun's semantics with injected device counts."""

from __future__ import annotations

import pytest

from agent.cli.devices import cpu_count, resolve_nproc


def _counts(gpus: int, cpus: int) -> dict[str, object]:
    return {"cuda_device_count": lambda: gpus, "cpu_count": lambda: cpus}


@pytest.mark.parametrize(
    ("value", "gpus", "cpus", "expected"),
    [
        ("1", 0, 8, 1),
        ("4", 2, 8, 4),
        (" 3 ", 0, 1, 3),
        ("gpu", 4, 8, 4),
        ("cpu", 4, 8, 8),
        ("cpu", 0, 0, 1),  # an unknown CPU count still starts one worker
        ("auto", 2, 8, 2),  # GPUs when there are any
        ("auto", 0, 8, 8),  # else one per CPU
    ],
)
def test_resolves(value: str, gpus: int, cpus: int, expected: int) -> None:
    assert resolve_nproc(value, **_counts(gpus, cpus)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "gpus", "message"),
    [
        ("gpu", 0, "'gpu' needs CUDA devices but none are visible; give a number, 'cpu' or "
                   "'auto' instead"),
        ("abc", 0, "'abc' is not a number of workers; give a positive integer, 'gpu', 'cpu' "
                   "or 'auto'"),
        ("xpu", 0, "'xpu' is not a number of workers; give a positive integer, 'gpu', 'cpu' "
                   "or 'auto'"),
        ("0", 0, "0 workers per node is not possible; give at least 1"),
        ("-2", 0, "-2 workers per node is not possible; give at least 1"),
    ],
)  # fmt: skip
def test_rejects(value: str, gpus: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_nproc(value, **_counts(gpus, 8))  # type: ignore[arg-type]
    assert str(info.value) == message


def test_counts_are_only_asked_when_needed() -> None:
    def boom() -> int:
        raise AssertionError("device count read for an integer value")

    assert resolve_nproc("2", cuda_device_count=boom, cpu_count=boom) == 2
    assert resolve_nproc("cpu", cuda_device_count=boom, cpu_count=lambda: 3) == 3


def test_machine_cpu_count_is_positive() -> None:
    assert cpu_count() >= 1
