"""edl-agent's Dynamic Resource Allocation (resource.k8s.io/v1) on a real kubelet v1.37 and
kube-scheduler: how soon a node's devices are in ResourceSlices, how soon an XID taints one, and
how long a claim takes from creation to a running pod.

    .venv/bin/python bench/dra_bench.py [--quick] [--starts 3] [--claims 10] [--xids 5]

One test control plane for the run (etcd + kube-apiserver, scripts/testcluster.py), a real
kube-scheduler on it (tests/cluster/scheduler.py) and our DeviceClasses
(deploy/dra/deviceclasses.yaml). Per simulated node profile, one real kubelet node
(scripts/testnode.py: kubelet v1.37.2 with the fake container runtime in a private mount
namespace), served by `edl-agent run` as the DRA kubelet tests run it (NodeAgent of
tests/cluster/kubelet_helpers.py with `--kubeconfig`, `dra.plugins_registry_dir` the node's
plugins_registry, `nvidia.serve=dra`): a dgx-h100 (8 GPUs) and a dgx-a100-mig with
`nvidia.mig_strategy=mixed` (the MIG devices and the GPUs without MIG; each MIG device consumes
its GPU's memory counter, so the pool has a slice of shared counters besides its devices).

What the API server shows, seen through watches (when each event arrived, time.time()):

- slices: agent process start → the node's pool is complete: every slice of its newest
  generation is there (spec.pool.resourceSliceCount of them) and they hold as many devices as
  `edl-agent discover` finds to publish (a watch on resourceslices with fieldSelector
  spec.nodeName). Each start is a fresh agent on a fresh simulated tree; before the next one
  the previous agent is stopped and its slices deleted, so that every start publishes anew.
  From the agent's own JSON log: start → `discovered` (Python start-up and discovery),
  `discovered` → `ResourceSlices published` (the agent's share: what it starts before DRA, the
  CDI specs, the slices' writes), start → `serving` (its DRA plugin's socket is up) and start →
  `registered with kubelet` (kubelet's plugin manager took the socket and called the plugin;
  kubelet looks at new sockets in a 1 s loop, so this one holds up to a second of kubelet's).
- xid_taint (dgx-h100): XID 79 on a GPU (edl_agent.sim.inject.inject_xid) → that device carries
  the taint edl.io/unhealthy in the slice; xid_taint_agent: the same XID → the agent logged its
  next `ResourceSlices published`. Each XID goes to another GPU.
- claim (dgx-h100): a ResourceClaim for one GPU of DeviceClass gpu.nvidia.edl.io, then a pod
  holding it (placed by the scheduler, not by spec.nodeName), created → the claim's
  status.allocation is set (claim_allocated: the scheduler's allocation from the slices) → the
  pod is Running (claim_running: kubelet prepared the claim through our plugin and started the
  container with its CDI ids); claim_prepared: claim created → the agent logged
  `claim prepared` for it. After each round the pod is deleted and the agent unprepares the
  claim (its CDI spec goes); the claim is then released as kube-controller-manager's
  resourceclaim controller would (status cleared, finalizer removed, deleted), since the test
  control plane runs no controller-manager, so that every round finds the same free GPUs.

A random pause (0-1 s) comes before each agent start, XID and claim, so that rounds do not all
fall on the same phase of kubelet's 1 s loops (plugin registration, PLEG relist, status updates).

No side by side: NVIDIA's own DRA driver (k8s-dra-driver-gpu) cannot be built here. Its Go
modules (github.com/NVIDIA/k8s-dra-driver-gpu, sigs.k8s.io/dra-driver-nvidia-gpu,
github.com/kubernetes-sigs/dra-driver-nvidia-gpu) are refused by the Go module proxy (403), so
no figure of theirs is printed and no ratio.

Prints `name value unit` lines; figures are never judged. Exit status 3 when the k8s binaries
(etcd, kube-apiserver, kwok, kubelet, kube-scheduler, the fake runtime) are missing or kubelet
nodes cannot run here (root, unshare, overlayfs); 1 when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "tests" / "cluster", REPO / "scripts", REPO / "bench", REPO):
    sys.path.insert(0, str(_path))

import k8sbinaries  # noqa: E402
import testcluster  # noqa: E402
import testnode  # noqa: E402
from benchstats import percentile  # noqa: E402
from kubelet_helpers import (  # noqa: E402
    NodeAgent,
    claim_body,
    claim_pod,
    logged_at,
    node_agent,
    spawn_discover,
)
from scheduler import ProcessError, start_scheduler, tail  # noqa: E402

from edl_agent.sim import inject  # noqa: E402
from edl_agent.sim.profile import load_profile  # noqa: E402

GROUP, VERSION = "resource.k8s.io", "v1"
DRIVER = "gpu.nvidia.edl.io"
DEVICE_CLASS = "gpu.nvidia.edl.io"
UNHEALTHY_TAINT = "edl.io/unhealthy"
NAMESPACE = "dra-bench"
XID = 79
# Profile → the agent's DRA settings; the claims and XIDs run on CLAIM_PROFILE's node.
PROFILES = {
    "dgx-h100": ("nvidia.serve=dra",),
    "dgx-a100-mig": ("nvidia.serve=dra", "nvidia.mig_strategy=mixed"),
}
CLAIM_PROFILE = "dgx-h100"
STEP_S = 60.0  # generous: kubelet, the scheduler, the API server and etcd share 2 cores
POLL_S = 0.02
PHASE_S = 1.0  # kubelet's plugin registration, PLEG relist and status loops
WATCH_S = 30  # one watch request
DEVICE_CLASSES = REPO / "deploy" / "dra" / "deviceclasses.yaml"

Objects = dict[str, Any]  # name → object, as a watch last showed them


def log(message: str) -> None:
    print(f"[dra-bench] {message}", file=sys.stderr, flush=True)


class RunFailed(Exception):
    """A step did not get through; the message carries the logs' tails."""


def metadata_of(item: Any) -> tuple[str, str]:
    """(name, resourceVersion) of a typed object or of a custom object's dict."""
    if isinstance(item, dict):
        return item["metadata"]["name"], item["metadata"]["resourceVersion"]
    return item.metadata.name, item.metadata.resource_version


class ObjectWatch:
    """The objects of a list call, kept current by a watch from the list's resourceVersion on a
    thread of its own; after every event, when it arrived (time.time()) and every object as it
    then stood, so that no state slips by.

    One watch request lasts WATCH_S: an event written while the next request is being opened
    arrives tens of milliseconds late, so requests are long (with 1 s requests, one XID of five
    reached the bench 30-45 ms after the agent's write, in two runs out of two). The thread ends
    with its request after `stop`, or when the control plane goes."""

    def __init__(self, list_call: Callable[..., Any], **kwargs: Any) -> None:
        self._list_call = list_call
        self._kwargs = kwargs
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.states: list[tuple[float, Objects]] = []
        self._current: Objects = {}
        version = self._relist()
        self._thread = threading.Thread(target=self._watch, args=(version,), daemon=True)
        self._thread.start()

    def _relist(self) -> str:
        listed = self._list_call(**self._kwargs)
        items = listed["items"] if isinstance(listed, dict) else listed.items
        version = (
            listed["metadata"]["resourceVersion"]
            if isinstance(listed, dict)
            else listed.metadata.resource_version
        )
        self._current = {metadata_of(item)[0]: item for item in items}
        self._record(time.time())
        return str(version)

    def _record(self, arrived: float) -> None:
        with self._lock:
            self.states.append((arrived, dict(self._current)))

    def _watch(self, version: str) -> None:
        while not self._stopped.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                    self._list_call,
                    resource_version=version,
                    timeout_seconds=WATCH_S,
                    _request_timeout=WATCH_S + 5,
                    **self._kwargs,
                ):
                    arrived = time.time()
                    name, version = metadata_of(event["object"])
                    if event["type"] in {"ADDED", "MODIFIED"}:
                        self._current[name] = event["object"]
                    elif event["type"] == "DELETED":
                        self._current.pop(name, None)
                    else:
                        continue
                    self._record(arrived)
                    if self._stopped.is_set():
                        break
            except ApiException:  # the version expired (410): list again
                with contextlib.suppress(Exception):
                    version = self._relist()
            except Exception:
                self._stopped.wait(0.05)

    def first(self, done: Callable[[Objects], bool], after: float) -> tuple[float, Objects] | None:
        """The first state that arrived at or after `after` and is `done`."""
        with self._lock:
            return next(((t, o) for t, o in self.states if t >= after and done(o)), None)

    def latest(self) -> Objects:
        with self._lock:
            return self.states[-1][1]

    def stop(self) -> None:
        self._stopped.set()


# --- what the objects say ------------------------------------------------------------------


def our_slices(slices: Objects) -> list[dict[str, Any]]:
    return [s for s in slices.values() if s["spec"]["driver"] == DRIVER]


def complete_pool(slices: Objects, devices: int) -> bool:
    """Every slice of the pool's newest generation is there and they hold `devices` devices."""
    ours = our_slices(slices)
    if not ours:
        return False
    newest = max(s["spec"]["pool"]["generation"] for s in ours)
    current = [s for s in ours if s["spec"]["pool"]["generation"] == newest]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
        return False
    return sum(len(s["spec"].get("devices") or []) for s in current) == devices


def slice_devices(slices: Objects) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in our_slices(slices) for d in s["spec"].get("devices") or []}


def tainted(slices: Objects, device: str) -> bool:
    found = slice_devices(slices).get(device) or {}
    return any(t["key"] == UNHEALTHY_TAINT for t in found.get("taints") or [])


def allocation(claim: dict[str, Any] | None) -> dict[str, Any] | None:
    return ((claim or {}).get("status") or {}).get("allocation")


def phase(pod: Any) -> str | None:
    return pod.status.phase if pod is not None and pod.status is not None else None


def publishable_devices(agent: NodeAgent) -> int:
    """What `edl-agent discover` finds that the pool must hold: NVIDIA's devices, without the
    GPUs whose MIG devices are published instead."""
    settings = agent.directory / "discover-config.yaml"
    settings.write_text(yaml.safe_dump(load_profile(agent.profile).config))
    found = spawn_discover(agent.tree, settings)["devices"]
    parents = {d.get("parent") for d in found if d["kind"] == "mig"}
    return sum(1 for d in found if d["vendor"] == "nvidia" and d["id"] not in parents)


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Samples:
    slices_s: dict[str, list[float]] = field(default_factory=dict)
    discovered_s: dict[str, list[float]] = field(default_factory=dict)
    slices_agent_s: dict[str, list[float]] = field(default_factory=dict)
    serving_s: dict[str, list[float]] = field(default_factory=dict)
    registered_s: dict[str, list[float]] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)
    slice_count: dict[str, int] = field(default_factory=dict)
    xid_taint_s: list[float] = field(default_factory=list)
    xid_taint_agent_s: list[float] = field(default_factory=list)
    claim_allocated_s: list[float] = field(default_factory=list)
    claim_prepared_s: list[float] = field(default_factory=list)
    claim_running_s: list[float] = field(default_factory=list)


@dataclass
class Bench:
    plane: testcluster.ControlPlane
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    scratch: Path
    samples: Samples
    rng: random.Random
    agent: NodeAgent | None = None
    started_agents: int = 0

    # --- waiting ---------------------------------------------------------------------------

    def until(self, what: str, fetch: Callable[[], Any], node: testnode.Node) -> Any:
        """Poll `fetch` until it returns something else than None (the agent must live)."""
        deadline = time.monotonic() + STEP_S
        while True:
            found = fetch()
            if found is not None:
                return found
            process = self.agent.process if self.agent is not None else None
            if process is not None and not process.alive():
                raise RunFailed(self.failure(f"the agent exited waiting for {what}", node))
            if time.monotonic() > deadline:
                raise RunFailed(self.failure(f"timed out after {STEP_S:.0f}s: {what}", node))
            time.sleep(POLL_S)

    def logged(
        self, what: str, event: str, node: testnode.Node, since: float = 0.0, **fields: Any
    ) -> list[float]:
        """When the agent logged `event` (with `fields`) at or after `since`, once it has."""
        assert self.agent is not None
        agent = self.agent

        def entries() -> list[float] | None:
            found = [
                logged_at(e)
                for e in agent.entries(event)
                if all(e.get(k) == v for k, v in fields.items())
            ]
            return [t for t in found if t >= since] or None

        times: list[float] = self.until(what, entries, node)
        return times

    def failure(self, why: str, node: testnode.Node) -> str:
        parts = [why]
        if self.agent is not None and self.agent.process is not None:
            parts.append(f"last lines of {self.agent.log}:\n{tail(self.agent.log, 15)}")
        kubelet_log = node.paths.logs / "kubelet.log"
        parts.append(f"last lines of {kubelet_log}:\n{tail(kubelet_log, 15)}")
        return "\n".join(parts)

    def pause(self) -> None:
        """A random part of kubelet's 1 s loops."""
        time.sleep(self.rng.uniform(0.0, PHASE_S))

    # --- agents ----------------------------------------------------------------------------

    def new_agent(self, node: testnode.Node, profile: str) -> NodeAgent:
        """A fresh agent on a fresh tree for `node`, not started yet."""
        directory = self.scratch / f"agent-{self.started_agents}"
        self.started_agents += 1
        extra = [
            f"--kubeconfig={self.plane.kubeconfig}",
            f"--set=dra.plugins_registry_dir={node.paths.plugins_registry}",
            f"--set=dra.cdi_dir={directory / 'cdi'}",
            *(f"--set={setting}" for setting in PROFILES[profile]),
        ]
        agent = node_agent(node, profile, directory, *extra, start=False)
        self.agent = agent
        return agent

    def stop_agent(self) -> None:
        if self.agent is None or self.agent.process is None:
            return
        code = self.agent.stop()
        if code != 0:
            log(f"the agent exited with {code} on SIGTERM; its log {self.agent.log}")
        self.agent = None

    def delete_slices(self, node: testnode.Node, slices: ObjectWatch) -> None:
        for name in list(slices.latest()):
            with contextlib.suppress(ApiException):
                self.custom.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", name)
        self.until("the node's slices deleted", lambda: slices.latest() == {} or None, node)

    # --- 1. slice publication ----------------------------------------------------------------

    def publish(self, node: testnode.Node, profile: str, slices: ObjectWatch) -> None:
        """A fresh agent (left running) and its pool complete in the API."""
        agent = self.new_agent(node, profile)
        devices = publishable_devices(agent)  # before the start: it takes a core for a while
        self.pause()
        began = time.time()
        agent.start()
        at, published = self.until(
            f"{devices} devices of {DRIVER} published for {node.name}",
            lambda: slices.first(lambda s: complete_pool(s, devices), began),
            node,
        )
        discovered = self.logged("the agent's discovery", "discovered", node)[0]
        written = self.logged("the agent's slices", "ResourceSlices published", node)[0]
        serving = self.logged("the DRA plugin's socket", "serving", node, part="dra-plugin")[0]
        registered = self.logged(
            "kubelet's registration of the DRA plugin", "registered with kubelet", node,
            driver=DRIVER,
        )[0]  # fmt: skip
        s = self.samples
        s.slices_s.setdefault(profile, []).append(at - began)
        s.discovered_s.setdefault(profile, []).append(discovered - began)
        s.slices_agent_s.setdefault(profile, []).append(written - discovered)
        s.serving_s.setdefault(profile, []).append(serving - began)
        s.registered_s.setdefault(profile, []).append(registered - began)
        s.devices[profile] = devices
        s.slice_count[profile] = len(our_slices(published))
        log(
            f"{profile}: {devices} devices in {len(our_slices(published))} slices "
            f"{1000 * (at - began):.0f} ms after the agent's start (discovered at "
            f"{1000 * (discovered - began):.0f}, published at {1000 * (written - began):.0f}, "
            f"plugin served at {1000 * (serving - began):.0f}, registered at "
            f"{1000 * (registered - began):.0f})"
        )

    # --- 2. claims ---------------------------------------------------------------------------

    def claim_round(
        self, node: testnode.Node, number: int, claims: ObjectWatch, pods: ObjectWatch
    ) -> None:
        claim, pod = f"gpu-{number}", f"job-{number}"
        self.pause()
        began = time.time()
        created = self.custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            "resourceclaims",
            claim_body(claim, DEVICE_CLASS, request="gpu"),
        )
        uid = created["metadata"]["uid"]
        self.core.create_namespaced_pod(NAMESPACE, claim_pod(pod, claim, request="gpu"))
        allocated_at, _ = self.until(
            f"claim {claim} allocated",
            lambda: claims.first(lambda c: allocation(c.get(claim)) is not None, began),
            node,
        )
        running_at, _ = self.until(
            f"pod {pod} Running",
            lambda: pods.first(lambda p: phase(p.get(pod)) == "Running", began),
            node,
        )
        prepared_at = self.logged(f"claim {claim} prepared", "claim prepared", node, uid=uid)[0]
        s = self.samples
        s.claim_allocated_s.append(allocated_at - began)
        s.claim_prepared_s.append(prepared_at - began)
        s.claim_running_s.append(running_at - began)
        log(
            f"claim {number + 1}: allocated {1000 * (allocated_at - began):.0f} ms, prepared "
            f"{1000 * (prepared_at - began):.0f} ms, pod Running "
            f"{1000 * (running_at - began):.0f} ms"
        )
        self.release(node, claim, pod, uid)

    def release(self, node: testnode.Node, claim: str, pod: str, uid: str) -> None:
        """The pod deleted and the claim unprepared, then the claim deleted as the resourceclaim
        controller would once no pod uses it."""
        assert self.agent is not None
        spec = self.agent.directory / "cdi" / f"edl.io-claim-{uid}.json"
        self.core.delete_namespaced_pod(pod, NAMESPACE, grace_period_seconds=0)
        self.until(f"claim {claim} unprepared", lambda: None if spec.exists() else True, node)
        status = {"status": {"reservedFor": None, "allocation": None}}
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, "resourceclaims", claim, status
        )
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "resourceclaims", claim, {"metadata": {"finalizers": None}}
        )
        self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "resourceclaims", claim
        )

    # --- 3. XIDs -----------------------------------------------------------------------------

    def xid(self, node: testnode.Node, index: int, slices: ObjectWatch) -> None:
        assert self.agent is not None
        agent = self.agent
        by_index = {
            d["attributes"]["index"]["int"]: name
            for name, d in slice_devices(slices.latest()).items()
        }
        device = by_index[index]
        self.pause()
        began = time.time()
        inject.inject_xid(agent.tree, index, XID)
        at, _ = self.until(
            f"{device} tainted {UNHEALTHY_TAINT}",
            lambda: slices.first(lambda s: tainted(s, device), began),
            node,
        )
        written = self.logged(
            "the agent's slices after the XID", "ResourceSlices published", node, since=began
        )[0]
        self.samples.xid_taint_s.append(at - began)
        self.samples.xid_taint_agent_s.append(written - began)
        log(
            f"XID {XID} on GPU {index}: the agent published at {1000 * (written - began):.0f} "
            f"ms, the API showed {device} tainted at {1000 * (at - began):.0f} ms"
        )

    # --- one node ----------------------------------------------------------------------------

    def run_node(self, profile: str, starts: int, rounds: int, xids: int) -> None:
        root = self.scratch / profile.rsplit("-", 1)[-1]
        node = testnode.start_node_on(
            self.plane, root, f"dra-{profile}", attached=True, timeout=STEP_S
        )
        watches: list[ObjectWatch] = []
        try:
            slices = ObjectWatch(
                self.custom.list_cluster_custom_object,
                group=GROUP,
                version=VERSION,
                plural="resourceslices",
                field_selector=f"spec.nodeName={node.name}",
            )
            watches.append(slices)
            for start in range(starts):
                if start:
                    self.stop_agent()
                    self.delete_slices(node, slices)
                log(f"{profile}: agent start {start + 1}/{starts}")
                self.publish(node, profile, slices)
            if profile != CLAIM_PROFILE:
                return
            claims = ObjectWatch(
                self.custom.list_namespaced_custom_object,
                group=GROUP,
                version=VERSION,
                namespace=NAMESPACE,
                plural="resourceclaims",
            )
            watches.append(claims)
            pods = ObjectWatch(self.core.list_namespaced_pod, namespace=NAMESPACE)
            watches.append(pods)
            for number in range(rounds):
                self.claim_round(node, number, claims, pods)
            for index in range(xids):
                self.xid(node, index, slices)
        finally:
            for started in watches:
                started.stop()
            self.stop_agent()
            node.stop()
            # Their owner is the Node, but no garbage collector runs on the test control plane.
            with contextlib.suppress(ApiException):
                left = self.custom.list_cluster_custom_object(
                    GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node.name}"
                )
                for item in left["items"]:
                    self.custom.delete_cluster_custom_object(
                        GROUP, VERSION, "resourceslices", item["metadata"]["name"]
                    )


def report(samples: Samples) -> None:
    def figure(name: str, value: float, unit: str) -> None:
        print(f"dra_{name} {value:.6g} {unit}", flush=True)

    for profile, seconds in samples.slices_s.items():
        short = profile.replace("-", "_")
        figure(f"{short}_devices", samples.devices[profile], "devices")
        figure(f"{short}_resource_slices", samples.slice_count[profile], "slices")
        figure(f"{short}_slices_p50", percentile(seconds, 50) * 1000, "ms")
        figure(f"{short}_slices_max", max(seconds) * 1000, "ms")
        figure(f"{short}_discovered", statistics.median(samples.discovered_s[profile]) * 1000, "ms")
        agent = statistics.median(samples.slices_agent_s[profile])
        figure(f"{short}_slices_agent", agent * 1000, "ms")
        figure(f"{short}_serving", statistics.median(samples.serving_s[profile]) * 1000, "ms")
        figure(f"{short}_registered", statistics.median(samples.registered_s[profile]) * 1000, "ms")
        figure(f"{short}_starts", len(seconds), "starts")
    series = {
        "xid_taint": samples.xid_taint_s,
        "xid_taint_agent": samples.xid_taint_agent_s,
        "claim_allocated": samples.claim_allocated_s,
        "claim_prepared": samples.claim_prepared_s,
        "claim_running": samples.claim_running_s,
    }
    for name, seconds in series.items():
        if seconds:
            figure(f"{name}_p50", percentile(seconds, 50) * 1000, "ms")
            figure(f"{name}_max", max(seconds) * 1000, "ms")
    figure("xids", len(samples.xid_taint_s), "xids")
    figure("claims", len(samples.claim_running_s), "claims")


def create_device_classes(custom: client.CustomObjectsApi) -> None:
    for body in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
        if body:
            custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", body)


@contextlib.contextmanager
def control_plane(scratch: Path) -> Iterator[tuple[testcluster.ControlPlane, client.ApiClient]]:
    log("starting the test control plane (etcd, kube-apiserver, KWOK) and kube-scheduler")
    plane = testcluster.start(scratch / "plane", attached=True)
    api: client.ApiClient | None = None
    try:
        log(f"control plane ready in {plane.startup_seconds:.1f}s")
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        scheduler = start_scheduler(plane.kubeconfig, scratch / "scheduler", timeout=STEP_S)
        try:
            yield plane, api
        finally:
            scheduler.stop()
    finally:
        if api is not None:
            with contextlib.suppress(Exception):
                api.close()
        plane.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 start per profile, 3 claims, 1 XID")
    parser.add_argument("--starts", type=int, help="agent starts per profile (default 3)")
    parser.add_argument("--claims", type=int, help="claim → pod rounds (default 10)")
    parser.add_argument("--xids", type=int, help="XIDs, each on another GPU (default 5, at most 8)")
    parser.add_argument("--seed", type=int, default=0, help="of the random pauses")
    args = parser.parse_args()
    starts = args.starts or (1 if args.quick else 3)
    rounds = args.claims or (3 if args.quick else 10)
    xids = min(args.xids or (1 if args.quick else 5), 8)
    needed = (*k8sbinaries.CONTROL_PLANE, "kubelet", "kube-scheduler", k8sbinaries.FAKE_CRI)
    absent = k8sbinaries.missing(needed)
    if absent:
        log(f"{', '.join(absent)} missing in {k8sbinaries.bin_dir()}: run scripts/k8s-binaries")
        return 3
    problem = testnode.preflight()
    if problem is not None:
        log(problem)
        return 3
    samples = Samples()
    # Short: the nodes' sockets live under it (testnode.MAX_NODE_DIR).
    with tempfile.TemporaryDirectory(prefix="edl-dra-", dir="/tmp") as tmp:
        scratch = Path(tmp)
        try:
            with control_plane(scratch) as (plane, api):
                core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
                core.create_namespace(
                    client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
                )
                create_device_classes(custom)
                pauses = random.Random(args.seed)  # noqa: S311 - not a secret
                bench = Bench(plane, core, custom, scratch, samples, pauses)
                # The claims' node last: its kubelet runs alone then.
                for profile in sorted(PROFILES, key=lambda p: p == CLAIM_PROFILE):
                    bench.run_node(profile, starts, rounds, xids)
        except (RunFailed, testnode.NodeError, ProcessError, ApiException) as exc:
            log(str(exc))
            return 1
    report(samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
