"""Run one measured point for every system and assemble the JSON the CLI prints.

A *run* function measures one repetition for one started system and returns a
:class:`Sample`: the seconds measured and any figures that go with them (etcd writes,
failed CAS, ...). :func:`measure` repeats it, keeps errors instead of stopping, and
summarises; :func:`finish` adds the ratio against torch's c10d.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.procs import RunError
from benchmarks.stats import ratio, summarize
from benchmarks.systems import CLIENT_MODES, System, make_system

__all__ = ["Sample", "environment", "finish", "measure"]


@dataclass
class Sample:
    """One repetition: the seconds measured, plus named figures (numbers only)."""

    seconds: float
    figures: dict[str, float] = field(default_factory=dict)


RunFn = Callable[[System, int], Sample]


def _median_figures(samples: Sequence[Sample]) -> dict[str, float]:
    names = sorted({name for s in samples for name in s.figures})
    return {
        name: statistics.median([s.figures[name] for s in samples if name in s.figures])
        for name in names
    }


def measure(
    systems: Sequence[str],
    run: RunFn,
    repeat: int,
    shared_config: dict[str, Any],
    *,
    lease_ttl: int = 5,
    client: str = CLIENT_MODES[0],
    unavailable: Callable[[str], str | None] | None = None,
    stop_after_error: bool = True,
    slow_s: float | None = None,
    after_system: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``run`` ``repeat`` times for each system; return the per-system results.

    Each system gets its own servers (started before its first run, stopped after its
    last); ``lease_ttl`` goes to ours, the only one with a lease; ``unavailable`` may
    name a scenario-specific reason a system cannot run. A run that fails is recorded in
    ``errors``; with ``stop_after_error`` the
    remaining repetitions of that system are skipped (a timeout would repeat), and so
    they are after a run slower than ``slow_s`` (its figure is kept; the point is then
    bounded by that one run). ``after_system`` runs after a system's last run, before its
    servers stop (node processes must not outlive the server they talk to).
    """
    results: dict[str, dict[str, Any]] = {}
    for name in systems:
        system = make_system(name, lease_ttl=lease_ttl, client=client)
        entry: dict[str, Any] = {
            "description": system.description,
            "config": system.stated_config(shared_config),
        }
        results[name] = entry
        reason = system.unavailable_reason() or (unavailable and unavailable(name))
        if reason is not None:
            entry.update(available=False, reason=reason, **summarize([]), errors=[])
            continue
        samples: list[Sample] = []
        errors: list[str] = []
        try:
            system.start()
            for index in range(repeat):
                try:
                    samples.append(run(system, index))
                except RunError as exc:
                    errors.append(f"run {index + 1}: {exc}")
                    if stop_after_error:
                        break
                if slow_s is not None and samples and samples[-1].seconds > slow_s:
                    entry["slow"] = f"run {index + 1} took over {slow_s:g} s: not repeated"
                    break
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
        finally:
            try:
                if after_system is not None:
                    after_system()
            finally:
                system.stop()
        entry.update(available=True, **summarize([s.seconds for s in samples]), errors=errors)
        entry["samples"] = [round(s.seconds, 4) for s in samples]
        entry["figures"] = _median_figures(samples)
    return results


def finish(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Add ``ratio_vs_torch_c10d`` (c10d's median over each system's) to every system."""
    base = results.get("c10d", {}).get("median")
    for entry in results.values():
        entry["ratio_vs_torch_c10d"] = ratio(base, entry.get("median"))
    return results


def _etcd_version() -> str:
    from benchmarks.systems import benchmark_etcd_binary
    from coordinator.etcd_server import etcd_version

    try:
        return etcd_version(benchmark_etcd_binary())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def environment() -> dict[str, Any]:
    """The machine and versions a result was measured on."""
    import os

    import torch

    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                platform.processor(),
            )
    except OSError:
        model = platform.processor()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "etcd": _etcd_version(),
        "etcd_setup": "one member on loopback, data on disk, fsync on",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
