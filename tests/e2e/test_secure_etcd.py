"""etcd as an operator secures it: TLS, --client-cert-auth, and RBAC with one role that may
read and write only under the job's key prefix (docs/security.md).

One such etcd serves the module. On it: two agents and rdzvctl run a job, and nothing
they write (logs, error files, history, rdzvctl's output) nor any worker's environment
holds a password, and the job survives a password rotation; each TLS mismatch is one
pinned line; the password is rotated under a running client, and a client certificate's
files are replaced under one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.core.errors import EtcdAuthError, EtcdTLSError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, WatchEvent
from coordinator.etcd_server import EtcdCluster, ServerTLS
from coordinator.rdzvctl.main import main as rdzvctl_main
from tests.conftest import _test_binary
from tests.e2e.agents import ROOT, Agents, descendants, read_report, wait_for
from tests.tls_pki import CertFiles, Pki

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PREFIX = "/etcd-elastic-secure"
RDZVCTL = [sys.executable, "-m", "coordinator.rdzvctl"]
STARTED = 180.0


@dataclass
class Secure:
    """The module's etcd and everything a client needs to talk to it."""

    cluster: EtcdCluster
    endpoint: str  # host:port
    dir: Path
    a: Pki  # the CA etcd trusts
    b: Pki  # a CA nobody trusts
    certs: dict[str, CertFiles]
    password: str  # the password of user "trainer"
    password2: str  # the password of user "trainer2"
    etcdctl: list[str]  # etcdctl as root, by its certificate

    def tls(self, user: str = "trainer") -> dict[str, str]:
        cert = self.certs[user]
        return {"ca_cert": str(self.a.ca), "cert": str(cert.cert), "cert_key": str(cert.key)}

    def ctl(self, *args: str, stdin: str | None = None) -> None:
        done = subprocess.run(
            [*self.etcdctl, *args], input=stdin, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, f"etcdctl {args}: {done.stdout}{done.stderr}"


def _etcdctl_binary(etcd: Path) -> Path:
    beside = etcd.parent / "etcdctl"
    return beside if beside.exists() else Path(sys.executable).parent / "etcdctl"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    d = tmp_path_factory.mktemp("secure-etcd")
    a, b = Pki(d, "a"), Pki(d, "b")
    server = a.issue("server", "etcd", server=True)  # SAN: IP 127.0.0.1 only
    certs = {user: a.issue(user, user, server=False) for user in ("root", "trainer", "ops")}
    certs["stranger"] = b.issue("stranger", "trainer", server=False)
    certs["expired"] = a.issue("expired", "trainer", server=False, expired=True)
    binary = _test_binary()
    cluster = EtcdCluster(
        1, binary=binary, no_fsync=True, stop_grace=1.0, base_dir=d / "data",
        tls=ServerTLS(server.cert, server.key, client_ca=a.ca),
    )  # fmt: skip
    cluster.start()
    try:
        endpoint = cluster.endpoints[0]
        secure = Secure(
            cluster, endpoint, d, a, b, certs, password=f"pw-{uuid.uuid4().hex}",
            password2=f"pw2-{uuid.uuid4().hex}",
            etcdctl=[
                str(_etcdctl_binary(binary)), f"--endpoints=https://{endpoint}",
                f"--cacert={a.ca}", f"--cert={certs['root'].cert}", f"--key={certs['root'].key}",
            ],
        )  # fmt: skip
        # docs/security.md, "A least-privilege etcd": the same commands.
        for args in (
            ("user", "add", f"root:{uuid.uuid4().hex}"),
            ("role", "add", "root"),
            ("user", "grant-role", "root", "root"),
            ("role", "add", "etcd-elastic"),
            ("role", "grant-permission", "etcd-elastic", "--prefix=true", "readwrite",
             f"{PREFIX}/"),
            ("user", "add", "ops", "--no-password"),
            ("user", "grant-role", "ops", "etcd-elastic"),
            ("user", "add", f"trainer:{secure.password}"),
            ("user", "grant-role", "trainer", "etcd-elastic"),
            ("user", "add", f"trainer2:{secure.password2}"),
            ("user", "grant-role", "trainer2", "etcd-elastic"),
            ("user", "add", "rotor:first"),
            ("user", "grant-role", "rotor", "etcd-elastic"),
            ("auth", "enable"),
        ):  # fmt: skip
            secure.ctl(*args)
        yield secure
    finally:
        cluster.stop()


def _rdzvctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RDZVCTL, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


# -- one line per TLS mismatch ------------------------------------------------------------


def _mismatch_cases(s: Secure, plain: str, expired_ep: str) -> dict[str, tuple[list[str], str]]:
    ep = s.endpoint
    port = ep.rsplit(":", 1)[1]
    tr = s.certs["trainer"]
    good = ["--ca-cert", str(s.a.ca), "--cert", str(tr.cert), "--key", str(tr.key)]
    return {
        "http against https": (
            ["--endpoints", f"http://{ep}", "--read-timeout", "2"],
            f"etcd at http://{ep} closed the connection before answering plain http: it most "
            "likely serves TLS; use https:// endpoints (etcdrun: protocol=https,ca_cert=FILE; "
            "rdzvctl: --ca-cert)",
        ),
        "https against http": (
            ["--endpoints", f"https://{plain}", "--ca-cert", str(s.a.ca)],
            f"etcd at https://{plain} did not answer the TLS handshake: it most likely serves "
            "plain http; use http:// endpoints without TLS files, or start etcd with "
            "--cert-file and --key-file",
        ),
        "unknown CA": (
            ["--endpoints", f"https://{ep}", "--ca-cert", str(s.b.ca), *good[2:]],
            f"the certificate of etcd at https://{ep} is not signed by the CA in {s.b.ca}: set "
            "ca_cert (rdzvctl: --ca-cert) to the CA that signed etcd's --cert-file",
        ),
        # With a user, the first call is Authenticate: it used to say "no etcd member
        # answered Authenticate ... Check that etcd runs".
        "unknown CA, as a user": (
            [
                "--endpoints",
                f"https://{ep}",
                "--ca-cert",
                str(s.b.ca),
                *good[2:],
                "--user",
                "trainer",
            ],
            f"the certificate of etcd at https://{ep} is not signed by the CA in {s.b.ca}: set "
            "ca_cert (rdzvctl: --ca-cert) to the CA that signed etcd's --cert-file",
        ),
        "name not in the certificate": (
            ["--endpoints", f"https://localhost:{port}", *good],
            f"the certificate of etcd at https://localhost:{port} does not name the host "
            "connected to: connect by a name or IP in its subjectAltName, or reissue it with "
            "that host in it",
        ),
        "expired server certificate": (
            ["--endpoints", f"https://{expired_ep}", *good],
            f"the certificate of etcd at https://{expired_ep} has expired: renew etcd's "
            "--cert-file (then restart that member)",
        ),
        "client certificate missing": (
            ["--endpoints", f"https://{ep}", "--ca-cert", str(s.a.ca)],
            f"etcd at https://{ep} requires a client certificate (--client-cert-auth) and none "
            "was given: set ssl_cert and ssl_cert_key (rdzvctl: --cert and --key)",
        ),
        "client certificate of another CA": (
            [
                "--endpoints",
                f"https://{ep}",
                "--ca-cert",
                str(s.a.ca),
                "--cert",
                str(s.certs["stranger"].cert),
                "--key",
                str(s.certs["stranger"].key),
            ],
            f"etcd at https://{ep} refused the client certificate {s.certs['stranger'].cert}: "
            "it has expired or is not signed by etcd's --trusted-ca-file: renew it, signed by "
            "that CA",
        ),
        "client certificate expired": (
            [
                "--endpoints",
                f"https://{ep}",
                "--ca-cert",
                str(s.a.ca),
                "--cert",
                str(s.certs["expired"].cert),
                "--key",
                str(s.certs["expired"].key),
            ],
            f"etcd at https://{ep} refused the client certificate {s.certs['expired'].cert}: "
            "it has expired: renew it",
        ),
    }


def test_each_tls_mismatch_is_one_line_naming_the_endpoint_and_the_fix(
    secure: Secure,
    etcd1: EtcdCluster,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expired = secure.a.issue("server-expired", "etcd", server=True, expired=True)
    other = EtcdCluster(
        1, binary=_test_binary(), no_fsync=True, stop_grace=1.0,
        tls=ServerTLS(expired.cert, expired.key, client_ca=secure.a.ca),
    )  # fmt: skip
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # what rdzvctl's main sets for itself
    monkeypatch.setenv("ETCD_ELASTIC_PASSWORD", "never-sent")
    with other:
        cases = _mismatch_cases(secure, etcd1.endpoints[0], other.endpoints[0])
        # rdzvctl's main in this process (a Python start-up per case would cost seconds);
        # the program itself once, below, for what reaches a terminal.
        seen = {}
        for name, (args, _) in cases.items():
            code = rdzvctl_main([*args, "list"])
            seen[name] = (code, capsys.readouterr().err)
        program = _rdzvctl(*cases["unknown CA"][0], "list")
    for name, (_, expected) in cases.items():
        assert seen[name] == (3, f"rdzvctl: error: {expected}\n"), name
    assert (program.returncode, program.stderr) == seen["unknown CA"]


def test_an_agent_with_plain_http_against_tls_stops_with_one_line(
    secure: Secure, run_id: str, tmp_path: Path
) -> None:
    agents = Agents(run_id, f"http://{secure.endpoint}", tmp_path)
    try:
        agent = agents.start("plain", ["--nnodes=1", "--rdzv-conf=read_timeout=2"])
        assert agent.wait(STARTED) == 1, agents.logs()
        lines = [line for line in agent.output().splitlines() if "closed the connection" in line]
        assert len(lines) == 1, agent.output()
        assert lines[0].endswith(
            f"etcd at http://{secure.endpoint} closed the connection before answering plain "
            "http: it most likely serves TLS; use https:// endpoints (etcdrun: protocol=https,"
            "ca_cert=FILE; rdzvctl: --ca-cert)"
        ), lines[0]
    finally:
        agents.reap()


# -- a job, and where the password is not -------------------------------------------------


def _files_holding(root: Path, secret: bytes, but: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path != but and secret in path.read_bytes():
            found.append(str(path))
    return found


def test_two_agents_and_rdzvctl_leave_the_password_in_no_file_and_no_worker(
    secure: Secure, run_id: str, tmp_path: Path
) -> None:
    """Agent a is user trainer, its password in a file; agent b is user trainer2, its
    password in $ETCD_ELASTIC_PASSWORD. While the workers train, trainer's password is
    rotated (the file, then etcd): that outdates every token, so both agents authenticate
    again at their next etcd call, a with the new password read from its file."""
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir(mode=0o700)
    password_file = secret_dir / "etcd-password"
    password_file.write_text(secure.password + "\n")
    password_file.chmod(0o600)
    rotated = f"rotated-{uuid.uuid4().hex}"
    tr = secure.certs["trainer"]
    tls = (
        f"protocol=https,ca_cert={secure.a.ca},ssl_cert={tr.cert},ssl_cert_key={tr.key},"
        f"key_prefix={PREFIX}"
    )
    report = tmp_path / "report.jsonl"
    # 8 s of training after the workers report: room for the rotation on a loaded machine
    # (the test checks that both agents still ran once it was done).
    script = ["--epochs", "1", "--steps-per-epoch", "16", "--sleep-per-step", "0.5",
              "--report", str(report)]  # fmt: skip
    agents = Agents(run_id, secure.endpoint, tmp_path)
    history = {"ETCD_ELASTIC_JOURNAL": str(tmp_path / "history.jsonl")}
    try:
        for name, conf, env in (
            ("a", f"{tls},user=trainer,password_file={password_file}", history),
            ("b", f"{tls},user=trainer2", {**history, "ETCD_ELASTIC_PASSWORD": secure.password2}),
        ):
            agents.start(
                name,
                ["--nnodes=2", "--nproc-per-node=1", f"--rdzv-conf={conf}",
                 f"--log-dir={tmp_path / 'logs' / name}", "--tee=3"],
                script, env=env,
            )  # fmt: skip
        wait_for("2 workers", lambda: len(read_report(report)) >= 2, STARTED,
                 diagnose=agents.logs)  # fmt: skip
        workers = [pid for agent in agents.procs for pid in descendants(agent.pid)]
        environments = {}
        for pid in workers:
            with contextlib.suppress(OSError):  # ended meanwhile
                environments[pid] = Path(f"/proc/{pid}/environ").read_bytes()
        assert environments, agents.logs()
        for secret in (secure.password, secure.password2):
            assert not [pid for pid, env in environments.items() if secret.encode() in env]

        password_file.write_text(rotated + "\n")
        secure.ctl("user", "passwd", "trainer", "--interactive=false", stdin=rotated + "\n")
        assert [agent.proc.poll() for agent in agents.procs] == [None, None], agents.logs()

        # rdzvctl: by certificate alone (its CN is the user), and by a password file.
        ops = secure.certs["ops"]
        by_cert = _rdzvctl("--endpoints", f"https://{secure.endpoint}", "--ca-cert",
                           str(secure.a.ca), "--cert", str(ops.cert), "--key", str(ops.key),
                           "--key-prefix", PREFIX, "status", run_id)  # fmt: skip
        by_password = _rdzvctl("--endpoints", f"https://{secure.endpoint}", "--ca-cert",
                               str(secure.a.ca), "--cert", str(tr.cert), "--key", str(tr.key),
                               "--user", "trainer", "--password-file", str(password_file),
                               "--key-prefix", PREFIX, "list")  # fmt: skip
        for done in (by_cert, by_password):
            assert done.returncode == 0, done.stderr
            (tmp_path / f"rdzvctl-{done.args[-1]}.out").write_text(done.stdout + done.stderr)
        assert run_id in by_cert.stdout and run_id in by_password.stdout

        for agent in agents.procs:
            assert agent.wait(STARTED) == 0, agents.logs()
    finally:
        agents.reap()
    # Closing the run re-authenticates agent a after the rotation. With its old password
    # it fails there (and, workers done, still exits 0; b then reports that a "left
    # before arriving"): exit codes alone would not show the rotation was survived.
    logs = agents.logs()
    for failure in ("rejected the credentials", "left before arriving", "not every node"):
        assert failure not in logs, logs
    assert "reading the password file again" not in logs  # the file came first
    assert (tmp_path / "history.jsonl").stat().st_size > 0
    assert len(list((tmp_path / "logs").rglob("*"))) > 4
    for secret in (secure.password, secure.password2, rotated):
        assert _files_holding(tmp_path, secret.encode(), but=password_file) == []
        assert _files_holding(secure.cluster.base_dir, secret.encode(), but=password_file) == []


# -- rotation -----------------------------------------------------------------------------


def _rotor(secure: Secure, **auth: str) -> EtcdClient:
    config = EtcdConfig(
        endpoints=(secure.endpoint,), protocol="https", user="rotor",
        request_timeout=2.0, retry_budget=10.0, **secure.tls(), **auth,
    )  # fmt: skip
    return EtcdClient(config)


def test_a_running_client_survives_a_password_rotation_through_its_file(
    secure: Secure, tmp_path: Path
) -> None:
    key = f"{PREFIX}/rotation".encode()
    password_file = tmp_path / "pw"
    password_file.write_text("first\n")
    with (
        _rotor(secure, password_file=str(password_file)) as by_file,
        _rotor(secure, password="first") as by_value,
    ):
        by_file.put(key, b"1")
        by_value.put(key, b"1")
        # The file first, then etcd: the client re-authenticates on its next call.
        password_file.write_text("second\n")
        secure.ctl("user", "passwd", "rotor", "--interactive=false", stdin="second\n")
        by_file.put(key, b"2")
        # etcd first, the file a moment later: the refused password is read again.
        later = threading.Timer(1.0, password_file.write_text, args=("third\n",))
        secure.ctl("user", "passwd", "rotor", "--interactive=false", stdin="third\n")
        later.start()
        try:
            by_file.put(key, b"3")
        finally:
            later.join()
        assert by_file.get(key)[0] is not None
        # A password given as a value (rdzv_conf password=, $ETCD_ELASTIC_PASSWORD) is
        # read once: that client does not survive the rotation, and says why.
        with pytest.raises(EtcdAuthError) as info:
            by_value.put(key, b"x")
        assert str(info.value) == (
            "etcd rejected the credentials of user 'rotor' (etcdserver: authentication "
            "failed, invalid user ID or password); check the user and password settings"
        )


def test_a_running_client_reconnects_with_its_renewed_certificate_once_the_old_is_revoked(
    secure: Secure,
) -> None:
    """A short-lived client certificate is renewed in place under a running client: the
    files are replaced by a new pair (the old key is gone) and the old certificate's
    identity is revoked. The client used to keep the pair it read at its start: every
    call after that was refused, and so was every stream at its first reconnect."""
    # Identities by certificate alone: etcd takes the CN as the user (docs/security.md).
    for user in ("rotating-old", "rotating-new"):
        secure.ctl("user", "add", user, "--no-password")
        secure.ctl("user", "grant-role", user, "etcd-elastic")
    files = secure.a.issue("rotating", "rotating-old", server=False)
    config = EtcdConfig(
        endpoints=(secure.endpoint,), protocol="https", ca_cert=str(secure.a.ca),
        cert=str(files.cert), cert_key=str(files.key), request_timeout=2.0, retry_budget=20.0,
    )  # fmt: skip
    key = f"{PREFIX}/cert-rotation".encode()
    seen: list[bytes] = []
    heard = threading.Event()

    def on_events(events: list[WatchEvent], _revision: int) -> None:
        seen.extend(event.kv.value for event in events)
        if b"after the reconnect" in seen:
            heard.set()

    with EtcdClient(config) as running:
        running.put(key, b"1")
        watch = running.watch(key, 0, on_events, lambda rev: None)
        watch.wait_created()
        renewed = secure.a.issue("renewed", "rotating-new", server=False)
        os.replace(renewed.cert, files.cert)
        os.replace(renewed.key, files.key)
        secure.ctl("user", "delete", "rotating-old")  # the old certificate is no good now
        running.put(key, b"2")  # a new call: the renewed pair
        secure.cluster.restart(0)  # every connection breaks: the watch stream reconnects
        running.put(key, b"after the reconnect")
        assert heard.wait(30), f"the watch did not resume; it saw {seen!r}"
        assert watch.error is None
        kv, _ = running.get(key)
        assert kv is not None and kv.value == b"after the reconnect"
        with EtcdClient(config) as fresh:
            assert fresh.get(key)[0] is not None


def test_a_watch_waiting_for_confirmation_hears_a_refused_handshake_at_once(
    secure: Secure,
) -> None:
    # etcdrun's first etcd call is such a watch: it used to wait out its whole budget.
    config = EtcdConfig(
        endpoints=(secure.endpoint,), protocol="https", ca_cert=str(secure.b.ca),
        cert=str(secure.certs["ops"].cert), cert_key=str(secure.certs["ops"].key),
        request_timeout=2.0, retry_budget=30.0,
    )  # fmt: skip
    errors: list[Exception] = []
    started = time.monotonic()
    with EtcdClient(config) as client:
        watch = client.watch(
            f"{PREFIX}/w".encode(), 0, lambda events, rev: None, lambda rev: None,
            on_error=errors.append,
        )  # fmt: skip
        with pytest.raises(EtcdTLSError) as info:
            watch.wait_created()
    assert time.monotonic() - started < 10.0  # the budget is 30 s
    assert errors == [info.value]
    assert str(info.value) == (
        f"the certificate of etcd at https://{secure.endpoint} is not signed by the CA in "
        f"{secure.b.ca}: set ca_cert (rdzvctl: --ca-cert) to the CA that signed etcd's "
        "--cert-file"
    )
