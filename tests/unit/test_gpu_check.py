"""scripts/gpu_check.py without a GPU: it says so in one line and exits 2; its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_check = _module()
    monkeypatch.setattr(gpu_check, "_device_count", lambda: 0)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err == (
        "gpu_check: no CUDA device is visible (torch.cuda.device_count() is 0); run it on a "
        "machine with GPUs, or with --cpu to try the script itself\n"
    )


def test_the_table_has_a_row_per_check() -> None:
    gpu_check = _module()
    rows = [
        gpu_check.Row("devices", "passed", "--nproc-per-node=gpu -> 8 workers", 0.4),
        gpu_check.Row("node loss", "FAILED", "survivor exit 1", 61.0),
    ]
    assert gpu_check.table(rows).splitlines() == [
        "check      result   seconds  detail",
        "devices    passed       0.4  --nproc-per-node=gpu -> 8 workers",
        "node loss  FAILED      61.0  survivor exit 1",
    ]
