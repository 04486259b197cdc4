"""The etcd password stays out of reprs and out of the workers' environment."""

from __future__ import annotations

from agent.config import LaunchConfig
from agent.workers import without_secrets
from coordinator.core.etcd_client import EtcdConfig

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
