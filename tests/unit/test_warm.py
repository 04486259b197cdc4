"""Warm restarts, the pure parts: which command lines a warm interpreter may run
(``warm_target``), which environments it may take (``env_compatible``), and the
``--no-warm-start`` / ``--warm-modules`` command line reaching ``LaunchConfig``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.cli.etcdrun import parse_args
from agent.cli.values import UsageError, parse_modules
from agent.config import LaunchConfig
from agent.workers.warm import LATE_KEYS, WarmTarget, env_compatible, warm_target

PY = "/work/venv/bin/python"

# -- warm_target -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([PY, "-u", "train.py", "--lr", "0.1"],
         WarmTarget(PY, "script", "train.py", ("--lr", "0.1"))),
        ([PY, "-u", "train.py"], WarmTarget(PY, "script", "train.py", ())),
        ([PY, "-u", "../dir/t.py", ""], WarmTarget(PY, "script", "../dir/t.py", ("",))),
        ([PY, "-u", "-m", "pkg.train", "-m", "x"],
         WarmTarget(PY, "module", "pkg.train", ("-m", "x"))),
        ([PY, "-u", "-c", "print(1)", "a", "b"], WarmTarget(PY, "code", "print(1)", ("a", "b"))),
        (["python3.11", "-u", "t.py"], WarmTarget("python3.11", "script", "t.py", ())),
        (["/usr/bin/python", "-u", "t.py"], WarmTarget("/usr/bin/python", "script", "t.py", ())),
        (["python", "-u", "t.py"], WarmTarget("python", "script", "t.py", ())),
        # Arguments after the target are the script's, whatever they look like.
        ([PY, "-u", "t.py", "-X", "dev", "-O"],
         WarmTarget(PY, "script", "t.py", ("-X", "dev", "-O"))),
    ],
)  # fmt: skip
def test_warm_target_of_python_u_commands(argv: list[str], expected: WarmTarget) -> None:
    assert warm_target(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([], id="empty"),
        pytest.param([PY], id="python alone"),
        pytest.param([PY, "-u"], id="-u alone"),
        pytest.param([PY, "t.py"], id="missing -u"),
        pytest.param([PY, "t.py", "--lr"], id="missing -u, with arguments"),
        pytest.param([PY, "-m", "pkg"], id="-m without -u"),
        pytest.param([PY, "t.py", "-u"], id="-u after the script"),
        pytest.param(["/usr/bin/env", "python", "-u", "t.py"], id="--no-python program"),
        pytest.param(["./train.sh", "-u", "x"], id="--no-python script"),
        pytest.param(["/opt/bin/pypy3", "-u", "t.py"], id="not named python"),
        pytest.param(["/opt/python/bin/py", "-u", "t.py"], id="python folder, other name"),
        pytest.param([PY, "-B", "-u", "t.py"], id="flag before -u"),
        pytest.param([PY, "-u", "-X", "dev", "t.py"], id="-X"),
        pytest.param([PY, "-u", "-O", "t.py"], id="-O"),
        pytest.param([PY, "-u", "-W", "error", "t.py"], id="-W"),
        pytest.param([PY, "-u", "-I", "t.py"], id="-I"),
        pytest.param([PY, "-u", "-", "x"], id="stdin script"),
        pytest.param([PY, "-u", "--", "t.py"], id="--"),
        pytest.param([PY, "-u", "-mpkg"], id="-m glued"),
        pytest.param([PY, "-u", "-m"], id="-m without module"),
        pytest.param([PY, "-u", "-c"], id="-c without code"),
    ],
)
def test_warm_target_is_none_where_only_a_cold_start_keeps_the_meaning(argv: list[str]) -> None:
    assert warm_target(argv) is None


def test_warm_target_of_what_build_argv_makes() -> None:
    from agent.workers.group import RUN_PATH_CODE, build_argv

    assert warm_target(build_argv("t.py", ["a"], python=PY)) == WarmTarget(
        PY, "script", "t.py", ("a",)
    )
    assert warm_target(build_argv("pkg.m", ["a"], module=True, python=PY)) == WarmTarget(
        PY, "module", "pkg.m", ("a",)
    )
    assert warm_target(build_argv("t.py", ["a"], run_path=True, python=PY)) == WarmTarget(
        PY, "code", RUN_PATH_CODE, ("t.py", "a")
    )
    assert warm_target(build_argv(PY, ["t.py"], no_python=True)) is None


# -- env_compatible ----------------------------------------------------------------------

BASE = {"PATH": "/usr/bin", "HOME": "/root", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
        "RANK": "0", "MASTER_PORT": "29500"}  # fmt: skip


def test_late_keys_are_torchruns_per_attempt_variables() -> None:
    assert frozenset({
        "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
        "ETCD_ELASTIC_ROUND",
    }) == LATE_KEYS  # fmt: skip


def test_equal_environments_are_compatible() -> None:
    assert env_compatible(BASE, dict(BASE))
    assert env_compatible({}, {})


@pytest.mark.parametrize("key", sorted(LATE_KEYS))
def test_late_keys_may_differ_appear_or_vanish(key: str) -> None:
    assert env_compatible({**BASE, key: "a"}, {**BASE, key: "b"})
    assert env_compatible(BASE, {**BASE, key: "new"})
    assert env_compatible({**BASE, key: "old"}, {k: v for k, v in BASE.items() if k != key})


def test_every_late_key_at_once_may_differ() -> None:
    started = {**BASE, **{k: "0" for k in LATE_KEYS}}
    wanted = {**BASE, **{k: "9" for k in LATE_KEYS}}
    assert env_compatible(started, wanted)


@pytest.mark.parametrize(
    ("started", "wanted"),
    [
        pytest.param(BASE, {**BASE, "OMP_NUM_THREADS": "2"}, id="OMP_NUM_THREADS changed"),
        pytest.param(BASE, {k: v for k, v in BASE.items() if k != "OMP_NUM_THREADS"},
                     id="OMP_NUM_THREADS removed"),
        pytest.param({k: v for k, v in BASE.items() if k != "OMP_NUM_THREADS"}, BASE,
                     id="OMP_NUM_THREADS added"),
        pytest.param(BASE, {**BASE, "PYTHONHASHSEED": "0"}, id="PYTHONHASHSEED added"),
        pytest.param({**BASE, "PYTHONHASHSEED": "0"}, {**BASE, "PYTHONHASHSEED": "1"},
                     id="PYTHONHASHSEED changed"),
        pytest.param(BASE, {**BASE, "MY_FLAG": "1"}, id="user variable added"),
        pytest.param({**BASE, "MY_FLAG": "1"}, BASE, id="user variable removed"),
        pytest.param({**BASE, "MY_FLAG": ""}, BASE, id="empty value is not unset"),
        pytest.param(BASE, {**BASE, "LOCAL_RANK": "1"}, id="LOCAL_RANK is not per attempt"),
        pytest.param(BASE, {**BASE, "PATH": "/bin"}, id="PATH"),
        pytest.param(BASE, {**BASE, "rank": "1"}, id="case matters"),
        pytest.param({**BASE, "RANK": "0"}, {**BASE, "RANK": "1", "CUDA_VISIBLE_DEVICES": "1"},
                     id="a late key does not hide another difference"),
    ],
)  # fmt: skip
def test_any_other_difference_is_incompatible(
    started: dict[str, str], wanted: dict[str, str]
) -> None:
    assert not env_compatible(started, wanted)
    assert not env_compatible(wanted, started)


# -- parse_modules and the command line --------------------------------------------------


def test_parse_modules() -> None:
    assert parse_modules("--warm-modules", "torch") == ("torch",)
    assert parse_modules("--warm-modules", " torch , numpy.linalg,,_x ") == (
        "torch",
        "numpy.linalg",
        "_x",
    )
    assert parse_modules("--warm-modules", "") == ()
    assert parse_modules("--warm-modules", " , ") == ()


@pytest.mark.parametrize("bad", ["torch,1bad", "a-b", "torch.", "a..b", "x y", "torch/nn"])
def test_parse_modules_rejects_what_is_not_a_module_name(bad: str) -> None:
    name = next(n.strip() for n in bad.split(",") if not all(
        p.isidentifier() for p in n.strip().split(".")
    ))  # fmt: skip
    with pytest.raises(UsageError) as err:
        parse_modules("--warm-modules", bad)
    assert str(err.value) == f"--warm-modules: {name!r} is not a module name; give e.g. torch,numpy"
    assert err.value.flag == "--warm-modules"


def test_parse_modules_message_is_pinned() -> None:
    with pytest.raises(UsageError) as err:
        parse_modules("--warm-modules", "torch,a-b")
    assert str(err.value) == "--warm-modules: 'a-b' is not a module name; give e.g. torch,numpy"


@pytest.fixture(autouse=True)
def _in_tmp_with_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse in a folder holding ``train.py``, with no ``PET_*`` variables."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


def _parse(argv: list[str], **kw: object) -> LaunchConfig:
    return parse_args(argv, device_count=lambda: 0, cpu_count=lambda: 4, **kw)  # type: ignore[arg-type]


def test_warm_start_is_on_with_torch_by_default() -> None:
    config = _parse(["train.py"])
    assert (config.warm_start, config.warm_modules) == (True, ("torch",))
    assert LaunchConfig.warm_start is True
    assert LaunchConfig.warm_modules == ("torch",)


def test_warm_flags_reach_the_config() -> None:
    config = _parse(["--no-warm-start", "--warm-modules=numpy, torch.nn", "train.py"])
    assert (config.warm_start, config.warm_modules) == (False, ("numpy", "torch.nn"))
    config = _parse(["--no_warm_start", "--warm_modules", "json", "train.py"])
    assert (config.warm_start, config.warm_modules) == (False, ("json",))
    assert _parse(["--warm-modules=", "train.py"]).warm_modules == ()


def test_warm_flags_after_the_script_are_the_scripts() -> None:
    config = _parse(["train.py", "--no-warm-start", "--warm-modules=x"])
    assert config.warm_start is True
    assert config.args == ("--no-warm-start", "--warm-modules=x")


@pytest.mark.parametrize(
    ("value", "warm"), [("1", False), ("true", False), ("0", True), ("", True), ("false", True)]
)
def test_pet_no_warm_start(value: str, warm: bool) -> None:
    assert _parse(["train.py"], environ={"PET_NO_WARM_START": value}).warm_start is warm


def test_pet_warm_modules_is_a_default_the_flag_overrides() -> None:
    env = {"PET_WARM_MODULES": "json,numpy"}
    assert _parse(["train.py"], environ=env).warm_modules == ("json", "numpy")
    assert _parse(["--warm-modules=re", "train.py"], environ=env).warm_modules == ("re",)


def test_bad_warm_modules_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(["--warm-modules=torch,a-b", "train.py"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "etcdrun: error: --warm-modules: 'a-b' is not a module name; give e.g. torch,numpy\n"
    )
