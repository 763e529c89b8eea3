"""Real kubelet nodes for tests: kubelet v1.37 with our fake container runtime, each in a private
mount namespace, registered with a test control plane (testcluster.py).

Layout of one node (``NODE_DIR``, the host's view):

    NODE_DIR/node.env               shell assignments for the tests and the agent (see ENV_KEYS)
    NODE_DIR/state.json             pids of the fake runtime and kubelet (read by ``stop``)
    NODE_DIR/kubelet/               kubelet's root dir, /var/lib/kubelet inside the namespace:
             device-plugins/        where an agent on the host serves device-plugin sockets
             plugins_registry/      kubelet's plugin watcher (DRA)
             pod-resources/kubelet.sock
    NODE_DIR/cri.sock, control.sock the fake runtime's CRI and control sockets
    NODE_DIR/cri.jsonl              every CreateContainer the runtime received, one JSON line each
    NODE_DIR/logs/                  kubelet.log, fake-cri.log
    NODE_DIR/pki/, config/          the node's client certificate, kubeconfig, KubeletConfiguration
    NODE_DIR/mnt/                   what is mounted over host paths inside the namespace

Kubelet changes the host it runs on: it sets three sysctls, creates /var/log/pods, mounts its
root dir rshared, runs mount(8) (which writes /run/mount), and always uses the compile-time
device-plugin dir /var/lib/kubelet/device-plugins. So it runs under ``unshare --mount
--propagation private``: overlays (upper dirs in NODE_DIR) over /var/lib and /run, binds of
NODE_DIR/kubelet over /var/lib/kubelet (made rshared, as kubelet wants it) and a scratch dir over
/var/log, and files holding the values kubelet wants bound over those sysctls, so it reads them
as already set and writes nothing. Every mount is ``mount -n`` and dies with the namespace, i.e.
with kubelet. Kubelet creates no cgroup: QoS cgroups and node-allocatable enforcement are off,
and the fake runtime runs no processes.

The fake runtime (scripts/fakecri, built by k8s-binaries) answers kubelet's CRI calls, logs
every CreateContainer and lets a test make a running container exit with a code
(``exit_container``), after which kubelet reports it and applies the pod's restartPolicy.

In exec mode (``exec_mode=True``, ``test-node up --exec``) the runtime runs each container's
command as a host process: it is started in the namespace (which it owns, kubelet joins it with
nsenter), each pod gets its own loopback address from the node's /16 of 127/8 (``pod_ip_range``,
unique among the nodes of one control plane), logs go where kubelet reads them (the host sees
/var/log as NODE_DIR/mnt/varlog: ``Node.host_path``), exit codes are the processes' own, and the
env edits of the CDI devices are applied from the specs in ``cdi_dirs``. Kubelet accepts anonymous
requests on its port then, so that the API server's pods/log reaches it.

Standard library only (plus the openssl CLI, mount and unshare).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import k8sbinaries
import testcluster

LOOPBACK = "127.0.0.1"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# What kubelet wants these sysctls to be (it writes them when they differ).
SYSCTLS = {
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}
ENV_KEYS = (
    "NODE_NAME",
    "KUBELET_DIR",
    "DEVICE_PLUGIN_DIR",
    "PLUGINS_REGISTRY_DIR",
    "POD_RESOURCES_SOCKET",
    "CRI_LOG",
    "CRI_CONTROL_SOCKET",
    "KUBECONFIG",
)
# A unix socket path is at most 107 bytes; the agent adds up to ~40 to DEVICE_PLUGIN_DIR.
MAX_NODE_DIR = 60
PROCESS_ORDER = ("fake-cri", "kubelet")


class NodeError(RuntimeError):
    """A kubelet node could not be started, reached or stopped; the message says why."""


def _log(message: str) -> None:
    print(f"test-node: {message}", file=sys.stderr, flush=True)


def preflight() -> str | None:
    """Why kubelet nodes cannot run on this machine (one line), or None when they can."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (kubelet mounts in its own mount namespace)")
    for tool in ("unshare", "nsenter", "mount", "openssl"):
        if shutil.which(tool) is None:
            missing.append(f"the {tool} command")
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "\toverlay\n" not in filesystems:
        missing.append("overlayfs (modprobe overlay)")
    if not missing:
        return None
    return "kubelet test nodes need " + ", ".join(missing) + "; none of it is available here"


# --- configuration ------------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    """Where one node's files are, on the host."""

    root: Path

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def device_plugins(self) -> Path:
        return self.kubelet / "device-plugins"

    @property
    def plugins_registry(self) -> Path:
        return self.kubelet / "plugins_registry"

    @property
    def pod_resources(self) -> Path:
        return self.kubelet / "pod-resources" / "kubelet.sock"

    @property
    def cri_socket(self) -> Path:
        return self.root / "cri.sock"

    @property
    def control_socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def cri_log(self) -> Path:
        return self.root / "cri.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def env_file(self) -> Path:
        return self.root / "node.env"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "config" / "kubelet.kubeconfig"


def _node_client_cert(plane_pki: Path, paths: Paths, name: str) -> tuple[Path, Path]:
    """A client certificate for system:node:<name> in system:nodes, signed by the test CA, so
    the API server's Node authorizer treats kubelet as that node."""
    pki = paths.root / "pki"
    pki.mkdir(mode=0o700, exist_ok=True)
    key, csr, crt = pki / "node.key", pki / "node.csr", pki / "node.crt"
    ext = pki / "node.ext"
    ext.write_text("extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-new", *ec, "-keyout", str(key), "-out", str(csr),
             "-subj", f"/O=system:nodes/CN=system:node:{name}")  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(plane_pki / "ca.crt"),
             "-CAkey", str(plane_pki / "ca.key"), "-CAcreateserial",
             "-CAserial", str(pki / "ca.srl"), "-out", str(crt), "-days", "30",
             "-extfile", str(ext))  # fmt: skip
    return crt, key


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NodeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _write_kubeconfig(paths: Paths, server: str, ca_file: Path, crt: Path, key: Path) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "edl-test",
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [
            {"name": "node", "user": {"client-certificate": str(crt), "client-key": str(key)}}
        ],
        "contexts": [{"name": "edl-test", "context": {"cluster": "edl-test", "user": "node"}}],
        "current-context": "edl-test",
    }
    paths.kubeconfig.parent.mkdir(exist_ok=True)
    paths.kubeconfig.write_text(json.dumps(config, indent=2) + "\n")
    paths.kubeconfig.chmod(0o600)


def kubelet_config(
    paths: Paths, *, port: int, healthz_port: int, exec_mode: bool = False
) -> dict[str, object]:
    """A KubeletConfiguration that runs on a 2-core cgroup-v1 machine without touching it. In
    exec mode the API server (which has no kubelet client certificate) may read logs, and a
    crashed container is restarted after 1 s (KubeletCrashLoopBackOffMax; 10 s, doubling, else)."""
    config: dict[str, object] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # 1.35+ refuses cgroup v1 otherwise
        "cgroupsPerQOS": False,  # no pod or QoS cgroups
        "enforceNodeAllocatable": [],
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "address": LOOPBACK,
        "port": port,
        "healthzBindAddress": LOOPBACK,
        "healthzPort": healthz_port,
        "readOnlyPort": 0,
        "authentication": {"anonymous": {"enabled": exec_mode}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "makeIPTablesUtilChains": False,
        "evictionHard": {"memory.available": "100Mi"},
        # Allocatable follows the device plugins within a second (the default 10 s: ~11 s).
        "nodeStatusUpdateFrequency": "1s",
        "nodeStatusReportFrequency": "1s",
        "syncFrequency": "5s",
        "featureGates": {"ResourceHealthStatus": True},
        "containerRuntimeEndpoint": f"unix://{paths.cri_socket}",
        "imageServiceEndpoint": f"unix://{paths.cri_socket}",
        "staticPodPath": "",
        "resolvConf": "",
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
    }
    if exec_mode:
        config["crashLoopBackOff"] = {"maxContainerRestartPeriod": "1s"}
    return config


# --- the mount namespace ------------------------------------------------------------------


def namespace_script(paths: Paths, kubelet_argv: list[str]) -> str:
    """The shell run inside ``unshare --mount``: mounts, then exec kubelet (same pid), or in exec
    mode the runtime, whose namespace kubelet then joins."""
    mnt = paths.root / "mnt"
    lines = ["set -eu"]
    for target, name in (("/var/lib", "varlib"), ("/run", "run")):
        upper, work = mnt / name / "upper", mnt / name / "work"
        options = f"lowerdir={target},upperdir={upper},workdir={work}"
        lines.append(f"mount -n -t overlay overlay -o {shlex.quote(options)} {target}")
    lines += [
        "mkdir -p /var/lib/kubelet",
        f"mount -n --bind {shlex.quote(str(paths.kubelet))} /var/lib/kubelet",
        # Shared already, so kubelet does not bind-mount its root dir over itself at start: that
        # mount raced kubelet's socket listeners (a socket bound before it and renamed after it
        # fails with EXDEV; kubelet v1.37 exited on its pod-resources socket so).
        "mount -n --make-rshared /var/lib/kubelet",
        f"mount -n --bind {shlex.quote(str(mnt / 'varlog'))} /var/log",
    ]
    for key in SYSCTLS:
        source = mnt / "sysctl" / key.replace("/", ".")
        lines.append(f"mount -n --bind {shlex.quote(str(source))} /proc/sys/{key}")
    lines.append("exec " + shlex.join(kubelet_argv))
    return "\n".join(lines) + "\n"


def _prepare_mounts(paths: Paths) -> None:
    mnt = paths.root / "mnt"
    for name in ("varlib", "run"):
        (mnt / name / "upper").mkdir(parents=True, exist_ok=True)
        (mnt / name / "work").mkdir(parents=True, exist_ok=True)
    (mnt / "varlog").mkdir(parents=True, exist_ok=True)
    (mnt / "sysctl").mkdir(parents=True, exist_ok=True)
    for key, value in SYSCTLS.items():
        (mnt / "sysctl" / key.replace("/", ".")).write_text(value + "\n")
    for directory in (paths.device_plugins, paths.plugins_registry, paths.pod_resources.parent):
        directory.mkdir(parents=True, exist_ok=True)


# --- one node -----------------------------------------------------------------------------


@dataclass
class Node:
    """A running kubelet node (``start``); ``stop`` ends it and removes what it made."""

    name: str
    paths: Paths
    server: str
    admin_token: str
    ca_file: Path
    pids: dict[str, int]
    attached: bool
    exec_mode: bool = False
    pod_ip_range: str = ""  # exec mode: the /16 of 127/8 its pods' IPs come from
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def env(self) -> dict[str, str]:
        return {
            "NODE_NAME": self.name,
            "KUBELET_DIR": str(self.paths.kubelet),
            "DEVICE_PLUGIN_DIR": str(self.paths.device_plugins),
            "PLUGINS_REGISTRY_DIR": str(self.paths.plugins_registry),
            "POD_RESOURCES_SOCKET": str(self.paths.pod_resources),
            "CRI_LOG": str(self.paths.cri_log),
            "CRI_CONTROL_SOCKET": str(self.paths.control_socket),
            "KUBECONFIG": str(self.paths.kubeconfig),
        }

    def kubelet_alive(self) -> bool:
        proc = self._procs.get("kubelet")
        if proc is not None:
            return proc.poll() is None
        return testcluster.pid_alive(self.pids["kubelet"])

    def restart_kubelet(self, *, timeout: float = 60.0) -> float:
        """Stop kubelet (SIGTERM) and start it again as kubelet restarts on a real node (its
        root dir, checkpoints and pods kept); seconds until the new one serves kubelet.sock."""
        state = _read_state(self.paths)
        _stop_processes(self.paths, state, only=("kubelet",), procs=self._procs)
        registration = self.paths.device_plugins / "kubelet.sock"
        with contextlib.suppress(FileNotFoundError):
            registration.unlink()  # kubelet recreates it; waiting for it below must see the new one
        began = time.monotonic()
        _start_kubelet(self, state)
        while not _socket_answers(registration):
            if not self.kubelet_alive() or time.monotonic() - began > timeout:
                raise NodeError(
                    f"kubelet of {self.name} did not serve {registration} again; log:\n"
                    f"{testcluster._tail(self.paths.logs / 'kubelet.log')}"
                )
            time.sleep(0.02)
        return time.monotonic() - began

    def cut_off(self) -> list[int]:
        """Stop kubelet alone, which is how a network partition looks from the control plane:
        the Node's Lease and status stop being renewed while the runtime and its containers
        keep running (kubelet stops pods only when asked, never when it exits)."""
        state = _read_state(self.paths)
        return _stop_processes(self.paths, state, only=("kubelet",), procs=self._procs)

    def exit_container(
        self, namespace: str, pod: str, container: str, code: int
    ) -> dict[str, object]:
        return exit_container(self.paths.control_socket, namespace, pod, container, code)

    def stop(self, *, delete_node: bool = True) -> list[int]:
        return stop_node(self.paths.root, delete_node=delete_node, procs=self._procs)

    def containers(self) -> list[dict[str, object]]:
        """Every container the runtime knows: id, namespace, pod, container, attempt, state,
        exit_code, sandbox_id; in exec mode ``pid`` (while its first process lives) and
        ``log_path`` (as kubelet sees it: ``host_path`` gives the file)."""
        status, body = control(self.paths.control_socket, "GET", "/containers")
        if status != http.client.OK or not isinstance(body, list):
            raise NodeError(f"listing the containers of {self.name}: {status} {body}")
        return body

    def host_path(self, path: str) -> Path:
        """Where a path of the node's mount namespace is on the host."""
        for inside, outside in (
            ("/var/log", self.paths.root / "mnt" / "varlog"),
            ("/var/lib/kubelet", self.paths.kubelet),
        ):
            if path == inside or path.startswith(inside + "/"):
                return outside / path[len(inside) :].lstrip("/")
        return Path(path)


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _read_state(paths: Paths) -> dict[str, object]:
    try:
        state = json.loads(paths.state.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(paths: Paths, state: dict[str, object]) -> None:
    tmp = paths.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(paths.state)


def _spawn(paths: Paths, name: str, argv: list[str], *, attached: bool) -> subprocess.Popen[bytes]:
    """Like the control plane's processes: own process group, log in ``logs/<name>.log``."""
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "HOME": str(paths.root)}
    return testcluster._spawn(name, argv, paths.root, attached=attached, env=env)


def _record(
    paths: Paths, state: dict[str, object], name: str, proc: subprocess.Popen[bytes]
) -> None:
    processes = state.setdefault("processes", {})
    if not isinstance(processes, dict):
        raise NodeError(f"{paths.state} is damaged: 'processes' is not a mapping")
    processes[name] = {"pid": proc.pid, "start_time": testcluster._start_time(proc.pid)}
    _write_state(paths, state)


def _in_namespace(paths: Paths, argv: list[str]) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
            namespace_script(paths, argv)]  # fmt: skip


def _start_kubelet(node: Node, state: dict[str, object]) -> None:
    argv = state.get("kubelet_argv")
    if not isinstance(argv, list):
        raise NodeError(f"{node.paths.state} has no kubelet command line in its state")
    kubelet = [str(a) for a in argv]
    if node.exec_mode:  # the runtime owns the namespace: its processes must see kubelet's paths
        runtime = node.pids["fake-cri"]
        command = ["nsenter", f"--mount=/proc/{runtime}/ns/mnt", f"--wd={node.paths.root}", "--"]
        command += kubelet
    else:
        command = _in_namespace(node.paths, kubelet)
    proc = _spawn(node.paths, "kubelet", command, attached=node.attached)
    node._procs["kubelet"] = proc
    node.pids["kubelet"] = proc.pid
    _record(node.paths, state, "kubelet", proc)


def start_node_on(
    plane: testcluster.ControlPlane,
    root: Path,
    name: str,
    *,
    attached: bool = True,
    timeout: float = 60.0,
    exec_mode: bool = False,
    cdi_dirs: Sequence[Path] = (),
) -> Node:
    """`start_node` registered with the control plane `plane` (its server, token and CA); in exec
    mode its pods' IPs come from a /16 no other node of the plane has."""
    return start_node(
        root,
        name,
        server=plane.server,
        admin_token=plane.token,
        ca_file=plane.ca_file,
        ca_key=plane.ca_file.with_name("ca.key"),
        attached=attached,
        timeout=timeout,
        exec_mode=exec_mode,
        cdi_dirs=cdi_dirs,
        pod_ip_ranges=plane.directory / "pod-ip-ranges" if exec_mode else None,
    )


# Exec-mode nodes take 127.N.0.0/16 for one N of these (127.0/16 is the control plane's).
POD_IP_BLOCKS = range(64, 255)


def _give_pod_ip_range(node: Node, state: dict[str, object], directory: Path | None) -> None:
    node.pod_ip_range = f"127.{POD_IP_BLOCKS[0]}.0.0/16"
    if directory is not None:
        node.pod_ip_range, claim = _claim_pod_ip_range(directory)
        state["pod_ip_claim"] = str(claim)  # released by stop_node
    state["pod_ip_range"] = node.pod_ip_range


def _claim_pod_ip_range(directory: Path) -> tuple[str, Path]:
    """A /16 of 127/8 for one node's pods, held by a directory entry (mkdir is atomic)."""
    directory.mkdir(parents=True, exist_ok=True)
    for block in POD_IP_BLOCKS:
        claim = directory / str(block)
        try:
            claim.mkdir()
        except FileExistsError:
            continue
        return f"127.{block}.0.0/16", claim
    raise NodeError(f"every pod IP range in {directory} is taken")


def start_node(
    root: Path,
    name: str,
    *,
    server: str,
    admin_token: str,
    ca_file: Path,
    ca_key: Path,
    attached: bool = True,
    timeout: float = 60.0,
    exec_mode: bool = False,
    cdi_dirs: Sequence[Path] = (),
    pod_ip_ranges: Path | None = None,
) -> Node:
    """Start one kubelet node in ``root`` (a short path: sockets live there) and return once its
    Node is Ready and untainted. ``exec_mode``: containers run as processes (module docstring),
    with the CDI specs in ``cdi_dirs`` and a pod IP range claimed in ``pod_ip_ranges`` (a
    directory the nodes of one platform share; 127.64.0.0/16 when None)."""
    problem = preflight()
    if problem is not None:
        raise NodeError(problem)
    root = root.resolve()
    for forbidden in (Path("/var/lib"), Path("/run"), Path("/var/log")):
        if root.is_relative_to(forbidden):
            raise NodeError(f"{root} is under {forbidden}, which the node's namespace overlays")
    if len(str(root)) > MAX_NODE_DIR:
        raise NodeError(
            f"{root} is {len(str(root))} bytes long; keep a node dir under {MAX_NODE_DIR} "
            "bytes so that the sockets in it fit a unix socket path"
        )
    binaries = {}
    for binary in ("kubelet", "edl-fake-cri"):
        found = k8sbinaries.find(binary)
        if found is None:
            raise NodeError(f"{binary} is not in {k8sbinaries.bin_dir()}: run scripts/k8s-binaries")
        binaries[binary] = found
    paths = Paths(root)
    if _read_state(paths).get("processes"):
        raise NodeError(f"a node already runs in {root}; stop it first")
    root.mkdir(parents=True, exist_ok=True)
    paths.logs.mkdir(exist_ok=True)
    _prepare_mounts(paths)
    node = Node(name, paths, server, admin_token, ca_file, {}, attached, exec_mode)
    state: dict[str, object] = {
        "name": name,
        "server": server,
        "attached": attached,
        "admin_token": admin_token,
        "ca_file": str(ca_file),
    }
    if exec_mode:
        _give_pod_ip_range(node, state, pod_ip_ranges)
    _write_state(paths, state)
    try:
        crt, key = _node_client_cert(ca_key.parent, paths, name)
        _write_kubeconfig(paths, server, ca_file, crt, key)
        port, healthz = testcluster.free_port(), testcluster.free_port()
        config = paths.root / "config" / "kubelet.yaml"
        settings = kubelet_config(paths, port=port, healthz_port=healthz, exec_mode=exec_mode)
        config.write_text(json.dumps(settings, indent=2))
        state["kubelet_argv"] = [
            str(binaries["kubelet"]),
            f"--config={config}",
            f"--kubeconfig={paths.kubeconfig}",
            f"--hostname-override={name}",
            f"--node-ip={LOOPBACK}",
            "--root-dir=/var/lib/kubelet",
            "--v=2",
        ]
        state["healthz_port"] = healthz
        runtime = _runtime_command(binaries["edl-fake-cri"], node, cdi_dirs)
        cri = _spawn(paths, "fake-cri", runtime, attached=attached)
        node._procs["fake-cri"] = cri
        node.pids["fake-cri"] = cri.pid
        _record(paths, state, "fake-cri", cri)
        _wait(
            lambda: _socket_answers(paths.cri_socket),
            f"the fake runtime's socket {paths.cri_socket}",
            node,
            timeout,
        )
        _start_kubelet(node, state)
        _wait_ready(node, timeout)
        if exec_mode:
            _set_address(node)
        paths.env_file.write_text(
            "".join(f"{key}={shlex.quote(value)}\n" for key, value in node.env.items())
        )
    except BaseException:
        with contextlib.suppress(Exception):
            stop_node(root, delete_node=True, timeout=2.0, procs=node._procs)  # reaped too
        raise
    return node


def _runtime_command(binary: Path, node: Node, cdi_dirs: Sequence[Path]) -> list[str]:
    paths = node.paths
    argv = [
        str(binary),
        f"--socket={paths.cri_socket}",
        f"--control={paths.control_socket}",
        f"--log={paths.cri_log}",
        f"--fs-mountpoint={_mountpoint(paths.root)}",
    ]
    if not node.exec_mode:
        return argv
    argv += ["--exec", f"--pod-ip-range={node.pod_ip_range}"]
    argv += [f"--cdi-dir={Path(d).resolve()}" for d in cdi_dirs]
    return _in_namespace(paths, argv)


def _mountpoint(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def _wait(check: Callable[[], bool], what: str, node: Node, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        for name, proc in node._procs.items():
            if proc.poll() is not None:
                log = node.paths.logs / f"{name}.log"
                raise NodeError(
                    f"{name} of node {node.name} exited with {proc.returncode} while waiting "
                    f"for {what}; last lines of {log}:\n{testcluster._tail(log)}"
                )
        if time.monotonic() > deadline:
            log = node.paths.logs / "kubelet.log"
            raise NodeError(
                f"timed out after {timeout:.0f}s waiting for {what}; last lines of {log}:\n"
                f"{testcluster._tail(log)}"
            )
        time.sleep(0.1)


# --- the API, with the admin token (standard library only) ----------------------------------


def api(
    node: Node, method: str, path: str, body: object = None, *, content_type: str = ""
) -> tuple[int, object]:
    host, port = node.server.removeprefix("https://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(node.ca_file))
    conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)
    headers = {"Authorization": f"Bearer {node.admin_token}", "Accept": "application/json"}
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        headers["Content-Type"] = content_type or "application/json"
    try:
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data) if data else None
    except ValueError:
        return response.status, data.decode(errors="replace")


def _node_object(node: Node) -> dict[str, object] | None:
    status, body = api(node, "GET", f"/api/v1/nodes/{node.name}")
    return body if status == http.client.OK and isinstance(body, dict) else None


def _ready(body: dict[str, object]) -> bool:
    status = body.get("status")
    conditions = status.get("conditions", []) if isinstance(status, dict) else []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _wait_ready(node: Node, timeout: float) -> None:
    """Ready, then lift the not-ready taint as the node lifecycle controller would (the plane runs
    none unless started with the controller manager, whose controller lifts it too)."""
    seen: dict[str, object] = {}

    def ready() -> bool:
        body = _node_object(node)
        if body is None or not _ready(body):
            return False
        seen.update(body)
        return True

    _wait(ready, f"Node {node.name} to be Ready", node, timeout)
    spec = seen.get("spec")
    taints = spec.get("taints", []) if isinstance(spec, dict) else []
    kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
    if len(kept) != len(taints):
        status, body = api(
            node,
            "PATCH",
            f"/api/v1/nodes/{node.name}",
            {"spec": {"taints": kept or None}},
            content_type="application/merge-patch+json",
        )
        if status != http.client.OK:
            raise NodeError(f"could not lift the not-ready taint of {node.name}: {status} {body}")


def _set_address(node: Node) -> None:
    """Kubelet reports no address for a loopback node IP (it refuses one), so the API server
    cannot reach it for logs; set the address it serves on. Kubelet keeps it: its address setter
    fails before it changes the list."""
    status, body = api(
        node,
        "PATCH",
        f"/api/v1/nodes/{node.name}/status",
        {"status": {"addresses": [{"type": "InternalIP", "address": LOOPBACK}]}},
        content_type="application/merge-patch+json",
    )
    if status != http.client.OK:
        raise NodeError(f"could not set the address of {node.name}: {status} {body}")


# --- stopping -----------------------------------------------------------------------------


def _stop_processes(
    paths: Paths,
    state: dict[str, object],
    *,
    only: tuple[str, ...] = PROCESS_ORDER,
    procs: dict[str, subprocess.Popen[bytes]] | None = None,
    timeout: float = 15.0,
) -> list[int]:
    raw = state.get("processes")
    entries = raw if isinstance(raw, dict) else {}
    stopped = []
    # kubelet first: it stops pods through the runtime only when it is asked to, never on exit.
    for name in reversed(PROCESS_ORDER):
        entry = entries.get(name)
        if name not in only or not isinstance(entry, dict):
            continue
        pid, start_time = int(entry["pid"]), entry.get("start_time")
        proc = (procs or {}).get(name)
        if testcluster.pid_alive(pid, start_time):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while testcluster.pid_alive(pid, start_time) and time.monotonic() < deadline:
                if proc is not None and proc.poll() is not None:
                    break
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if testcluster.pid_alive(pid, start_time):
                    os.killpg(pid, signal.SIGKILL)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while testcluster.pid_alive(pid, start_time) and time.monotonic() < deadline:
            time.sleep(0.05)
        if testcluster.pid_alive(pid, start_time):
            raise NodeError(f"{name} (pid {pid}) of {paths.root} did not exit")
        entries.pop(name, None)
        stopped.append(pid)
    _write_state(paths, state)
    return stopped


def stop_node(
    root: Path,
    *,
    delete_node: bool = True,
    timeout: float = 15.0,
    procs: dict[str, subprocess.Popen[bytes]] | None = None,
) -> list[int]:
    """Stop the node in ``root``, delete its Node object and remove ``root``; idempotent.
    ``procs``: the Popen objects of a node started by this process, reaped here."""
    paths = Paths(root.resolve())
    state = _read_state(paths)
    if not state:
        return []
    stopped = _stop_processes(paths, state, timeout=timeout, procs=procs)
    if isinstance(state.get("pod_ip_claim"), str):
        with contextlib.suppress(OSError):
            Path(str(state["pod_ip_claim"])).rmdir()
    if delete_node and isinstance(state.get("name"), str):
        with contextlib.suppress(Exception):
            _delete_node_object(paths, state)
    shutil.rmtree(paths.root, ignore_errors=True)
    return stopped


def _delete_node_object(paths: Paths, state: dict[str, object]) -> None:
    """A stopped kubelet's Node would stay Ready for ever (no node lifecycle controller runs), or
    turn NotReady and stay (one runs): remove it and its Lease."""
    token = state.get("admin_token")
    if not isinstance(token, str):
        return
    node = Node(
        str(state["name"]),
        paths,
        str(state["server"]),
        token,
        Path(str(state["ca_file"])),
        {},
        False,
    )
    api(node, "DELETE", f"/api/v1/nodes/{node.name}")
    api(
        node,
        "DELETE",
        f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node.name}",
    )


# --- the fake runtime's control socket -----------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def control(
    control_socket: Path, method: str, path: str, body: object = None
) -> tuple[int, object]:
    conn = _UnixHTTPConnection(control_socket)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload else {}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        data = response.read()
    except OSError as exc:
        raise NodeError(f"the fake runtime's control socket {control_socket}: {exc}") from exc
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode(errors="replace")


def exit_container(
    control_socket: Path, namespace: str, pod: str, container: str, code: int
) -> dict[str, object]:
    """Make the running ``container`` of ``namespace/pod`` exit with ``code``."""
    status, body = control(
        control_socket,
        "POST",
        "/exit",
        {"namespace": namespace, "pod": pod, "container": container, "code": code},
    )
    if status != http.client.OK or not isinstance(body, dict):
        raise NodeError(f"no running container {container} in {namespace}/{pod}: {body}")
    return body


def cri_log(path: Path) -> list[dict[str, object]]:
    """The CreateContainer requests the fake runtime received, oldest first."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


# --- a control plane with nodes (scripts/test-node) -----------------------------------------


def node_names(count: int) -> list[str]:
    return [f"edl-node-{i}" for i in range(count)]


def _plane_credentials(directory: Path) -> tuple[str, str, Path]:
    """Server, admin token and CA file of the control plane in ``directory``."""
    try:
        config = json.loads((directory / "kubeconfig").read_text())
        server = str(config["clusters"][0]["cluster"]["server"])
        token = str(config["users"][0]["user"]["token"])
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise NodeError(f"no test control plane in {directory} ({exc})") from exc
    return server, token, directory / "pki" / "ca.crt"


def up(
    directory: Path,
    count: int,
    *,
    timeout: float = 60.0,
    controller_manager: bool = False,
    exec_mode: bool = False,
    cdi_dirs: Sequence[Path] = (),
) -> list[Node]:
    """A control plane (detached) in ``directory`` and ``count`` kubelet nodes under
    ``directory/nodes/``; returns once every node is Ready. ``controller_manager``: the plane
    runs kube-controller-manager too (testcluster.CONTROLLERS); ``exec_mode``, ``cdi_dirs``: as
    for `start_node`."""
    problem = preflight()
    if problem is not None:
        raise NodeError(problem)
    directory = directory.resolve()
    longest = directory / "nodes" / node_names(count)[-1]
    if len(str(longest)) > MAX_NODE_DIR:
        raise NodeError(
            f"{directory} is too long for the node sockets under it ({len(str(longest))} bytes "
            f"for {longest}; at most {MAX_NODE_DIR}): choose a shorter DIR, e.g. /tmp/edl-node"
        )
    began = time.monotonic()
    parts = "etcd, kube-apiserver, kwok" + (
        f" and {testcluster.CONTROLLER_MANAGER}" if controller_manager else ""
    )
    _log(f"starting {parts} ({k8sbinaries.K8S_VERSION}) in {directory}")
    plane = testcluster.start(
        directory, attached=False, timeout=timeout, controller_manager=controller_manager
    )
    _log(f"control plane ready in {plane.startup_seconds:.1f}s at {plane.server}")
    nodes = []
    try:
        for name in node_names(count):
            started = time.monotonic()
            node = start_node_on(
                plane,
                directory / "nodes" / name,
                name,
                attached=False,
                timeout=timeout,
                exec_mode=exec_mode,
                cdi_dirs=cdi_dirs,
            )
            nodes.append(node)
            _log(f"node {name} Ready in {time.monotonic() - started:.1f}s ({node.paths.env_file})")
    except BaseException:
        with contextlib.suppress(Exception):
            down(directory)
        raise
    _log(f"{count} node(s) Ready {time.monotonic() - began:.1f}s after start")
    return nodes


def down(directory: Path) -> list[int]:
    """Stop every node and the control plane in ``directory``; idempotent."""
    directory = directory.resolve()
    stopped = []
    nodes_dir = directory / "nodes"
    if nodes_dir.is_dir():
        for root in sorted(nodes_dir.iterdir()):
            stopped += stop_node(root)
        shutil.rmtree(nodes_dir, ignore_errors=True)
    stopped += testcluster.stop(directory)
    return stopped


def exit_pod_container(
    directory: Path, pod_ref: str, container: str, code: int
) -> dict[str, object]:
    """``scripts/test-node exit``: the node running NAMESPACE/POD makes CONTAINER exit."""
    namespace, sep, pod = pod_ref.partition("/")
    if not sep or not namespace or not pod:
        raise NodeError(f"expected NAMESPACE/POD, got {pod_ref!r}")
    server, token, ca_file = _plane_credentials(directory.resolve())
    probe = Node("", Paths(directory), server, token, ca_file, {}, False)
    status, body = api(probe, "GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    if status != http.client.OK or not isinstance(body, dict):
        raise NodeError(f"pod {pod_ref} not found ({status})")
    node_name = body.get("spec", {}).get("nodeName")
    if not node_name:
        raise NodeError(f"pod {pod_ref} is not bound to a node yet")
    socket_path = Paths(directory.resolve() / "nodes" / node_name).control_socket
    if not socket_path.exists():
        raise NodeError(f"pod {pod_ref} runs on {node_name}, which is not a node of {directory}")
    return exit_container(socket_path, namespace, pod, container, code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/test-node",
        description=(
            f"Real kubelet {k8sbinaries.K8S_VERSION} nodes with a fake container runtime, each in "
            "a private mount namespace, on a local etcd + kube-apiserver + kwok control plane "
            "(binaries from scripts/k8s-binaries). Needs root, unshare and overlayfs. "
            "Nothing is left outside DIR."
        ),
        epilog=(
            "DIR/kubeconfig is an admin kubeconfig; DIR/nodes/<node>/node.env holds NODE_NAME, "
            "KUBELET_DIR, DEVICE_PLUGIN_DIR, PLUGINS_REGISTRY_DIR, POD_RESOURCES_SOCKET, CRI_LOG, "
            "CRI_CONTROL_SOCKET (host paths) and the node's KUBECONFIG. Pass kubectl "
            "--cache-dir=DIR/kubectl-cache so that it writes nothing under your home."
        ),
    )
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("up", help="start the control plane and N kubelet nodes, wait Ready")
    start.add_argument(
        "directory", type=Path, metavar="DIR", help="a short path, e.g. /tmp/edl-node"
    )
    start.add_argument(
        "--nodes", type=int, default=1, metavar="N", help="kubelet nodes (default 1)"
    )
    start.add_argument("--timeout", type=float, default=60.0, help="seconds for each step")
    start.add_argument(
        "--controller-manager",
        action="store_true",
        help=(
            "also run kube-controller-manager (Jobs, Deployments, ResourceClaims, node lifecycle "
            f"and taint eviction, garbage collection; a stopped kubelet's node turns NotReady "
            f"after {testcluster.NODE_MONITOR_GRACE_PERIOD})"
        ),
    )
    start.add_argument(
        "--exec",
        action="store_true",
        help=(
            "run containers as host processes (the pod's command must exist on this host): "
            "real exit codes and logs, one loopback IP per pod (127.N.x.y), CDI env edits"
        ),
    )
    start.add_argument(
        "--cdi-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="with --exec: a directory of CDI specs (repeatable)",
    )
    stop = sub.add_parser("down", help="stop everything in DIR and remove its state (idempotent)")
    stop.add_argument("directory", type=Path, metavar="DIR")
    leave = sub.add_parser("exit", help="make a running container exit with CODE")
    leave.add_argument("directory", type=Path, metavar="DIR")
    leave.add_argument("pod", metavar="NAMESPACE/POD")
    leave.add_argument("container", metavar="CONTAINER")
    leave.add_argument("code", type=int, metavar="CODE")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            if args.nodes < 1:
                parser.error("--nodes must be at least 1")
            nodes = up(
                args.directory,
                args.nodes,
                timeout=args.timeout,
                controller_manager=args.controller_manager,
                exec_mode=args.exec,
                cdi_dirs=args.cdi_dir,
            )
            _log(f"export KUBECONFIG={args.directory.resolve() / 'kubeconfig'}")
            for node in nodes:
                print(node.paths.env_file)
        elif args.action == "down":
            stopped = down(args.directory)
            _log(f"stopped pids {stopped}" if stopped else "nothing was running")
        else:
            answer = exit_pod_container(args.directory, args.pod, args.container, args.code)
            _log(f"{args.pod} {args.container} exited with {args.code} ({answer})")
    except (NodeError, testcluster.ControlPlaneError) as exc:
        _log(f"ERROR: {exc}")
        return 2
    return 0
