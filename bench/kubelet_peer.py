"""Side by side on a real kubelet: edl-agent and NVIDIA's k8s-device-plugin, each serving a real
kubelet v1.37 node: registration, XID → the pod's allocatedResourcesStatus, kubelet restarts.

    .venv/bin/python bench/kubelet_peer.py [--quick] [--build] [--rounds 2] [--restarts 5]

One test control plane for the run (etcd + kube-apiserver, scripts/testcluster.py). Per round and
per side, a fresh kubelet node (scripts/testnode.py: kubelet v1.37.2 with the fake container
runtime in a private mount namespace, feature gate ResourceHealthStatus on, node status every
1 s) and a fresh simulated dgx-h100 (8 GPUs) for the plugin:

- ours: `edl-agent run` on the node's device-plugin dir (tests/cluster/kubelet_helpers.py's
  NodeAgent, as the kubelet tests run it);
- theirs: nvidia-device-plugin with bench/nvidia_peer.py's flags, in a private mount namespace
  where /var/lib is the node's directory, so that its fixed /var/lib/kubelet/device-plugins/ is
  the node's NODE_DIR/kubelet/device-plugins/ (and /proc/driver bound as nvidia_peer.py does
  for MIG; unused on dgx-h100).

What the API server shows, seen through watches on the Node and the pod (when the event arrived):

- registration: plugin process start → the Node's allocatable nvidia.com/gpu is 8;
- pod_running: a pod asking for 2 GPUs (placed by spec.nodeName) created → Running;
- xid_pod_status: XID 79 on one of the pod's GPUs (the id kubelet's pod-resources API lists,
  mapped to its index through the fake NVML's data file) → the pod's
  status.containerStatuses[].allocatedResourcesStatus lists that device Unhealthy;
- xid_allocatable: the same XID → allocatable 7;
- restart_allocatable_p50/max: testnode's kubelet restart (SIGTERM; pods, checkpoints and root
  dir kept; a new kubelet) called → the first Node version written after the new kubelet has
  the plugin's devices (writes before that may carry the old count). The Node keeps its last
  allocatable while kubelet restarts, and a write that changes nothing makes no new version,
  so this one mostly measures kubelet's status reporting (back to back restarts gave about
  0.5, 1.5 or 2.5 s; with the 2 s between restarts below, about 0.5 s).
  `restart_zero` counts the restarts after which the API showed allocatable 0 at some point
  between the restart call and 2 s after it was back (the next restart waits those 2 s);
  `restart_gpus` is the allocatable the Node came back with (the smallest): 7 when the plugin
  still holds the XID GPU Unhealthy, 8 when it forgot it.

Kubelet writes the Node every 1 s, and updates a pod's status after its next PLEG relist (1 s),
so those figures hold up to a second or two of kubelet's own loops. What the plugin adds is in
the `*_kubelet` figures, from the kubelet log's timestamps (klog, microseconds, the same wall
clock): plugin start → kubelet has its devices (registration_kubelet), XID → kubelet has the
device Unhealthy (xid_kubelet), kubelet restart called → the new kubelet has the plugin's devices
again, i.e. can admit pods with them (restart_kubelet_p50/max: the last time it took them before
the API showed them, as a plugin that registers several times loses them in between; kubelet
itself takes about 0.35 s of it to serve its socket: kubelet_socket_p50). A random pause (0-1 s,
the same for both sides of a round) comes before the plugin's start and before the XID, so that
rounds do not all fall on the same phase of kubelet's loops.

Prints `name value unit` lines (ours, theirs, ours/theirs); figures are never judged. Exit status
3 when NVIDIA's plugin is not built (without --build), the k8s binaries (etcd, kube-apiserver,
kwok, kubelet, the fake runtime) are missing or kubelet nodes cannot run here (root, unshare,
overlayfs); 1 when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "tests" / "cluster", REPO / "scripts", REPO / "bench", REPO):
    sys.path.insert(0, str(_path))

import build_nvidia_plugin  # noqa: E402
import k8sbinaries  # noqa: E402
import testcluster  # noqa: E402
import testnode  # noqa: E402
from benchstats import percentile, print_side_by_side  # noqa: E402
from kubelet_helpers import (  # noqa: E402
    extended,
    gpu_pod,
    node_agent,
    pod_devices,
    resource_health,
    wait_for,
)
from nvidia_peer import RESOURCE, XID, Node, nvml_records, theirs_command  # noqa: E402
from scheduler import Process, ProcessError, spawn, tail  # noqa: E402

from edl_agent.sim import inject  # noqa: E402

PROFILE = "dgx-h100"
GPUS = 8
POD_GPUS = 2
NAMESPACE = "kubelet-peer"
STEP_S = 60.0  # generous: kubelet, the API server and etcd share 2 cores with the plugins
POLL_S = 0.02
PHASE_S = 1.0  # kubelet's nodeStatusUpdateFrequency and PLEG relist period
SETTLE_S = 2.0  # after a kubelet restart, how long the API must not show allocatable 0
# What kubelet v1.37 logs (--v=2; v1.36 the same) when a ListAndWatch answer of a plugin has
# been taken in.
DEVICE_UPDATE = f'"Processed device updates for resource" resourceName="{RESOURCE}"'
REGISTRATION = (
    f'"Got registration request from device plugin with resource" resourceName="{RESOURCE}"'
)
KLOG = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d{6})\s+(\d+) ")

# (node, work dir) → (what starts the plugin, its simulated node tree).
Prepare = Callable[[testnode.Node, Path], tuple[Callable[[], Process], Path]]


def log(message: str) -> None:
    print(f"[kubelet-peer] {message}", file=sys.stderr, flush=True)


@dataclass
class Samples:
    registration_s: list[float] = field(default_factory=list)
    registration_kubelet_s: list[float] = field(default_factory=list)
    pod_running_s: list[float] = field(default_factory=list)
    xid_pod_status_s: list[float] = field(default_factory=list)
    xid_allocatable_s: list[float] = field(default_factory=list)
    xid_kubelet_s: list[float] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    restart_kubelet_s: list[float] = field(default_factory=list)
    kubelet_socket_s: list[float] = field(default_factory=list)  # kubelet alone, for reference
    restart_gpus: list[int] = field(default_factory=list)
    restart_zero: int = 0  # restarts after which the API showed allocatable 0 for a while


class RunFailed(Exception):
    """One side did not get through; the message carries the logs' tails."""


def prepare_ours(node: testnode.Node, work: Path) -> tuple[Callable[[], Process], Path]:
    agent = node_agent(node, PROFILE, work / "edl-agent", start=False)
    return agent.start, agent.tree


def prepare_theirs(binary: Path) -> Prepare:
    def prepare(node: testnode.Node, work: Path) -> tuple[Callable[[], Process], Path]:
        sim = Node.build(work / "nvidia")
        argv, env = theirs_command(binary, sim)
        plugin = argv[argv.index(str(binary)) :]  # the plugin with nvidia_peer.py's flags
        # The node's directory over /var/lib: /var/lib/kubelet is then NODE_DIR/kubelet, the
        # directory kubelet's own namespace has there. Both mounts die with the plugin.
        mounts = (
            'mount -n --bind "$1" /var/lib && mount -n --bind "$2" /proc/driver '
            '&& shift 2 && exec "$@"'
        )
        namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounts, "sh"]
        argv = [*namespace, str(node.paths.root), str(sim.proc_driver), *plugin]
        return lambda: spawn("nvidia-device-plugin", argv, sim.work, env=env), sim.tree

    return prepare


def gpus_of(node: Any) -> int:
    return extended(node.status.allocatable).get(RESOURCE, 0)


class Watched:
    """Every version of one object with when it arrived (time.time()): a list, then a watch from
    its resourceVersion on a thread of its own, so that no version slips by."""

    def __init__(self, list_call: Callable[..., Any], name: str, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.versions: list[tuple[float, Any]] = []
        kwargs["field_selector"] = f"metadata.name={name}"
        listed = list_call(**kwargs)
        self.versions += [(time.time(), item) for item in listed.items]
        self._thread = threading.Thread(
            target=self._watch,
            args=(list_call, listed.metadata.resource_version, kwargs),
            daemon=True,
        )
        self._thread.start()

    def _watch(self, list_call: Callable[..., Any], version: str, kwargs: dict[str, Any]) -> None:
        while not self._stopped.is_set():
            stream = watch.Watch()
            try:
                # A client-side read timeout wakes an idle watch up to see whether it should end.
                for event in stream.stream(
                    list_call, resource_version=version, _request_timeout=1, **kwargs
                ):
                    arrived = time.time()
                    version = event["object"].metadata.resource_version
                    if event["type"] in {"ADDED", "MODIFIED"}:
                        with self._lock:
                            self.versions.append((arrived, event["object"]))
                    if self._stopped.is_set():
                        break
            except Exception:
                self._stopped.wait(0.05)

    def first(self, done: Callable[[Any], bool], after: float) -> tuple[float, Any] | None:
        """The first version that arrived at or after `after` and is `done`."""
        with self._lock:
            return next(((t, o) for t, o in self.versions if t >= after and done(o)), None)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)


def kubelet_logged(path: Path, pid: int, text: str, offset: int = 0) -> list[float]:
    """When kubelet `pid` logged the lines holding `text` (after byte `offset`), in time.time()'s
    scale: klog writes local wall-clock time with microseconds and no year."""
    with path.open("rb") as stream:
        stream.seek(offset)
        lines = stream.read().decode(errors="replace").splitlines()
    year = datetime.datetime.now().year
    found = []
    for line in lines:
        header = KLOG.match(line)
        if header and int(header[3]) == pid and text in line:
            stamp = f"{year}{header[1]} {header[2]}"
            found.append(datetime.datetime.strptime(stamp, "%Y%m%d %H:%M:%S.%f").timestamp())
    return found


@dataclass
class Side:
    """One side's run on its own kubelet node."""

    name: str
    node: testnode.Node
    core: client.CoreV1Api
    samples: Samples
    rng: random.Random
    process: Process | None = None

    def until(self, what: str, fetch: Callable[[], Any]) -> Any:
        """Poll `fetch` until it returns something else than None."""
        try:
            return wait_for(
                what,
                fetch,
                lambda found: found is not None,
                timeout=STEP_S,
                alive=self.process,
                poll=POLL_S,
            )
        except (AssertionError, ProcessError) as exc:
            raise RunFailed(self.failure(str(exc))) from None

    def logged(self, what: str, text: str, offset: int) -> list[float]:
        """When kubelet logged `text` since byte `offset`, once it has at least once."""
        path, pid = self.node.paths.logs / "kubelet.log", self.node.pids["kubelet"]
        logged: list[float] = self.until(
            what, lambda: kubelet_logged(path, pid, text, offset) or None
        )
        return logged

    def log_size(self) -> int:
        return (self.node.paths.logs / "kubelet.log").stat().st_size

    def pause(self) -> None:
        """A random part of kubelet's 1 s loops (node status, PLEG relist)."""
        time.sleep(self.rng.uniform(0.0, PHASE_S))

    def run(self, launch: Callable[[], Process], tree: Path, restarts: int) -> None:
        nodes = Watched(self.core.list_node, self.node.name)
        try:
            self.register(nodes, launch)
            pod = self.pod_and_xid(nodes, tree)
            for attempt in range(1, restarts + 1):
                self.restart_kubelet(nodes, attempt, restarts)
        finally:
            nodes.stop()
        final = self.core.read_namespaced_pod(pod, NAMESPACE)
        log(
            f"{self.name}: after the restarts the pod is {final.status.phase}, its devices "
            f"{sorted((d, h) for _, d, h in resource_health(final))}"
        )
        if self.process is not None and not self.process.alive():
            raise RunFailed(self.failure("the plugin exited during the run"))

    def register(self, nodes: Watched, launch: Callable[[], Process]) -> None:
        self.pause()
        offset = self.log_size()
        began = time.time()
        self.process = launch()
        at, _ = self.until(
            f"allocatable {RESOURCE} {GPUS}",
            lambda: nodes.first(lambda n: gpus_of(n) == GPUS, began),
        )
        self.samples.registration_s.append(at - began)
        logged = self.logged("kubelet to take the devices", DEVICE_UPDATE, offset)[0]
        self.samples.registration_kubelet_s.append(logged - began)

    def pod_and_xid(self, nodes: Watched, tree: Path) -> str:
        """A pod holding 2 GPUs, then XID 79 on one of them; the pod's name."""
        pod = f"gpus-{self.node.name}"
        pods = Watched(self.core.list_namespaced_pod, pod, namespace=NAMESPACE)
        try:
            began = time.time()
            body = gpu_pod(pod, self.node.name, {RESOURCE: str(POD_GPUS)})
            self.core.create_namespaced_pod(NAMESPACE, body)
            at, _ = self.until(
                f"{pod} Running", lambda: pods.first(lambda p: p.status.phase == "Running", began)
            )
            self.samples.pod_running_s.append(at - began)
            held = pod_devices(self.node, NAMESPACE, pod)["main"][RESOURCE]
            healthy = sorted((RESOURCE, device, "Healthy") for device in held)
            self.until(
                "allocatedResourcesStatus Healthy",
                lambda: pods.first(lambda p: sorted(resource_health(p)) == healthy, began),
            )
            victim = held[0]
            index = {gpu["uuid"]: int(gpu["index"]) for gpu in nvml_records(tree)[0]}[victim]
            self.pause()
            offset = self.log_size()
            began = time.time()
            inject.inject_xid(tree, index, XID)
            unhealthy = (RESOURCE, victim, "Unhealthy")
            at, _ = self.until(
                f"{victim} Unhealthy in allocatedResourcesStatus",
                lambda: pods.first(lambda p: unhealthy in resource_health(p), began),
            )
            self.samples.xid_pod_status_s.append(at - began)
        finally:
            pods.stop()
        at, _ = self.until(
            f"allocatable {GPUS - 1}", lambda: nodes.first(lambda n: gpus_of(n) == GPUS - 1, began)
        )
        self.samples.xid_allocatable_s.append(at - began)
        seven = f"{DEVICE_UPDATE} totalCount={GPUS} healthyCount={GPUS - 1}"
        self.samples.xid_kubelet_s.append(
            self.logged("kubelet to take the Unhealthy GPU", seven, offset)[0] - began
        )
        s = self.samples
        log(
            f"{self.name}: registration {1000 * s.registration_s[-1]:.0f} ms (kubelet had the "
            f"devices at {1000 * s.registration_kubelet_s[-1]:.0f}), pod Running "
            f"{1000 * s.pod_running_s[-1]:.0f} ms, XID {XID} on GPU {index}: kubelet "
            f"{1000 * s.xid_kubelet_s[-1]:.0f} ms, pod status {1000 * s.xid_pod_status_s[-1]:.0f}"
            f" ms, allocatable {1000 * s.xid_allocatable_s[-1]:.0f} ms"
        )
        return pod

    def restart_kubelet(self, nodes: Watched, attempt: int, restarts: int) -> None:
        offset = self.log_size()
        began = time.time()
        try:
            socket_s = self.node.restart_kubelet(timeout=STEP_S)
        except testnode.NodeError as exc:
            raise RunFailed(self.failure(str(exc))) from None
        # Writes before the new kubelet has the plugin's devices may carry the old count (the
        # old kubelet's, or the new one's before its device manager started).
        first = self.logged("the new kubelet to take the devices", DEVICE_UPDATE, offset)[0]
        at, back = self.until(
            f"allocatable back after kubelet restart {attempt}",
            lambda: nodes.first(lambda n: gpus_of(n) > 0, first),
        )
        # A plugin that registers again and again loses its devices in between: count from the
        # last time kubelet took them before the API showed them.
        path, pid = self.node.paths.logs / "kubelet.log", self.node.pids["kubelet"]
        devices = max(t for t in kubelet_logged(path, pid, DEVICE_UPDATE, offset) if t <= at)
        registrations = kubelet_logged(path, pid, REGISTRATION, offset)
        time.sleep(max(0.0, at + SETTLE_S - time.time()))
        zero = nodes.first(lambda n: gpus_of(n) == 0, began)
        dropped = zero is not None and zero[0] <= at + SETTLE_S
        self.samples.restart_s.append(at - began)
        self.samples.restart_kubelet_s.append(devices - began)
        self.samples.kubelet_socket_s.append(socket_s)
        self.samples.restart_gpus.append(gpus_of(back))
        self.samples.restart_zero += int(dropped)
        log(
            f"{self.name}: kubelet restart {attempt}/{restarts}: kubelet served its socket after "
            f"{1000 * socket_s:.0f} ms, had the devices after {1000 * (devices - began):.0f} ms "
            f"({len(registrations)} registrations), the API showed allocatable {gpus_of(back)} "
            f"after {1000 * (at - began):.0f} ms" + (", and 0 for a while" if dropped else "")
        )

    def failure(self, why: str) -> str:
        parts = [f"{self.name}: {why}"]
        if self.process is not None:
            parts.append(f"last lines of {self.process.log}:\n{tail(self.process.log, 15)}")
        kubelet_log = self.node.paths.logs / "kubelet.log"
        parts.append(f"last lines of {kubelet_log}:\n{tail(kubelet_log, 15)}")
        return "\n".join(parts)


def run_side(
    *,
    side: str,
    prepare: Prepare,
    plane: testcluster.ControlPlane,
    core: client.CoreV1Api,
    root: Path,
    work: Path,
    restarts: int,
    seed: int,
    samples: Samples,
) -> None:
    node = testnode.start_node_on(plane, root, f"kp-{root.name}", attached=True, timeout=STEP_S)
    # The same pauses for both sides of a round.
    run = Side(side, node, core, samples, random.Random(seed))  # noqa: S311 - not a secret
    try:
        launch, tree = prepare(node, work)
        run.run(launch, tree, restarts)
    finally:
        if run.process is not None:
            code = run.process.stop()
            if code != 0:
                log(f"{side}: the plugin exited with {code} on SIGTERM")
        node.stop()
        if node.kubelet_alive():
            log(f"{side}: kubelet of {node.name} survived its stop")


def report(ours: Samples, theirs: Samples) -> None:
    def figures(s: Samples) -> dict[str, tuple[float, str]]:
        return {
            "registration": (statistics.median(s.registration_s) * 1000, "ms"),
            "registration_kubelet": (statistics.median(s.registration_kubelet_s) * 1000, "ms"),
            "pod_running": (statistics.median(s.pod_running_s) * 1000, "ms"),
            "xid_pod_status": (statistics.median(s.xid_pod_status_s) * 1000, "ms"),
            "xid_allocatable": (statistics.median(s.xid_allocatable_s) * 1000, "ms"),
            "xid_kubelet": (statistics.median(s.xid_kubelet_s) * 1000, "ms"),
            "restart_allocatable_p50": (percentile(s.restart_s, 50) * 1000, "ms"),
            "restart_allocatable_max": (max(s.restart_s) * 1000, "ms"),
            "restart_kubelet_p50": (percentile(s.restart_kubelet_s, 50) * 1000, "ms"),
            "restart_kubelet_max": (max(s.restart_kubelet_s) * 1000, "ms"),
        }

    print_side_by_side("kubelet_peer", figures(ours), figures(theirs))
    print(f"kubelet_peer_restart_gpus_ours {min(ours.restart_gpus)} gpus")
    print(f"kubelet_peer_restart_gpus_theirs {min(theirs.restart_gpus)} gpus")
    print(f"kubelet_peer_restart_zero_ours {ours.restart_zero} restarts")
    print(f"kubelet_peer_restart_zero_theirs {theirs.restart_zero} restarts")
    both = ours.kubelet_socket_s + theirs.kubelet_socket_s
    print(f"kubelet_peer_kubelet_socket_p50 {percentile(both, 50) * 1000:.3f} ms")
    print(f"kubelet_peer_restarts {len(ours.restart_s)} restarts")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 1 kubelet restart")
    parser.add_argument("--rounds", type=int, help="fresh nodes per side (default 2)")
    parser.add_argument("--restarts", type=int, help="kubelet restarts per round (default 5)")
    parser.add_argument("--build", action="store_true", help="build NVIDIA's plugin if missing")
    parser.add_argument("--version", default=build_nvidia_plugin.DEFAULT_VERSION)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    restarts = args.restarts or (1 if args.quick else 5)
    [binary] = build_nvidia_plugin.require(
        args.version, (build_nvidia_plugin.BINARY,), build_missing=args.build, say=log
    )
    absent = k8sbinaries.missing((*k8sbinaries.CONTROL_PLANE, "kubelet", k8sbinaries.FAKE_CRI))
    if absent:
        log(f"{', '.join(absent)} missing in {k8sbinaries.bin_dir()}: run scripts/k8s-binaries")
        return 3
    problem = testnode.preflight()
    if problem is not None:
        log(problem)
        return 3
    ours, theirs = Samples(), Samples()
    sides: list[tuple[str, Prepare, Samples]] = [
        ("ours", prepare_ours, ours),
        ("theirs", prepare_theirs(binary), theirs),
    ]
    # Short: the nodes' sockets live under it (testnode.MAX_NODE_DIR).
    with tempfile.TemporaryDirectory(prefix="edl-kp-", dir="/tmp") as tmp:
        scratch = Path(tmp)
        log("starting the test control plane (etcd, kube-apiserver, KWOK)")
        plane = testcluster.start(scratch / "plane", attached=True)
        api: client.ApiClient | None = None
        try:
            log(f"control plane ready in {plane.startup_seconds:.1f}s")
            api = config.new_client_from_config(config_file=str(plane.kubeconfig))
            core = client.CoreV1Api(api)
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
            for number in range(rounds):
                # Alternate who goes first, so that neither always runs on a cooler machine.
                for side, prepare, samples in sides if number % 2 == 0 else sides[::-1]:
                    log(f"round {number + 1}/{rounds}: {side} ({restarts} kubelet restarts)")
                    work = scratch / f"work-{number}-{side}"
                    work.mkdir()
                    run_side(
                        side=side, prepare=prepare, plane=plane, core=core,
                        root=scratch / f"{side}-{number}", work=work, restarts=restarts,
                        seed=number, samples=samples,
                    )  # fmt: skip
        except (RunFailed, testnode.NodeError, ApiException) as exc:
            log(str(exc))
            return 1
        finally:
            if api is not None:
                with contextlib.suppress(Exception):
                    api.close()
            plane.stop()
    report(ours, theirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
