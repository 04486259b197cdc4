"""The surface a training script imports (etcd_elastic): pinned, so a change to it is a
decision, not an accident, and it stays light (the standard library only)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import etcd_elastic


def test_the_public_names_are_exactly_these() -> None:
    assert sorted(etcd_elastic.__all__) == ["pause_progress", "report_progress"]
    assert [name for name in dir(etcd_elastic) if not name.startswith("_")] == [
        "pause_progress",
        "progress",
        "report_progress",
    ]


def test_the_signatures_are_pinned() -> None:
    assert str(inspect.signature(etcd_elastic.report_progress)) == "(step: 'int') -> 'None'"
    assert str(inspect.signature(etcd_elastic.pause_progress)) == "() -> 'None'"


def test_importing_it_loads_nothing_of_ours_but_itself_and_no_torch() -> None:
    code = (
        "import sys, etcd_elastic\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('agent', 'coordinator', 'torch', 'grpc', 'etcd3')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_scripts_own_agent_package_does_not_shadow_it(tmp_path: Path) -> None:
    # Training code often has its own agent/ (RL, LLM agents); the script's folder comes
    # first on sys.path, so `from agent.progress import ...` would load the wrong module.
    folder = tmp_path
    (folder / "agent").mkdir()
    (folder / "agent" / "__init__.py").write_text("POLICY = 'mine'\n")
    (folder / "train.py").write_text(
        "import agent\nfrom etcd_elastic import report_progress\n"
        "report_progress(1)\nprint(agent.POLICY)\n"
    )
    out = subprocess.run(
        [sys.executable, str(folder / "train.py")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "mine\n"


def test_the_old_import_path_still_works() -> None:
    from agent.progress import pause_progress, report_progress

    assert report_progress is etcd_elastic.report_progress
    assert pause_progress is etcd_elastic.pause_progress
