"""The etcd password stays out of reprs and out of the workers' environment."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.config import LaunchConfig
from agent.workers.group import without_secrets
from coordinator.core.errors import ConfigError, EtcdAuthError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig

SECRET = "s3cr3t-pw"


def test_no_repr_shows_the_password() -> None:
    config = EtcdConfig(endpoints=("h:1",), user="u", password=SECRET)
    assert SECRET not in repr(config) and "user='u'" in repr(config)
    launch = LaunchConfig(1, 1, 1, "train.py", rdzv_conf={"user": "u", "password": SECRET})
    assert SECRET not in repr(launch)


def test_workers_get_neither_the_password_variables_nor_password_in_pet_rdzv_conf() -> None:
    env = {
        "PATH": "/bin",
        "ETCD_ELASTIC_PASSWORD": SECRET,
        "RDZVCTL_PASSWORD": SECRET,
        "PET_RDZV_CONF": f"join_timeout=60, password = {SECRET},user=u",
    }
    assert without_secrets(env) == {
        "PATH": "/bin",
        "PET_RDZV_CONF": "join_timeout=60,user=u",
    }
    assert without_secrets({"PET_RDZV_CONF": "password_file=/pw"}) == {
        "PET_RDZV_CONF": "password_file=/pw"
    }


def test_etcd_config_takes_a_password_or_a_file_not_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        EtcdConfig(endpoints=("h:1",), user="u", password="p", password_file=str(tmp_path))
    assert str(info.value) == "etcd auth: give the password or a password file, not both"
    with pytest.raises(ConfigError) as info:
        EtcdConfig(endpoints=("h:1",), password_file=str(tmp_path / "pw"))
    assert str(info.value) == "etcd auth: give both user and password, or neither"


def test_the_password_file_is_read_at_each_authentication(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(f"{SECRET}\n")
    config = EtcdConfig(endpoints=("h:1",), user="u", password_file=str(secret))
    with EtcdClient(config) as client:
        assert client._password() == SECRET
        secret.write_text("rotated\r\n")
        assert client._password() == "rotated"
        secret.unlink()
        with pytest.raises(EtcdAuthError) as info:
            client._password()
    assert str(info.value) == (
        f"cannot read the etcd password file {str(secret)!r} of user 'u': No such file or "
        "directory; check the path and its permissions"
    )


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


def test_the_preflight_check_process_gets_no_password() -> None:
    # Started as the agent starts it, ahead of the first round (Preflight.prepare), from
    # the agent's own environment, which holds the password.
    from agent.health.preflight import CheckProcess

    env = {
        "PATH": "/bin:/usr/bin",
        "ETCD_ELASTIC_PASSWORD": SECRET,
        "RDZVCTL_PASSWORD": SECRET,
        "PET_RDZV_CONF": f"user=u,password={SECRET}",
    }
    proc = CheckProcess(env)
    try:
        # Until the fork execs the program, /proc shows the parent's environment.
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 60
        while b"agent.health.check_worker" not in cmdline.read_bytes():
            assert time.monotonic() < deadline, "the check process never started"
            time.sleep(0.01)
        seen = _environ(proc.pid)
    finally:
        proc.kill()
    assert SECRET not in "".join(f"{k}={v}" for k, v in seen.items())
    assert seen["PET_RDZV_CONF"] == "user=u"
