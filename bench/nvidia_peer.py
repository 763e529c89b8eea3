"""Side by side: edl-agent and NVIDIA's k8s-device-plugin on the same simulated node.

    .venv/bin/python bench/nvidia_peer.py [--quick] [--build] [--rounds 5] [--calls 5000]

Both run as processes on a simulated dgx-h100 (8 GPUs), load the same fake libnvidia-ml.so.1
(edl_agent/sim/fake_nvml.c) and register with the same kubelet stand-in
(tests/kubelet_standin.py). Per round and per plugin, on a fresh node:

- registration: process start until nvidia.com/gpu is registered with the stand-in;
- Allocate latency: the same seeded list of requests (2 GPUs by uuid each), after a warm-up;
- RSS after that warm-up and the Allocate calls;
- re-registration: the stand-in restarts as kubelet does (every socket in its directory deleted,
  then a new kubelet.sock) until nvidia.com/gpu is registered again, several times;
- XID 79 on each GPU in turn (a line in the fake library's fault file, delivered as an NVML
  event) until ListAndWatch shows that GPU Unhealthy. Each GPU once per round: NVIDIA's plugin
  never marks a device Healthy again, and XID 79 keeps ours Unhealthy until re-discovery.
  An XID that leaves the GPU Healthy for 5 s counts as missed and is injected again (the
  latency is taken from the second one). NVIDIA's plugin starts its health watch only after
  it registers, so an XID in the first milliseconds after a (re-)registration is lost to it;
  on the real driver that event would be lost the same way.

Then, on a simulated dgx-a100-mig (MIG, mixed strategy: nvidia.com/gpu and four
nvidia.com/mig-<profile> resources), the registration time of all resources, and a check that
both advertise the same devices (a mismatch is logged, never fatal).

NVIDIA's plugin always serves on /var/lib/kubelet/device-plugins/nvidia-<name>.sock (a constant
in its code; only the kubelet socket is a flag) and reads MIG capability minors from the host's
/proc/driver/nvidia-caps/mig-minors (no root prefix either), so it runs in a private mount
namespace (`unshare --mount`, as root or in a user namespace) with scratch directories bound
over /var/lib and /proc/driver.

Prints `name value unit` lines: ours, theirs and ours/theirs for each figure. Exit status 3
when NVIDIA's plugin is not built (without --build), 1 when a run fails.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import build_nvidia_plugin  # noqa: E402
from benchstats import percentile, print_side_by_side  # noqa: E402
from runtime_venv import runtime_python  # noqa: E402

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2  # noqa: E402
from edl_agent.sim import inject, nvidia_tree  # noqa: E402
from edl_agent.sim.profile import load_profile  # noqa: E402
from edl_agent.sim.tree import build_tree  # noqa: E402
from tests.kubelet_standin import KubeletStandIn  # noqa: E402

RESOURCE = "nvidia.com/gpu"
PROFILE = "dgx-h100"
MIG_PROFILE = "dgx-a100-mig"
XID = 79
XID_WAIT_S = 5.0
XID_ATTEMPTS = 2
WARMUP_CALLS = 200
GPUS_PER_REQUEST = 2


def log(message: str) -> None:
    print(f"[nvidia-peer] {message}", file=sys.stderr, flush=True)


@dataclass
class Samples:
    registration_s: list[float] = field(default_factory=list)
    allocate_s: list[float] = field(default_factory=list)
    xid_s: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    reregister_s: list[float] = field(default_factory=list)
    mig_registration_s: list[float] = field(default_factory=list)
    mig_devices: dict[str, int] = field(default_factory=dict)
    xid_missed: int = 0  # XIDs that never turned the GPU Unhealthy (injected again)


class RunFailed(Exception):
    """One plugin did not come up or did not answer; the message carries its log's tail."""


@dataclass(frozen=True)
class Node:
    """A fresh simulated node and kubelet directory for one run of one plugin."""

    work: Path
    tree: Path
    var_lib: Path  # bound over /var/lib for NVIDIA's plugin
    proc_driver: Path  # bound over /proc/driver for NVIDIA's plugin
    kubelet_dir: Path  # <var_lib>/kubelet/device-plugins
    uuids: list[str]  # by GPU index
    resources: set[str]  # what a plugin should register (MIG mixed strategy)

    @classmethod
    def build(cls, work: Path, profile: str = PROFILE) -> Node:
        tree = work / "node"
        build_tree(load_profile(profile), tree)
        var_lib = work / "var-lib"
        kubelet_dir = var_lib / "kubelet" / "device-plugins"
        kubelet_dir.mkdir(parents=True)
        gpus, migs = nvml_records(tree)
        proc_driver = work / "proc-driver"
        write_mig_minors(proc_driver / "nvidia-caps" / "mig-minors", gpus, migs)
        uuids = [gpu["uuid"] for gpu in gpus]
        resources = {f"nvidia.com/mig-{mig['name'].rsplit(' ', 1)[-1]}" for mig in migs}
        if any(not any(m["gpu"] == gpu["index"] for m in migs) for gpu in gpus):
            resources.add(RESOURCE)
        return cls(work, tree, var_lib, proc_driver, kubelet_dir, uuids, resources)


def nvml_records(tree: Path) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The gpu and mig records of the fake library's data file, in file order."""
    gpus, migs = [], []
    for line in (tree / nvidia_tree.DATA.lstrip("/")).read_text().splitlines():
        kind, *pairs = line.split("\t")
        fields = dict(pair.partition("=")[::2] for pair in pairs)
        if kind == "gpu":
            gpus.append(fields)
        elif kind == "mig":
            migs.append(fields)
    return gpus, migs


def write_mig_minors(path: Path, gpus: list[dict[str, str]], migs: list[dict[str, str]]) -> None:
    """What the NVIDIA driver shows in /proc/driver/nvidia-caps/mig-minors: a device minor
    (/dev/nvidia-caps/nvidia-cap<N>) per MIG capability; NVIDIA's plugin needs the lines of
    every GPU and compute instance it serves."""
    minor_of = {gpu["index"]: gpu.get("minor", gpu["index"]) for gpu in gpus}
    lines = ["config 1", "monitor 2"]
    for number, mig in enumerate(migs):
        prefix = f"gpu{minor_of[mig['gpu']]}/gi{mig['gpu_instance']}"
        lines.append(f"{prefix}/access {3 + 2 * number}")
        lines.append(f"{prefix}/ci{mig['compute_instance']}/access {4 + 2 * number}")
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")


def ours_command(node: Node) -> tuple[list[str], dict[str, str]]:
    argv = [
        str(runtime_python()), "-m", "edl_agent.cli", "run", "--host-root", str(node.tree),
        "--kubelet-dir", str(node.kubelet_dir), "--metrics-addr", "127.0.0.1:0",
        "--state-dir", str(node.work / "state"), "--log-level", "warning",
        "--set", "plugin.nvidia_device_specs=true", "--set", "nvidia.mig_strategy=mixed",
    ]  # fmt: skip
    return argv, {**os.environ, "PYTHONPATH": str(REPO)}


def theirs_command(binary: Path, node: Node) -> tuple[list[str], dict[str, str]]:
    plugin = [
        str(binary), "--fail-on-init-error=true", "--mig-strategy=mixed",
        "--device-list-strategy=envvar", "--device-id-strategy=uuid",
        "--pass-device-specs=true", f"--dev-root={node.tree}",
        "--gdrcopy-enabled=false", "--gds-enabled=false", "--mofed-enabled=false",
    ]  # fmt: skip
    # unshare execs sh, which execs the plugin: the pid we hold is the plugin's own.
    namespace = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace.insert(1, "--map-root-user")
    # -n: the mounts die with the namespace; without it mount(8) writes /run/mount on the host.
    bind = (
        'mount -n --bind "$1" /var/lib && mount -n --bind "$2" /proc/driver && shift 2 && exec "$@"'
    )
    argv = [*namespace, "sh", "-c", bind, "sh", str(node.var_lib), str(node.proc_driver), *plugin]
    lib_dir = node.tree / Path(nvidia_tree.LIBRARY).parent.relative_to("/")
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir)}
    return argv, env


def allocate_requests(uuids: list[str], count: int, seed: int) -> list[api_pb2.AllocateRequest]:
    rng = random.Random(seed)  # noqa: S311 - a repeatable sample, not a secret
    return [
        api_pb2.AllocateRequest(
            container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=rng.sample(uuids, GPUS_PER_REQUEST))
            ]
        )
        for _ in range(count)
    ]


def run_one(
    *,
    name: str,
    command: Callable[[Node], tuple[list[str], dict[str, str]]],
    work: Path,
    calls: int,
    restarts: int,
    seed: int,
    samples: Samples,
) -> None:
    node = Node.build(work)
    kubelet = KubeletStandIn(node.kubelet_dir)
    kubelet.start()
    process, logfile, started = _start(name, command, node)
    try:
        try:
            kubelet.wait_registered({RESOURCE}, timeout=60)
        except AssertionError as exc:
            raise RunFailed(_failure(name, process, logfile, str(exc))) from None
        samples.registration_s.append(time.monotonic() - started)
        with kubelet.plugin(RESOURCE) as stub:
            for request in allocate_requests(node.uuids, WARMUP_CALLS, seed + 1):
                stub.Allocate(request, timeout=5)
            for request in allocate_requests(node.uuids, calls, seed):
                begun = time.perf_counter()
                stub.Allocate(request, timeout=5)
                samples.allocate_s.append(time.perf_counter() - begun)
        samples.rss_bytes.append(psutil.Process(process.pid).memory_info().rss)
        for _ in range(restarts):
            seen = len(kubelet.registrations)
            begun = time.perf_counter()
            kubelet.restart()
            try:
                kubelet.wait_registered({RESOURCE}, after=seen, timeout=30)
            except AssertionError as exc:
                raise RunFailed(
                    _failure(name, process, logfile, f"after a restart: {exc}")
                ) from None
            samples.reregister_s.append(time.perf_counter() - begun)
        watch = kubelet.watch(RESOURCE)
        try:
            watch.next(timeout=10)
            for gpu, uuid in enumerate(node.uuids):
                for attempt in range(XID_ATTEMPTS):
                    begun = time.perf_counter()
                    inject.inject_xid(node.tree, gpu, XID)
                    try:
                        watch.until(
                            lambda u, want=uuid: _health(u, want) == "Unhealthy",
                            timeout=XID_WAIT_S,
                        )
                    except queue.Empty:
                        if attempt + 1 < XID_ATTEMPTS:
                            samples.xid_missed += 1
                            log(f"{name}: GPU {gpu} missed XID {XID}; injecting it again")
                            continue
                        why = (
                            f"GPU {gpu} not Unhealthy in ListAndWatch {XID_WAIT_S:g} s after "
                            f"each of {XID_ATTEMPTS} XID {XID}"
                        )
                        raise RunFailed(_failure(name, process, logfile, why)) from None
                    samples.xid_s.append(time.perf_counter() - begun)
                    break
        finally:
            watch.cancel()
        if process.poll() is not None:
            raise RunFailed(_failure(name, process, logfile, "exited during the run"))
    finally:
        _stop(process)
        kubelet.stop()


def run_mig(
    *,
    name: str,
    command: Callable[[Node], tuple[list[str], dict[str, str]]],
    work: Path,
    samples: Samples,
) -> None:
    """Registration of every resource of the MIG node, and how many devices each lists."""
    node = Node.build(work, MIG_PROFILE)
    kubelet = KubeletStandIn(node.kubelet_dir)
    kubelet.start()
    process, logfile, started = _start(name, command, node)
    try:
        try:
            kubelet.wait_registered(node.resources, timeout=60)
        except AssertionError as exc:
            raise RunFailed(_failure(name, process, logfile, str(exc))) from None
        samples.mig_registration_s.append(time.monotonic() - started)
        for resource in sorted(node.resources):
            watch = kubelet.watch(resource)
            try:
                samples.mig_devices[resource] = len(watch.next(timeout=10).devices)
            finally:
                watch.cancel()
    finally:
        _stop(process)
        kubelet.stop()


def _start(
    name: str, command: Callable[[Node], tuple[list[str], dict[str, str]]], node: Node
) -> tuple[subprocess.Popen[bytes], Path, float]:
    argv, env = command(node)
    logfile = node.work / f"{name}.log"
    with logfile.open("w") as out:
        started = time.monotonic()
        process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return process, logfile, started


def _health(update: object, device_id: str) -> str:
    devices = getattr(update, "devices", [])
    return next((d.health for d in devices if device_id == d.ID), "")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _failure(name: str, process: subprocess.Popen[bytes], logfile: Path, why: str) -> str:
    status = process.poll()
    state = "still running" if status is None else f"exit status {status}"
    lines = logfile.read_text(errors="replace").splitlines()
    tail = "\n".join(f"    {line}" for line in lines[-15:])
    return f"{name}: {why} ({state}); last lines of its log:\n{tail}"


def report(ours: Samples, theirs: Samples) -> None:
    def figures(s: Samples) -> dict[str, tuple[float, str]]:
        return {
            "registration": (statistics.median(s.registration_s) * 1000, "ms"),
            "allocate_p50": (percentile(s.allocate_s, 50) * 1000, "ms"),
            "allocate_p99": (percentile(s.allocate_s, 99) * 1000, "ms"),
            "xid_unhealthy_p50": (percentile(s.xid_s, 50) * 1000, "ms"),
            "xid_unhealthy_p99": (percentile(s.xid_s, 99) * 1000, "ms"),
            "rss": (statistics.median(s.rss_bytes) / 2**20, "MiB"),
            "reregister_p50": (percentile(s.reregister_s, 50) * 1000, "ms"),
            "reregister_max": (max(s.reregister_s) * 1000, "ms"),
            "mig_registration": (statistics.median(s.mig_registration_s) * 1000, "ms"),
        }

    print_side_by_side("nvidia_peer", figures(ours), figures(theirs))
    print(f"nvidia_peer_mig_resources {len(ours.mig_devices)} resources")
    print(f"nvidia_peer_mig_devices {sum(ours.mig_devices.values())} devices")
    if ours.mig_devices != theirs.mig_devices:
        log(f"MIG node: the plugins differ: ours {ours.mig_devices}, theirs {theirs.mig_devices}")
    print(f"nvidia_peer_allocate_calls {len(ours.allocate_s)} calls")
    print(f"nvidia_peer_xid_samples {len(ours.xid_s)} samples")
    print(f"nvidia_peer_xid_missed_ours {ours.xid_missed} events")
    print(f"nvidia_peer_xid_missed_theirs {theirs.xid_missed} events")
    print(f"nvidia_peer_reregister_samples {len(ours.reregister_s)} samples")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds: 1,000 calls, 3 restarts")
    parser.add_argument("--rounds", type=int, help="fresh starts per plugin (default 5)")
    parser.add_argument("--calls", type=int, help="measured Allocate calls per round (5,000)")
    parser.add_argument("--restarts", type=int, help="kubelet restarts per round (10)")
    parser.add_argument("--build", action="store_true", help="build NVIDIA's plugin if missing")
    parser.add_argument("--version", default=build_nvidia_plugin.DEFAULT_VERSION)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    calls = args.calls or (1000 if args.quick else 5000)
    restarts = args.restarts or (3 if args.quick else 10)
    [binary] = build_nvidia_plugin.require(
        args.version, (build_nvidia_plugin.BINARY,), build_missing=args.build, say=log
    )
    if shutil.which("unshare") is None:
        log("`unshare` (util-linux) is missing: NVIDIA's plugin needs a private /var/lib")
        return 1
    ours, theirs = Samples(), Samples()
    sides: list[tuple[str, Callable[[Node], tuple[list[str], dict[str, str]]], Samples]] = [
        ("edl-agent", ours_command, ours),
        ("nvidia", lambda node: theirs_command(binary, node), theirs),
    ]
    with tempfile.TemporaryDirectory(prefix="edl-peer-") as tmp:
        for number in range(rounds):
            # Alternate who goes first, so that neither always runs on a cooler machine.
            order = sides if number % 2 == 0 else sides[::-1]
            for name, command, samples in order:
                log(
                    f"round {number + 1}/{rounds}: {name} ({calls} Allocate calls, "
                    f"{restarts} kubelet restarts, 8 XIDs, MIG)"
                )
                work = Path(tmp) / f"{number}-{name}"
                work.mkdir()
                mig_work = Path(tmp) / f"{number}-{name}-mig"
                mig_work.mkdir()
                try:
                    run_mig(name=name, command=command, work=mig_work, samples=samples)
                    run_one(
                        name=name,
                        command=command,
                        work=work,
                        calls=calls,
                        restarts=restarts,
                        seed=number,
                        samples=samples,
                    )
                except RunFailed as exc:
                    log(str(exc))
                    return 1
    report(ours, theirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
