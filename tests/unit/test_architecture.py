"""The layering rules of docs/architecture.md, checked on the source and on a real import.

Static: every ``import`` in a package's modules (at any depth, including those under
``if TYPE_CHECKING``) must name a package that the layer may use. Dynamic: importing the
core and the operator CLI in a fresh interpreter loads no torch, and the handler's import
path does not load the etcd process manager.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Our own packages each layer may import (third-party and stdlib are checked separately).
ALLOWED: dict[str, tuple[str, ...]] = {
    "coordinator.core": ("coordinator.core", "coordinator.generated"),
    "coordinator.rdzvctl": ("coordinator.rdzvctl", "coordinator.core"),
    "coordinator.torch_adapter": ("coordinator.torch_adapter", "coordinator.core"),
    "coordinator.etcd_server": ("coordinator.etcd_server", "coordinator.core"),
    "coordinator.etcd_proxy": ("coordinator.core", "coordinator.etcd_server"),
    "agent": (
        "agent",
        "coordinator.torch_adapter",
        "coordinator.core",
        "coordinator.etcd_server",
        "etcd_elastic",
    ),
    # What a training script imports: the standard library only (checked below).
    "etcd_elastic": ("etcd_elastic",),
}
# The core and the operator CLI run where torch may be absent (and must start fast).
NO_TORCH = (
    "coordinator.core",
    "coordinator.rdzvctl",
    "coordinator.etcd_server",
    "coordinator.etcd_proxy",
    "etcd_elastic",
)
OURS = ("coordinator", "agent", "benchmarks", "tests", "examples", "etcd_elastic")
# The agent's wings, lowest first: a wing may import the wings before it, never after
# (docs/architecture.md). The modules at the top of ``agent`` that every wing shares
# (``config``, ``store``, ``errors``) import no wing.
WINGS = ("workers", "health", "observe", "loop", "cli")
SHARED = ("agent.config", "agent.store", "agent.errors")
# Small modules, one concept each (STYLE.md): no product module over this many lines.
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str | None:
    matches = [layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")]
    return max(matches, key=len) if matches else None


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _sources() -> list[Path]:
    files = [
        *(ROOT / "coordinator").rglob("*.py"),
        *(ROOT / "agent").rglob("*.py"),
        *(ROOT / "etcd_elastic").rglob("*.py"),
    ]
    return sorted(p for p in files if "generated" not in p.parts)


def _check(path: Path, module: str) -> list[str]:
    layer = _layer(module)
    if layer is None:
        return [] if module == "coordinator" else [f"{module}: belongs to no layer"]
    found = []
    for line, name in _imports(path):
        top = name.split(".")[0]
        where = f"{path.name}:{line} imports {name}"
        if top in OURS:
            if not any(name == ok or name.startswith(ok + ".") for ok in ALLOWED[layer]):
                found.append(f"{where}, which layer {layer} may not use")
        elif top == "torch" and layer in NO_TORCH:
            found.append(f"{where}: layer {layer} must import without torch")
    return found


def _wing(module: str) -> str | None:
    """The agent wing ``module`` belongs to; "" for a shared module; None for any other
    (outside the agent, or an entry point at its top: ``agent.__main__``, the
    ``agent.progress`` alias of :mod:`etcd_elastic`)."""
    parts = module.split(".")
    if parts[0] != "agent" or len(parts) < 2:
        return None
    if parts[1] in WINGS:
        return parts[1]
    return "" if ".".join(parts[:2]) in SHARED else None


def _check_wings(path: Path, module: str) -> list[str]:
    """An agent module imports only wings below its own (shared modules: none)."""
    mine = _wing(module)
    if mine is None:
        return []
    found = []
    for line, name in _imports(path):
        theirs = _wing(name)
        if theirs is None or theirs == "" or theirs == mine:
            continue
        if mine == "" or WINGS.index(theirs) > WINGS.index(mine):
            where = module if mine == "" else f"agent.{mine}"
            found.append(f"{path.name}:{line} imports {name}, a wing above {where}")
    return found


def _stdlib_only(path: Path, module: str) -> list[str]:
    """The worker-side package imports the standard library and itself, nothing else."""
    if not (module == "etcd_elastic" or module.startswith("etcd_elastic.")):
        return []
    return [
        f"{path.name}:{line} imports {name}: etcd_elastic may use only the standard library"
        for line, name in _imports(path)
        if name.split(".")[0] not in (*sys.stdlib_module_names, "etcd_elastic", "__future__")
    ]


def _too_long(files: list[Path], root: Path) -> list[str]:
    """Each module longer than it may be, with its length."""
    found = []
    for path in files:
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            name = path.relative_to(root).as_posix()
            found.append(f"{name}: {lines} lines, over {MAX_LINES}: split it by concern")
    return found


def _violations() -> list[str]:
    return [
        v
        for path in _sources()
        for check in (_check, _check_wings, _stdlib_only)
        for v in check(path, _module_name(path))
    ]


def test_every_import_follows_the_layers() -> None:
    assert _violations() == []


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    # The rule above is only worth something if a broken layer shows up: check the checker
    # on a module written the wrong way.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import json\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "def f() -> None:\n    from coordinator.torch_adapter.handler import x\n"
    )
    assert _check(bad, "coordinator.core.keys") == [
        "bad.py:4 imports torch: layer coordinator.core must import without torch",
        "bad.py:6 imports coordinator.torch_adapter.handler, which layer coordinator.core "
        "may not use",
    ]
    assert _check(bad, "coordinator.torch_adapter.store") == []
    assert _check(bad, "coordinator.stray") == ["coordinator.stray: belongs to no layer"]


def test_the_checker_sees_a_wing_imported_upwards(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from agent.loop.policy import Step\nfrom agent.workers.state import WorkerState\n"
        "from agent.config import LaunchConfig\nimport numpy\n"
    )
    assert _check_wings(bad, "agent.workers.group") == [
        "bad.py:1 imports agent.loop.policy, a wing above agent.workers"
    ]
    assert _check_wings(bad, "agent.cli.etcdrun") == []
    assert _check_wings(bad, "agent.store") == [
        "bad.py:1 imports agent.loop.policy, a wing above agent.store",
        "bad.py:2 imports agent.workers.state, a wing above agent.store",
    ]
    assert _stdlib_only(bad, "etcd_elastic.progress") == [
        "bad.py:1 imports agent.loop.policy: etcd_elastic may use only the standard library",
        "bad.py:2 imports agent.workers.state: etcd_elastic may use only the standard library",
        "bad.py:3 imports agent.config: etcd_elastic may use only the standard library",
        "bad.py:4 imports numpy: etcd_elastic may use only the standard library",
    ]


def test_no_module_is_over_the_line_limit() -> None:
    assert _too_long(_sources(), ROOT) == []


def test_the_checker_counts_lines(tmp_path: Path) -> None:
    (tmp_path / "coordinator").mkdir()
    fits, long = tmp_path / "coordinator" / "fits.py", tmp_path / "coordinator" / "long.py"
    fits.write_text("x = 1\n" * MAX_LINES)
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _too_long([fits, long], tmp_path) == [
        f"coordinator/long.py: {MAX_LINES + 1} lines, over {MAX_LINES}: split it by concern"
    ]


@pytest.mark.parametrize(
    ("modules", "absent"),
    [
        (["coordinator.rdzvctl", "coordinator.core.executor", "coordinator.core.duty"], "torch"),
        (["coordinator.core.settings", "coordinator.core.view"], "torch"),
        (["coordinator.torch_adapter.handler"], "coordinator.etcd_server"),
    ],
    ids=["operator-cli", "core", "handler-without-process-manager"],
)
def test_import_does_not_load(modules: list[str], absent: str) -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print({absent!r} in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {modules} loaded {absent}"
