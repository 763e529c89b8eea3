"""The whole node, side by side: edl-agent alone, and NVIDIA's k8s-device-plugin with GPU
Feature Discovery (GFD), what a node that does not run us runs at least.

    .venv/bin/python bench/node_peer.py [--quick] [--build] [--rounds 2] [--idle 65]

One test control plane (etcd + kube-apiserver + KWOK, scripts/testcluster.py) for the run, with
Node Feature Discovery's CRDs installed (from NFD's Go module, at the version NVIDIA's module
requires). Per round and per side, on a fresh simulated dgx-h100 (8 GPUs) with its own KWOK
Node object and kubelet stand-in (tests/kubelet_standin.py):

- ours: one `edl-agent run` process with `--kubeconfig` and `--node-name`: it serves the
  device-plugin API and patches its labels onto the Node;
- theirs: nvidia-device-plugin (run as bench/nvidia_peer.py runs it) and gpu-feature-discovery
  started together, GFD with its default output, the NFD NodeFeature API: it writes its labels
  into the NodeFeature object `nvidia-features-for-<node>` (NFD's nfd-master would copy them
  onto the Node; it does not run here, so theirs stops one step short of the Node).

Figures, ours / theirs:

- labels: process start → labels on the control plane (ours: the Node carries
  nvidia.com/gpu.product; theirs: the NodeFeature object does), seen through a watch;
- registration: process start → nvidia.com/gpu registered with the stand-in;
- ready: process start → both of the above;
- rss and idle_cpu: summed over the side's processes (and their children) once everything is
  up, the stand-in holds a ListAndWatch stream as kubelet does, and a settling pause has passed:
  CPU time over the idle window in percent of one core, RSS at its end.

Both use the control plane's admin kubeconfig. Prints `name value unit` lines (medians over the
rounds); figures are never judged. Exit status 3 when NVIDIA's plugin or GFD is not built
(without --build) or the control plane's binaries are missing, 1 when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubernetes import client, config, watch

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "tests" / "cluster", REPO / "scripts", REPO / "bench", REPO):
    sys.path.insert(0, str(_path))

import build_nvidia_plugin  # noqa: E402
import k8sbinaries  # noqa: E402
import pytest  # noqa: E402  (kube_tools reports its errors with pytest.fail)
import testcluster  # noqa: E402
from benchstats import print_side_by_side  # noqa: E402
from k8s_test_helpers import KwokCluster  # noqa: E402
from kube_tools import ModuleCrds, crd_files, wait_established  # noqa: E402
from nvidia_peer import (  # noqa: E402
    RESOURCE,
    Node,
    RunFailed,
    _failure,
    _start,
    _stop,
    ours_command,
    theirs_command,
)

from tests.kubelet_standin import KubeletStandIn  # noqa: E402

PEERS = (build_nvidia_plugin.BINARY, build_nvidia_plugin.GFD)  # what runs instead of us
NAMESPACE = "node-peer"  # where GFD writes its NodeFeature objects
LABEL = "nvidia.com/gpu.product"  # both sides write it, and each writes all its labels at once
NFD_MODULE = "sigs.k8s.io/node-feature-discovery"
NFD_CRDS_DIR = "deployment/base/nfd-crds"
NFD_CRDS_FILE = "nfd-api-crds.yaml"
NODE_FEATURE = ("nfd.k8s-sigs.io", "v1alpha1", "nodefeatures")
NODE_FEATURE_PREFIX = "nvidia-features-for-"  # GFD's name: <prefix><node>
START_TIMEOUT_S = 60.0

Command = Callable[[Node], tuple[list[str], dict[str, str]]]


def log(message: str) -> None:
    print(f"[node-peer] {message}", file=sys.stderr, flush=True)


@dataclass
class Samples:
    labels_s: list[float] = field(default_factory=list)
    registration_s: list[float] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    idle_cpu_percent: list[float] = field(default_factory=list)
    processes: int = 0
    labels: dict[str, str] = field(default_factory=dict)


class LabelsSeen:
    """When an object first carries LABEL: a list, then a watch from the list's
    resourceVersion (nothing slips between them), on its own thread."""

    def __init__(self, list_call: Callable[..., Any], path: tuple[str, ...], **kwargs: Any) -> None:
        self._path = path
        self.at: float | None = None
        self.labels: dict[str, str] = {}
        self.before: dict[str, str] = {}
        self.seen = threading.Event()
        listed = json.loads(list_call(_preload_content=False, **kwargs).data)
        for item in listed.get("items", []):
            self.before = self._labels(item)
            self._check(item)
        self._thread = threading.Thread(
            target=self._watch,
            args=(list_call, listed["metadata"]["resourceVersion"], kwargs),
            daemon=True,
        )
        self._thread.start()

    def _labels(self, obj: dict[str, Any]) -> dict[str, str]:
        for key in self._path:
            obj = obj.get(key) or {}
        return dict(obj)

    def _check(self, obj: dict[str, Any]) -> None:
        labels = self._labels(obj)
        if not self.seen.is_set() and LABEL in labels:
            self.at = time.monotonic()
            self.labels = labels
            self.seen.set()

    def _watch(self, list_call: Callable[..., Any], version: str, kwargs: dict[str, Any]) -> None:
        stream = watch.Watch()
        events = stream.stream(
            list_call, resource_version=version, timeout_seconds=int(START_TIMEOUT_S) + 30,
            **kwargs,
        )  # fmt: skip
        for event in events:
            if event["type"] in ("ADDED", "MODIFIED"):
                self._check(event["raw_object"])
            if self.seen.is_set():
                break
        stream.stop()

    def wait(self, timeout: float) -> float | None:
        """The monotonic time the label was first seen, None if not within `timeout`."""
        return self.at if self.seen.wait(timeout) else None


@dataclass
class Plane:
    """The control plane of the run: the admin client and kubeconfig, KWOK nodes."""

    kubeconfig: Path
    api: client.ApiClient
    kwok: KwokCluster

    def node_labels(self, name: str) -> LabelsSeen:
        return LabelsSeen(
            self.kwok.core.list_node, ("metadata", "labels"), field_selector=f"metadata.name={name}"
        )

    def node_feature_labels(self, name: str) -> LabelsSeen:
        group, version, plural = NODE_FEATURE
        return LabelsSeen(
            client.CustomObjectsApi(self.api).list_namespaced_custom_object,
            ("spec", "labels"),
            group=group, version=version, namespace=NAMESPACE, plural=plural,
            field_selector=f"metadata.name={NODE_FEATURE_PREFIX}{name}",
        )  # fmt: skip


def nfd_version(version: str) -> str:
    """The NFD module version NVIDIA's go.mod requires (its NodeFeature client is built on it)."""
    source = build_nvidia_plugin.module_source(version)
    if source is None:
        msg = f"{build_nvidia_plugin.MODULE}@{version} is not in the Go module cache"
        raise RuntimeError(msg)
    found = re.search(rf"^\s*{re.escape(NFD_MODULE)} (v\S+)", (source / "go.mod").read_text(), re.M)
    if found is None:
        msg = f"{NFD_MODULE} is not required by {build_nvidia_plugin.MODULE}@{version}"
        raise RuntimeError(msg)
    return found.group(1)


def install_nfd_crds(api: client.ApiClient, version: str, workdir: Path) -> None:
    """NFD's CRDs (NodeFeature among them) from its Go module, cached in .cache/ like the other
    projects' CRDs of tests/cluster/kube_tools.py, created through the API."""
    crds = ModuleCrds(
        module=NFD_MODULE,
        version=nfd_version(version),
        directory=NFD_CRDS_DIR,
        files=(NFD_CRDS_FILE,),
        names=(f"{NODE_FEATURE[2]}.{NODE_FEATURE[0]}",),
    )
    extensions = client.ApiextensionsV1Api(api)
    for path in crd_files(crds, workdir):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                extensions.create_custom_resource_definition(doc)
    for name in crds.names:
        wait_established(extensions, name)
    log(f"NFD {crds.version} CRDs installed ({', '.join(crds.names)} Established)")


def gfd_command(binary: Path, plugin: Path, kubeconfig: Path, node_name: str) -> Command:
    def command(node: Node) -> tuple[list[str], dict[str, str]]:
        argv = [
            str(binary), "--fail-on-init-error=true", "--mig-strategy=mixed",
            "--use-node-feature-api=true", f"--kubeconfig={kubeconfig}",
            f"--node-name={node_name}", f"--namespace={NAMESPACE}",
            f"--machine-type-file={node.tree / 'sys/class/dmi/id/product_name'}",
        ]  # fmt: skip
        # The same environment as the plugin's: LD_LIBRARY_PATH to the node's fake NVML.
        return argv, theirs_command(plugin, node)[1]

    return command


def our_agent(kubeconfig: Path, node_name: str) -> Command:
    def command(node: Node) -> tuple[list[str], dict[str, str]]:
        argv, env = ours_command(node)
        return [*argv, "--kubeconfig", str(kubeconfig), "--node-name", node_name], env

    return command


def tree_of(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        process = psutil.Process(pid)
        found += [process, *process.children(recursive=True)]
    return found


class CpuClock:
    """CPU time of some processes over a window. psutil's cpu_times count 10 ms ticks, so a
    quiet Go process reads 0 over a minute; the scheduler's per-thread run time
    (/proc/PID/task/TID/schedstat, nanoseconds) does not. A thread that ends inside the window
    takes its time out of schedstat, and then the tick count is the larger: the larger wins."""

    def __init__(self, processes: list[psutil.Process]) -> None:
        self._processes = processes
        self._ticks = self._tick_seconds()
        self._threads = self._thread_seconds()

    def _tick_seconds(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self._processes)

    def _thread_seconds(self) -> dict[tuple[int, str], float]:
        found = {}
        for process in self._processes:
            for task in Path(f"/proc/{process.pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):  # a thread that just ended
                    ns = int((task / "schedstat").read_text().split()[0])
                    found[process.pid, task.name] = ns / 1e9
        return found

    def seconds(self) -> float:
        """CPU seconds since the clock was made."""
        ticks = self._tick_seconds() - self._ticks
        now = self._thread_seconds()
        threads = sum(spent - self._threads.get(key, 0.0) for key, spent in now.items())
        return max(ticks, threads)


def run_side(
    *,
    side: str,
    plane: Plane,
    work: Path,
    commands: Callable[[str], list[tuple[str, Command]]],
    settle_s: float,
    idle_s: float,
    samples: Samples,
) -> None:
    node = Node.build(work)
    name = plane.kwok.create_gpu_node().metadata.name
    seen = plane.node_labels(name) if side == "ours" else plane.node_feature_labels(name)
    kubelet = KubeletStandIn(node.kubelet_dir)
    kubelet.start()
    started: float | None = None
    running: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for program, command in commands(name):
            process, logfile, at = _start(program, command, node)
            started = at if started is None else started
            running.append((program, process, logfile))
        assert started is not None

        def failed(why: str) -> RunFailed:
            return RunFailed("\n".join(_failure(p, proc, lf, why) for p, proc, lf in running))

        try:
            kubelet.wait_registered({RESOURCE}, timeout=START_TIMEOUT_S)
        except AssertionError as exc:
            raise failed(str(exc)) from None
        registered = time.monotonic()
        labelled = seen.wait(START_TIMEOUT_S)
        if labelled is None:
            raise failed(f"{LABEL} not on the control plane within {START_TIMEOUT_S:.0f}s")
        samples.registration_s.append(registered - started)
        samples.labels_s.append(labelled - started)
        samples.ready_s.append(max(registered, labelled) - started)
        samples.labels = {k: v for k, v in seen.labels.items() if seen.before.get(k) != v}
        log(
            f"{side}: registered {1000 * (registered - started):.0f} ms, labels "
            f"{1000 * (labelled - started):.0f} ms ({len(samples.labels)} labels); idle "
            f"{idle_s:.0f}s after {settle_s:.0f}s"
        )
        stream = kubelet.watch(RESOURCE)  # kubelet holds one ListAndWatch per resource
        try:
            stream.next(timeout=10)
            time.sleep(settle_s)
            trees = {program: tree_of([process.pid]) for program, process, _ in running}
            clocks = {program: CpuClock(processes) for program, processes in trees.items()}
            time.sleep(idle_s)
            cpu = {program: 100 * clock.seconds() / idle_s for program, clock in clocks.items()}
            rss = {program: sum(p.memory_info().rss for p in ps) for program, ps in trees.items()}
            samples.idle_cpu_percent.append(sum(cpu.values()))
            samples.rss_bytes.append(sum(rss.values()))
            samples.processes = sum(len(processes) for processes in trees.values())
            each = ", ".join(f"{p} {rss[p] / 2**20:.1f} MiB {cpu[p]:.3f} %" for p in trees)
            log(f"{side}: RSS and idle CPU: {each}")
        finally:
            stream.cancel()
        if any(process.poll() is not None for _, process, _ in running):
            raise failed("exited during the run")
    finally:
        for _, process, _ in running:
            _stop(process)
        kubelet.stop()


def report(ours: Samples, theirs: Samples, idle_s: float) -> None:
    def figures(s: Samples) -> dict[str, tuple[float, str]]:
        return {
            "labels": (statistics.median(s.labels_s) * 1000, "ms"),
            "registration": (statistics.median(s.registration_s) * 1000, "ms"),
            "ready": (statistics.median(s.ready_s) * 1000, "ms"),
            "rss": (statistics.median(s.rss_bytes) / 2**20, "MiB"),
            "idle_cpu": (statistics.median(s.idle_cpu_percent), "percent_of_a_core"),
        }

    print_side_by_side("node_peer", figures(ours), figures(theirs))
    print(f"node_peer_processes_ours {ours.processes} processes")
    print(f"node_peer_processes_theirs {theirs.processes} processes")
    print(f"node_peer_label_count_ours {len(ours.labels)} labels")
    print(f"node_peer_label_count_theirs {len(theirs.labels)} labels")
    print(f"node_peer_idle_window {idle_s:.0f} s")
    lacking = sorted(set(theirs.labels) - set(ours.labels))
    if lacking:
        log(f"GFD labels ours does not write: {', '.join(lacking)}")
    differ = sorted(
        k for k in set(theirs.labels) & set(ours.labels) if ours.labels[k] != theirs.labels[k]
    )
    for key in differ:
        log(f"label {key}: ours {ours.labels[key]!r}, GFD {theirs.labels[key]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 s idle window")
    parser.add_argument("--rounds", type=int, help="fresh nodes per side (default 2)")
    parser.add_argument("--idle", type=float, help="idle window in seconds (default 65)")
    parser.add_argument("--build", action="store_true", help="build the plugin and GFD if missing")
    parser.add_argument("--version", default=build_nvidia_plugin.DEFAULT_VERSION)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    # 65 s: GFD relabels every 60 s (--sleep-interval) and we re-discover every 60 s, so a full
    # window holds one of each; quick mode sees neither.
    idle_s = args.idle or (2.0 if args.quick else 65.0)
    settle_s = 1.0 if args.quick else 5.0
    plugin, gfd = build_nvidia_plugin.require(
        args.version, PEERS, build_missing=args.build, say=log
    )
    absent = k8sbinaries.missing(k8sbinaries.CONTROL_PLANE)
    if absent:
        log(f"the test control plane lacks {', '.join(absent)}: run scripts/k8s-binaries")
        return 3
    ours, theirs = Samples(), Samples()
    with tempfile.TemporaryDirectory(prefix="edl-node-peer-") as tmp:
        scratch = Path(tmp)
        log("starting the test control plane (etcd, kube-apiserver, KWOK)")
        control = testcluster.start(scratch / "plane", attached=True)
        api: client.ApiClient | None = None
        try:
            log(f"control plane ready in {control.startup_seconds:.1f}s")
            api = config.new_client_from_config(config_file=str(control.kubeconfig))
            plane = Plane(control.kubeconfig, api, KwokCluster(api, NAMESPACE))
            plane.kwok.core.create_namespace(
                client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
            )
            install_nfd_crds(api, args.version, scratch)

            def our_side(name: str) -> list[tuple[str, Command]]:
                return [("edl-agent", our_agent(control.kubeconfig, name))]

            def their_side(name: str) -> list[tuple[str, Command]]:
                return [
                    ("nvidia-device-plugin", lambda node: theirs_command(plugin, node)),
                    ("gpu-feature-discovery", gfd_command(gfd, plugin, control.kubeconfig, name)),
                ]

            sides = [("ours", our_side, ours), ("theirs", their_side, theirs)]
            for number in range(rounds):
                # Alternate who goes first, so that neither always runs on a cooler machine.
                for side, commands, samples in sides if number % 2 == 0 else sides[::-1]:
                    log(f"round {number + 1}/{rounds}: {side}")
                    work = scratch / f"{number}-{side}"
                    work.mkdir()
                    run_side(
                        side=side, plane=plane, work=work, commands=commands,
                        settle_s=settle_s, idle_s=idle_s, samples=samples,
                    )  # fmt: skip
        except RunFailed as exc:
            log(str(exc))
            return 1
        except pytest.fail.Exception as exc:  # kube_tools could not fetch NFD's CRDs
            log(f"NFD's CRDs: {exc}")
            return 1
        finally:
            if api is not None:
                api.close()
            control.stop()
    report(ours, theirs, idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
