"""A throwaway Kubernetes control plane for tests: etcd + kube-apiserver + kwok, and on request
kube-controller-manager.

Everything listens on free 127.0.0.1 ports and lives in one state directory:

    DIR/kubeconfig       admin credentials (static token in group system:masters)
    DIR/state.json       pids and ports of what ``start`` launched (read by ``stop``)
    DIR/pki/             CA, serving certificate, service-account signing keys, token file
    DIR/etcd-data/       etcd's data
    DIR/logs/*.log       one log per process
    DIR/kwok-home/       HOME for kwok, so it never reads ~/.kwok
    DIR/kube-controller-manager.kubeconfig
                         the controller manager's own credentials (a client certificate for
                         system:kube-controller-manager), only with ``controller_manager=True``

The controller manager is opt-in (``start(DIR, controller_manager=True)``, ``scripts/test-cluster
up --controller-manager``): its garbage collector, Job, node-lifecycle and taint-eviction
controllers would act on the objects that tests written for a plane without one create and
clean up by hand. It runs the controllers in ``CONTROLLERS``, each with its own ServiceAccount's
credentials as a cluster runs them, and marks a node whose kubelet stopped reporting NotReady
after ``NODE_MONITOR_GRACE_PERIOD``.

``start(DIR)`` returns once ``/readyz`` answers; ``stop(DIR)`` ends the processes and removes
what ``start`` created; ``restart_apiserver(plane)`` stops kube-apiserver alone and starts it
again on the same port and state (an API server outage, for chaos tests). Attached mode (the
pytest fixtures) ties the processes to the calling process: their own process group,
PR_SET_PDEATHSIG=SIGKILL and an atexit hook, so they die with it even if it crashes. Detached
mode (``scripts/test-cluster up``) leaves them running for a later
``scripts/test-cluster down DIR``.

Standard library only (plus the openssl CLI).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import ctypes
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import k8sbinaries

ADMIN_USER = "edl-test-admin"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Allocation range for ClusterIPs only: nothing is ever sent there.
SERVICE_CIDR = "10.0.0.0/24"
# kwok writes these into node and pod status; loopback so nothing non-local is ever dialled.
KWOK_NODE_IP = "127.0.0.1"
KWOK_POD_CIDR = "127.10.0.0/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_ANNOTATION_VALUE = "fake"
LOOPBACK = "127.0.0.1"
CONTROLLER_MANAGER = "kube-controller-manager"
# What the controller manager runs when asked for (kube-controller-manager --controllers).
CONTROLLERS = (
    "job-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "garbage-collector-controller",
    "resourceclaim-controller",
    "device-taint-eviction-controller",
    "serviceaccount-token-controller",
    # PodDisruptionBudgets' status: without it the Eviction API refuses every pod a budget
    # selects ("still being processed"), whatever the budget allows.
    "disruption-controller",
)
# A node whose kubelet (or kwok's lease) stops reporting turns NotReady after this long (the
# default is 50 s). kwok renews its nodes' Leases every 10 s, kubelet every 10 s.
NODE_MONITOR_GRACE_PERIOD = "20s"

# Start order; stop() goes backwards, one at a time: clients first, etcd last.
PROCESS_ORDER = ("etcd", "kube-apiserver", "kwok", CONTROLLER_MANAGER)
CREATED = (
    "kubeconfig",
    "state.json",
    "pki",
    "etcd-data",
    "logs",
    "kwok-home",
    f"{CONTROLLER_MANAGER}.kubeconfig",
)

PR_SET_PDEATHSIG = 1
PORT_ATTEMPTS = 3

# kube-apiserver's audit log (logs/audit.log, one JSON object per line): every write made by a
# ServiceAccount outside kube-system, which is how the tests that run our components under their
# own RBAC see each write they make. Nothing else is logged (kwok, kubelets, the tests' admin
# and kube-controller-manager's controllers write far more, and are not what a test asks about).
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
"""


class ControlPlaneError(RuntimeError):
    """The control plane could not be started or stopped; the message says why."""


@dataclass
class ControlPlane:
    directory: Path
    server: str
    token: str
    ca_file: Path
    kubeconfig: Path
    pids: dict[str, int]
    startup_seconds: float
    attached: bool
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    def stop(self, timeout: float = 15.0) -> list[int]:
        return stop(self.directory, timeout=timeout)

    @property
    def audit_log(self) -> Path:
        """kube-apiserver's audit log (see AUDIT_POLICY)."""
        return self.directory / "logs" / "audit.log"


# Control planes started in attached mode by this process, stopped at exit.
_ATTACHED: dict[Path, ControlPlane] = {}


def _stop_all_attached() -> None:
    for directory in list(_ATTACHED):
        with contextlib.suppress(Exception):
            stop(directory)


atexit.register(_stop_all_attached)


# --- small helpers ------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"test-cluster: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (to tell a reused pid apart), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # exited, waiting to be reaped: no longer running
        return None
    return fields[19]


def pid_alive(pid: int, start_time: str | None = None) -> bool:
    current = _start_time(pid)
    return current is not None and (start_time is None or current == start_time)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join(f"    {line}" for line in text[-lines:])


def _binary(name: str) -> Path:
    path = k8sbinaries.find(name)
    if path is None:
        raise ControlPlaneError(
            f"{name} is not available (looked in {k8sbinaries.bin_dir()} and "
            "$KUBEBUILDER_ASSETS): run scripts/k8s-binaries first (the first build takes "
            "about 10 minutes on 2 cores)"
        )
    return path


def _stages() -> Path:
    path = k8sbinaries.stages_file()
    if path is None:
        raise ControlPlaneError(
            f"kwok stage file {k8sbinaries.STAGES_FILE} is missing from "
            f"{k8sbinaries.bin_dir()}: run scripts/k8s-binaries first"
        )
    return path


# --- certificates and credentials ---------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneError("the openssl CLI is needed to make the test certificates")
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def _make_pki(pki: Path) -> str:
    """CA, serving certificate, service-account key pair and the admin token file."""
    pki.mkdir(mode=0o700)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
        "-subj", "/CN=edl-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-new", *ec, "-keyout", "serving.key", "-out", "serving.csr",
        "-subj", "/CN=kube-apiserver",
        cwd=pki,
    )  # fmt: skip
    (pki / "serving.ext").write_text(
        f"subjectAltName=IP:{LOOPBACK},DNS:localhost\n"
        "extendedKeyUsage=serverAuth\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    _openssl(
        "x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "serving.crt", "-days", "365", "-extfile", "serving.ext",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-out", "sa.key",
        cwd=pki,
    )  # fmt: skip
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    token = secrets.token_urlsafe(32)
    tokens = pki / "tokens.csv"
    tokens.write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
    tokens.chmod(0o600)
    return token


def _client_certificate(pki: Path, name: str, subject: str) -> tuple[Path, Path]:
    """A client certificate ``pki/<name>.crt`` (key ``<name>.key``) for ``subject``, signed by the
    test CA, which the API server takes as the user CN in the groups O."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (pki / f"{name}.ext").write_text(
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n"
    )
    _openssl(
        "req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "365", "-extfile", f"{name}.ext",
        cwd=pki,
    )  # fmt: skip
    return pki / f"{name}.crt", pki / f"{name}.key"


def _write_kubeconfig(
    path: Path,
    server: str,
    ca_file: Path,
    token: str = "",
    *,
    user: str = ADMIN_USER,
    certificate: tuple[Path, Path] | None = None,
) -> None:
    """A kubeconfig for ``server`` as ``user``: a bearer ``token``, or a client ``certificate``
    (certificate and key files)."""
    credentials: dict[str, str] = {"token": token}
    if certificate is not None:
        credentials = {
            "client-certificate": str(certificate[0]),
            "client-key": str(certificate[1]),
        }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "edl-test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "edl-test", "context": {"cluster": "edl-test", "user": user}}],
        "current-context": "edl-test",
    }
    # JSON is valid YAML; kubectl and the Python client read it as a kubeconfig.
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# --- processes ----------------------------------------------------------------------------

_ETCD_FLAGS: dict[Path, str] = {}


def _etcd_supports(etcd: Path, flag: str) -> bool:
    if etcd not in _ETCD_FLAGS:
        result = subprocess.run([etcd, "--help"], capture_output=True, text=True, check=False)
        _ETCD_FLAGS[etcd] = result.stdout + result.stderr
    return flag in _ETCD_FLAGS[etcd]


def _etcd_argv(etcd: Path, directory: Path, client: int, peer: int) -> list[str]:
    client_url = f"http://{LOOPBACK}:{client}"
    peer_url = f"http://{LOOPBACK}:{peer}"
    argv = [
        str(etcd),
        "--name=edl-test",
        f"--data-dir={directory / 'etcd-data'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=edl-test={peer_url}",
        "--initial-cluster-state=new",
        "--log-level=warn",
    ]
    if _etcd_supports(etcd, "--unsafe-no-fsync"):
        argv.append("--unsafe-no-fsync")  # test data is throwaway; fsync only costs time
    return argv


def _apiserver_argv(apiserver: Path, directory: Path, etcd_port: int, port: int) -> list[str]:
    pki = directory / "pki"
    return [
        str(apiserver),
        f"--etcd-servers=http://{LOOPBACK}:{etcd_port}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'serving.crt'}",
        f"--tls-private-key-file={pki / 'serving.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--token-auth-file={pki / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--audit-policy-file={directory / 'logs' / 'audit-policy.yaml'}",
        f"--audit-log-path={directory / 'logs' / 'audit.log'}",
        "--audit-log-maxsize=100",
        "--audit-log-maxbackup=1",
        # Nothing creates the default ServiceAccounts that the ServiceAccount admission plugin
        # insists on: the controller manager, where one runs, runs no serviceaccount controller.
        "--disable-admission-plugins=ServiceAccount",
        "--endpoint-reconciler-type=none",
        # Only ever dial kwok's (loopback) node address, never resolve node names.
        "--kubelet-preferred-address-types=InternalIP",
        "--allow-privileged=true",
        "--profiling=false",
        "--v=1",
    ]


def _kwok_argv(kwok: Path, directory: Path) -> list[str]:
    return [
        str(kwok),
        f"--kubeconfig={directory / 'kubeconfig'}",
        f"--config={_stages()}",
        "--manage-nodes-with-annotation-selector="
        f"{KWOK_NODE_ANNOTATION}={KWOK_NODE_ANNOTATION_VALUE}",
        f"--node-ip={KWOK_NODE_IP}",
        f"--cidr={KWOK_POD_CIDR}",
    ]


def _controller_manager_argv(kcm: Path, directory: Path, port: int) -> list[str]:
    pki = directory / "pki"
    kubeconfig = directory / f"{CONTROLLER_MANAGER}.kubeconfig"
    return [
        str(kcm),
        f"--kubeconfig={kubeconfig}",
        # Its own endpoints (/healthz, /metrics) check callers' tokens and rights through the
        # API server as it; client certificates against the test CA. The lookup of the
        # API server's front-proxy CA is skipped: there is none, and the controller manager
        # would log the missing one again and again.
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--authentication-skip-lookup=true",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--cert-dir={pki / CONTROLLER_MANAGER}",  # its self-signed serving certificate
        # One instance, and no Lease left behind in kube-system.
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS)}",
        # Each controller acts as its ServiceAccount (bootstrap RBAC system:controller:*), with
        # tokens the controller manager requests for them, as clusters run it.
        "--use-service-account-credentials=true",
        # The serviceaccount-token controller signs legacy token Secrets with the key that
        # kube-apiserver signs and checks service-account tokens with.
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--node-monitor-grace-period={NODE_MONITOR_GRACE_PERIOD}",
        "--profiling=false",
        "--v=1",
    ]


_libc: ctypes.CDLL | None = None


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn: SIGKILL the child when the process that started it dies."""
    global _libc  # noqa: PLW0603 (loaded once, before any fork)
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _process_env(directory: Path) -> dict[str, str]:
    """The environment every control-plane process runs with (HOME keeps kwok off ~/.kwok)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(directory / "kwok-home"),
    }


def _spawn(
    name: str, argv: list[str], directory: Path, *, attached: bool, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    logfile = directory / "logs" / f"{name}.log"
    with logfile.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=directory,
            env=env,
            start_new_session=True,  # own process group: stop() signals the whole group
            preexec_fn=_die_with_parent() if attached else None,  # noqa: PLW1509
        )


def _https_get(port: int, path: str, ca_file: Path | None, token: str) -> int:
    """GET ``path`` on a loopback port; ``ca_file`` None: a self-signed serving certificate
    (the controller manager's), not verified."""
    if ca_file is None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(cafile=str(ca_file))
    conn = http.client.HTTPSConnection(LOOPBACK, port, context=context, timeout=2)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


# --- start / stop -------------------------------------------------------------------------


def _read_state(directory: Path) -> dict[str, object] | None:
    try:
        state = json.loads((directory / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _state_pids(state: dict[str, object]) -> dict[str, tuple[int, str | None]]:
    raw = state.get("processes", {})
    pids: dict[str, tuple[int, str | None]] = {}
    if isinstance(raw, dict):
        for name, entry in raw.items():
            if isinstance(entry, dict) and isinstance(entry.get("pid"), int):
                pids[name] = (entry["pid"], entry.get("start_time"))
    return pids


def start(
    directory: Path,
    *,
    attached: bool = True,
    timeout: float = 60.0,
    controller_manager: bool = False,
) -> ControlPlane:
    """Start etcd, kube-apiserver and kwok with their state in ``directory``; with
    ``controller_manager`` also kube-controller-manager, healthy before this returns.

    ``attached=True`` ties the processes to the calling thread's process (PR_SET_PDEATHSIG) and
    to its exit (atexit); call it from the main thread. ``attached=False`` leaves them running
    until ``stop(directory)``.
    """
    began = time.monotonic()
    directory = directory.resolve()
    names = k8sbinaries.CONTROL_PLANE + ((CONTROLLER_MANAGER,) if controller_manager else ())
    binaries = {name: _binary(name) for name in names}
    _stages()
    state = _read_state(directory)
    if state is not None:
        if any(pid_alive(pid, st) for pid, st in _state_pids(state).values()):
            raise ControlPlaneError(f"a control plane already runs in {directory}; stop it first")
        _remove_state(directory, state)
    created_dir = not directory.exists()
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            plane = _start_once(
                directory, binaries, attached=attached, timeout=timeout, created_dir=created_dir
            )
        except _PortTaken:
            if attempt == PORT_ATTEMPTS:
                raise
            continue
        plane.startup_seconds = time.monotonic() - began
        return plane
    raise AssertionError("unreachable")


class _PortTaken(ControlPlaneError):
    """A process found its (just probed) free port taken; start again with new ports."""


def _start_once(
    directory: Path,
    binaries: dict[str, Path],
    *,
    attached: bool,
    timeout: float,
    created_dir: bool,
) -> ControlPlane:
    directory.mkdir(parents=True, exist_ok=True)
    for name in CREATED:
        if (directory / name).exists():
            raise ControlPlaneError(f"{directory / name} exists; use a fresh directory")
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    ports = {"etcd": etcd_port, "etcd-peer": peer_port, "kube-apiserver": api_port}
    if CONTROLLER_MANAGER in binaries:
        ports[CONTROLLER_MANAGER] = free_port()
    server = f"https://{LOOPBACK}:{api_port}"
    kubeconfig = directory / "kubeconfig"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    processes: dict[str, object] = {}
    state = {
        "server": server,
        "kubeconfig": str(kubeconfig),
        "attached": attached,
        "owner_pid": os.getpid(),
        "created_dir": created_dir,
        "ports": ports,
        "processes": processes,
    }
    # Written first, so that stop() can clean up whatever happens next.
    (directory / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    plane = ControlPlane(
        directory=directory,
        server=server,
        token="",
        ca_file=directory / "pki" / "ca.crt",
        kubeconfig=kubeconfig,
        pids={},
        startup_seconds=0.0,
        attached=attached,
        _procs=procs,
    )
    if attached:
        _ATTACHED[directory] = plane
    try:
        (directory / "logs").mkdir()
        (directory / "logs" / "audit-policy.yaml").write_text(AUDIT_POLICY)
        (directory / "kwok-home").mkdir()
        plane.token = _make_pki(directory / "pki")
        _write_kubeconfig(kubeconfig, server, plane.ca_file, plane.token)
        env = _process_env(directory)
        argvs = {
            "etcd": _etcd_argv(binaries["etcd"], directory, etcd_port, peer_port),
            "kube-apiserver": _apiserver_argv(
                binaries["kube-apiserver"], directory, etcd_port, api_port
            ),
            "kwok": _kwok_argv(binaries["kwok"], directory),
        }
        if CONTROLLER_MANAGER in binaries:
            certificate = _client_certificate(
                directory / "pki", CONTROLLER_MANAGER, f"/CN=system:{CONTROLLER_MANAGER}"
            )
            _write_kubeconfig(
                directory / f"{CONTROLLER_MANAGER}.kubeconfig",
                server,
                plane.ca_file,
                user=f"system:{CONTROLLER_MANAGER}",
                certificate=certificate,
            )
            argvs[CONTROLLER_MANAGER] = _controller_manager_argv(
                binaries[CONTROLLER_MANAGER], directory, ports[CONTROLLER_MANAGER]
            )

        def launch(name: str) -> None:
            proc = _spawn(name, argvs[name], directory, attached=attached, env=env)
            procs[name] = proc
            plane.pids[name] = proc.pid
            processes[name] = {
                "pid": proc.pid,
                "start_time": _start_time(proc.pid),
                "argv": argvs[name],
                "log": str(directory / "logs" / f"{name}.log"),
            }
            (directory / "state.json").write_text(json.dumps(state, indent=2) + "\n")

        # All three at once: kube-apiserver retries etcd, kwok waits for the API itself.
        for name in PROCESS_ORDER:
            if name in argvs and name != CONTROLLER_MANAGER:
                launch(name)
        _wait_ready(
            port=api_port,
            ca_file=plane.ca_file,
            token=plane.token,
            procs=procs,
            directory=directory,
            timeout=timeout,
        )
        if CONTROLLER_MANAGER in argvs:
            # Only once ready: before the API server's bootstrap RBAC policy is in place the
            # controller manager is refused what it reads at start (and exits).
            launch(CONTROLLER_MANAGER)
            _wait_ready(
                port=ports[CONTROLLER_MANAGER],
                ca_file=None,
                token="",
                procs=procs,
                directory=directory,
                timeout=timeout,
                what=CONTROLLER_MANAGER,
                path="/healthz",
            )
    except BaseException:
        stop(directory, timeout=1.0)  # a half-started control plane needs no graceful exit
        raise
    return plane


def _wait_ready(
    *,
    port: int,
    ca_file: Path | None,
    token: str,
    procs: dict[str, subprocess.Popen[bytes]],
    directory: Path,
    timeout: float,
    what: str = "kube-apiserver",
    path: str = "/readyz",
) -> None:
    """Until ``what`` answers ``path`` with 200 on ``port``; ControlPlaneError (_PortTaken when a
    port was taken) as soon as one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                log = directory / "logs" / f"{name}.log"
                error = _PortTaken if "address already in use" in _tail(log) else ControlPlaneError
                raise error(
                    f"{name} exited with status {proc.returncode} during startup; "
                    f"last lines of {log}:\n{_tail(log)}"
                )
        try:
            status = _https_get(port, path, ca_file, token)
        except (OSError, http.client.HTTPException) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if status == http.client.OK:
                return
            last = f"{path} answered HTTP {status}"
        time.sleep(0.1)
    log = directory / "logs" / f"{what}.log"
    raise ControlPlaneError(
        f"{what} not ready after {timeout:.0f}s ({last}); last lines of {log}:\n{_tail(log)}"
    )


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # the process leads its own group (start_new_session)


def stop(directory: Path, *, timeout: float = 15.0) -> list[int]:
    """Stop what ``start`` launched in ``directory`` and remove its state; the stopped pids."""
    directory = directory.resolve()
    plane = _ATTACHED.pop(directory, None)
    state = _read_state(directory)
    if state is None:
        return []
    pids = _state_pids(state)
    running = {name: pid for name, (pid, st) in pids.items() if pid_alive(pid, st)}
    deadline = time.monotonic() + timeout
    # One after the other, clients first and etcd last: a kube-apiserver told to stop together
    # with its etcd hangs in its shutdown until it is killed (measured with v1.36 and v1.37:
    # over 30 s, against 0.3-1.4 s when etcd is still there).
    for name in reversed(PROCESS_ORDER):
        if name not in running:
            continue
        pid, start_time = pids[name]
        _signal_group(pid, signal.SIGTERM)
        proc = plane._procs.get(name) if plane is not None else None
        while pid_alive(pid, start_time) and time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                break
            time.sleep(0.05)
        if pid_alive(pid, start_time):
            _signal_group(pid, signal.SIGKILL)
    if plane is not None:
        for proc in plane._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)  # reap our own children so no zombie is left
    kill_deadline = time.monotonic() + 5
    while any(pid_alive(pid, st) for pid, st in pids.values()) and time.monotonic() < kill_deadline:
        time.sleep(0.05)
    left = [pid for pid, st in pids.values() if pid_alive(pid, st)]
    if left:
        raise ControlPlaneError(f"processes {left} from {directory} did not exit")
    _remove_state(directory, state)
    return [pid for _, (pid, _) in sorted(pids.items())]


def restart_apiserver(
    plane: ControlPlane, *, stop_timeout: float = 15.0, timeout: float = 60.0
) -> float:
    """Stop kube-apiserver and start it again: same flags, port, certificates and etcd, so
    clients only see it go away and come back (etcd and kwok keep running). SIGTERM first,
    SIGKILL after ``stop_timeout``. Returns once ``/readyz`` answers again; the seconds it was
    down. Attached: call it from the thread that started the plane (PR_SET_PDEATHSIG is tied to
    the thread that spawns a process)."""
    directory = plane.directory
    state = _read_state(directory)
    if state is None:
        raise ControlPlaneError(f"no control plane state in {directory}")
    processes = state.get("processes")
    ports = state.get("ports")
    entry = processes.get("kube-apiserver") if isinstance(processes, dict) else None
    port = ports.get("kube-apiserver") if isinstance(ports, dict) else None
    if not isinstance(entry, dict) or not isinstance(port, int):
        raise ControlPlaneError(f"{directory / 'state.json'} names no kube-apiserver")
    pid, start_time = entry["pid"], entry.get("start_time")
    down = time.monotonic()
    if pid_alive(pid, start_time):
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + stop_timeout
        while pid_alive(pid, start_time) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid, start_time):
            _signal_group(pid, signal.SIGKILL)
    old = plane._procs.get("kube-apiserver")
    if old is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.wait(timeout=5)  # reap it: no zombie, and the port is free again
    proc = _spawn(
        "kube-apiserver",
        list(entry["argv"]),
        directory,
        attached=plane.attached,
        env=_process_env(directory),
    )
    plane._procs["kube-apiserver"] = proc
    plane.pids["kube-apiserver"] = proc.pid
    entry.update(pid=proc.pid, start_time=_start_time(proc.pid))
    (directory / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    _wait_ready(
        port=port,
        ca_file=plane.ca_file,
        token=plane.token,
        procs={"kube-apiserver": proc},
        directory=directory,
        timeout=timeout,
    )
    return time.monotonic() - down


def _remove_state(directory: Path, state: dict[str, object]) -> None:
    for name in CREATED:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if state.get("created_dir"):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if nothing else was put there


# --- CLI ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/test-cluster",
        description=(
            "Start or stop a local etcd + kube-apiserver + kwok control plane on 127.0.0.1 "
            "(binaries from scripts/k8s-binaries). `up DIR` returns once the API is ready "
            "and writes DIR/kubeconfig; `down DIR` stops the processes and removes the state."
        ),
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for /readyz")
    parser.add_argument(
        "--controller-manager",
        action="store_true",
        help=(
            f"up: also run kube-controller-manager ({', '.join(CONTROLLERS)}; nodes silent for "
            f"{NODE_MONITOR_GRACE_PERIOD} turn NotReady)"
        ),
    )
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            plane = start(
                args.directory,
                attached=False,
                timeout=args.timeout,
                controller_manager=args.controller_manager,
            )
            pids = ", ".join(f"{name} {pid}" for name, pid in plane.pids.items())
            _log(f"ready in {plane.startup_seconds:.1f}s at {plane.server} (pids: {pids})")
            _log(f"export KUBECONFIG={plane.kubeconfig}")
            print(plane.kubeconfig)
        else:
            stopped = stop(args.directory)
            _log(f"stopped pids {stopped}" if stopped else "nothing was running")
    except ControlPlaneError as exc:
        _log(f"ERROR: {exc}")
        return 1
    return 0
