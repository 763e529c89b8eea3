"""The device-plugin servers against a kubelet stand-in, over real unix sockets, on simulated
nodes read through the real discovery code (and the real pynvml with the fake NVML)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2
from edl_agent.agent import Agent
from edl_agent.config import load_settings
from edl_agent.node_lock import LOCK_NAME
from edl_agent.sim.profile import load_profile, profile_names
from edl_agent.sim.tree import build_tree
from tests.kubelet_standin import KubeletStandIn, Watch


@dataclass
class Node:
    agent: Agent
    kubelet: KubeletStandIn
    tree: Path

    @property
    def resources(self) -> set[str]:
        return set(self.agent.state.snapshot().resources)

    def allocate(self, resource: str, ids: list[str]) -> api_pb2.ContainerAllocateResponse:
        with self.kubelet.plugin(resource) as stub:
            request = api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
            )
            response: api_pb2.AllocateResponse = stub.Allocate(request, timeout=5)
        return response.container_responses[0]

    def preferred(
        self, resource: str, available: list[str], size: int, must: list[str] | None = None
    ) -> list[str]:
        with self.kubelet.plugin(resource) as stub:
            request = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=must or [],
                        allocation_size=size,
                    )
                ]
            )
            response = stub.GetPreferredAllocation(request, timeout=5)
        return list(response.container_responses[0].deviceIDs)

    def device_list(self, resource: str) -> api_pb2.ListAndWatchResponse:
        with self.kubelet.plugin(resource) as stub:
            watch = Watch(stub)
            try:
                return watch.next()
            finally:
                watch.cancel()


@contextlib.contextmanager
def running_node(
    tmp_path: Path,
    profile_name: str,
    *,
    extra: dict[str, Any] | None = None,
    agent_args: dict[str, Any] | None = None,
    faults: bool = False,
    **plugin: Any,
) -> Iterator[Node]:
    profile = load_profile(profile_name)
    tree = tmp_path / "node"
    if not tree.exists():  # a second agent in the same test finds the node as the first left it
        build_tree(profile, tree)
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    settings = load_settings(
        defaults=profile.config,
        overrides={
            "host_root": str(tree),
            "metrics_addr": "127.0.0.1:0",
            "plugin": {"kubelet_dir": str(kubelet.directory), "health_poll_seconds": 0.1, **plugin},
            "faults": {"state_dir": str(tmp_path / "state")},
            **(extra or {}),
        },
    )
    agent = Agent.discover(settings, **(agent_args or {}))
    agent.start_metrics()
    if faults:
        agent.start_faults(None)
    thread = threading.Thread(target=agent.run, name="agent")
    thread.start()
    try:
        yield Node(agent, kubelet, tree)
    finally:
        agent.stop.set()
        thread.join(timeout=10)
        kubelet.stop()
    assert not thread.is_alive()


@pytest.mark.parametrize("profile", profile_names())
def test_every_profile_registers_every_resource(tmp_path: Path, profile: str) -> None:
    with running_node(tmp_path, profile) as node:
        assert node.resources
        node.kubelet.wait_registered(node.resources)
        for request in node.kubelet.registrations:
            assert request.version == "v1beta1"
            assert request.options.get_preferred_allocation_available
            assert (node.kubelet.directory / request.endpoint).is_socket()
            assert "/" not in request.endpoint
        for resource in node.resources:
            listed = node.device_list(resource)
            expected = node.agent.state.snapshot().resources[resource].device_ids
            assert [d.ID for d in listed.devices] == list(expected)
            assert {d.health for d in listed.devices} == {"Healthy"}
    leftovers = sorted(p.name for p in node.kubelet.directory.iterdir())
    assert leftovers == [], "sockets left behind after the agent stopped"


def envs_of(response: api_pb2.ContainerAllocateResponse) -> dict[str, str]:
    return dict(response.envs)


def host_paths(response: api_pb2.ContainerAllocateResponse) -> list[str]:
    return [d.host_path for d in response.devices]


def test_allocate_nvidia(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        ids = list(node.agent.state.snapshot().resources["nvidia.com/gpu"].device_ids)
        response = node.allocate("nvidia.com/gpu", [ids[3], ids[1]])
        visible = envs_of(response)["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert sorted(visible) == sorted([ids[1], ids[3]])
        assert host_paths(response) == []  # DeviceSpecs only when configured


def test_allocate_nvidia_index_strategy_with_device_specs(tmp_path: Path) -> None:
    options = {"nvidia_device_id_strategy": "index", "nvidia_device_specs": True}
    with running_node(tmp_path, "dgx-h100", **options) as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        ids = list(node.agent.state.snapshot().resources["nvidia.com/gpu"].device_ids)
        response = node.allocate("nvidia.com/gpu", [ids[2]])
        assert envs_of(response)["NVIDIA_VISIBLE_DEVICES"] == "2"
        paths = host_paths(response)
        assert "/dev/nvidia2" in paths
        assert "/dev/nvidiactl" in paths
        assert "/dev/nvidia0" not in paths


def test_allocate_mig_devices(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-a100-mig") as node:
        node.kubelet.wait_registered({"nvidia.com/mig-3g.40gb"})
        ids = list(node.agent.state.snapshot().resources["nvidia.com/mig-3g.40gb"].device_ids)
        response = node.allocate("nvidia.com/mig-3g.40gb", ids[:1])
        assert envs_of(response)["NVIDIA_VISIBLE_DEVICES"] == ids[0]
        assert ids[0].startswith("MIG-")


@pytest.mark.parametrize(
    ("profile", "resource", "env", "paths"),
    [
        ("kunlun-p800x8", "kunlunxin.com/xpu", "XPU_VISIBLE_DEVICES", ["/dev/xpu1"]),
        ("hygon-k100x8", "hygon.com/dcunum", "HIP_VISIBLE_DEVICES", ["/dev/kfd"]),
        (
            "ascend-910bx8",
            "huawei.com/Ascend910",
            "ASCEND_VISIBLE_DEVICES",
            ["/dev/davinci1", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"],
        ),
    ],
)
def test_allocate_other_vendors(
    tmp_path: Path, profile: str, resource: str, env: str, paths: list[str]
) -> None:
    with running_node(tmp_path, profile) as node:
        node.kubelet.wait_registered({resource})
        ids = list(node.agent.state.snapshot().resources[resource].device_ids)
        response = node.allocate(resource, [ids[1]])
        assert env in envs_of(response)
        assert set(paths) <= set(host_paths(response))
        assert all(d.permissions for d in response.devices)


def test_allocate_hygon_gives_the_cards_render_node(tmp_path: Path) -> None:
    with running_node(tmp_path, "hygon-k100x8") as node:
        node.kubelet.wait_registered({"hygon.com/dcunum"})
        snapshot = node.agent.state.snapshot()
        unit = snapshot.resources["hygon.com/dcunum"].units[2]
        response = node.allocate("hygon.com/dcunum", [unit.id])
        device_nodes = set(snapshot.devices[unit.device_id].device_nodes)
        assert {p for p in host_paths(response) if p.startswith("/dev/dri/")} == {
            p for p in device_nodes if p.startswith("/dev/dri/")
        }
        assert envs_of(response)["HIP_VISIBLE_DEVICES"] == "0"


def test_allocate_cgpu_slices_maps_to_physical_gpus(tmp_path: Path) -> None:
    with running_node(tmp_path, "cgpu-v100") as node:
        memory = "baidu.com/v100_32g_cgpu_memory"
        node.kubelet.wait_registered({memory})
        units = node.agent.state.snapshot().resources[memory].units
        chosen = [u for u in units if u.device_id == units[0].device_id][:4]
        response = node.allocate(memory, [u.id for u in chosen])
        envs = envs_of(response)
        assert envs["NVIDIA_VISIBLE_DEVICES"] == units[0].device_id
        assert envs["EDL_SHARE_MEMORY_MIB"] == str(4 * 1024)


def test_allocate_unknown_id_is_invalid_argument(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        with pytest.raises(grpc.RpcError) as caught:
            node.allocate("nvidia.com/gpu", ["GPU-not-here"])
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-not-here" in (caught.value.details() or "")


def test_vanished_device_node_turns_unhealthy_and_back(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        gpu3 = node.agent.state.snapshot().resources["nvidia.com/gpu"].device_ids[3]
        with node.kubelet.plugin("nvidia.com/gpu") as stub:
            watch = Watch(stub)
            first = watch.next()
            assert {d.health for d in first.devices} == {"Healthy"}
            device_node = node.tree / "dev/nvidia3"
            device_node.unlink()
            update = watch.until(lambda u: _health(u, gpu3) == "Unhealthy")
            assert [d.ID for d in update.devices if d.health != "Healthy"] == [gpu3]
            with pytest.raises(grpc.RpcError) as caught:
                node.allocate("nvidia.com/gpu", [gpu3])
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            device_node.write_text("")
            watch.until(lambda u: _health(u, gpu3) == "Healthy")
            watch.cancel()


def test_a_device_a_dra_claim_holds_is_withheld_from_the_device_plugin(tmp_path: Path) -> None:
    """Served both ways: kubelet's device-plugin side sees the claimed GPU (and nothing else) as
    unavailable, Allocate refuses it naming the claim, and its health is untouched."""
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        ids = node.agent.state.snapshot().resources["nvidia.com/gpu"].device_ids
        with node.kubelet.plugin("nvidia.com/gpu") as stub:
            watch = Watch(stub)
            watch.next()
            node.agent.state.set_withheld({ids[2]})
            update = watch.until(lambda u: _health(u, ids[2]) == "Unhealthy")
            assert [d.ID for d in update.devices if d.health != "Healthy"] == [ids[2]]
            with pytest.raises(grpc.RpcError) as caught:
                node.allocate("nvidia.com/gpu", [ids[2]])
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "DRA claim" in (caught.value.details() or "")
            assert node.agent.state.snapshot().unhealthy_all == frozenset()
            assert node.allocate("nvidia.com/gpu", [ids[3]])
            node.agent.state.set_withheld(set())
            watch.until(lambda u: _health(u, ids[2]) == "Healthy")
            watch.cancel()


def _health(update: api_pb2.ListAndWatchResponse, device_id: str) -> str:
    return next(d.health for d in update.devices if device_id == d.ID)


def test_list_carries_numa_topology(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        listed = node.device_list("nvidia.com/gpu")
        assert [d.topology.nodes[0].ID for d in listed.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_preferred_allocation_uses_topology(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        snapshot = node.agent.state.snapshot()
        ids = list(snapshot.resources["nvidia.com/gpu"].device_ids)
        # Every pair has NVLink on this node, so the NUMA node decides: four GPUs of one node.
        chosen = node.preferred("nvidia.com/gpu", ids, 4)
        assert len(set(chosen)) == 4
        assert {snapshot.devices[i].numa_node for i in chosen} in ({0}, {1})
        chosen = node.preferred("nvidia.com/gpu", ids, 2, must=[ids[5]])
        assert ids[5] in chosen
        assert {snapshot.devices[i].numa_node for i in chosen} == {1}


def test_preferred_allocation_picks_nvlink_pairs(tmp_path: Path) -> None:
    with running_node(tmp_path, "mixed-gpu-npu") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        snapshot = node.agent.state.snapshot()
        ids = list(snapshot.resources["nvidia.com/gpu"].device_ids)
        chosen = node.preferred("nvidia.com/gpu", [ids[1], ids[2], ids[3]], 2)
        assert sorted(chosen) == sorted([ids[2], ids[3]])  # the NVLink pair (2, 3)


def test_preferred_allocation_survives_unknown_and_unhealthy_devices(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.kubelet.wait_registered({"nvidia.com/gpu"})
        ids = list(node.agent.state.snapshot().resources["nvidia.com/gpu"].device_ids)
        (node.tree / "dev/nvidia0").unlink()
        with node.kubelet.plugin("nvidia.com/gpu") as stub:
            watch = Watch(stub)
            watch.until(lambda u: _health(u, ids[0]) == "Unhealthy")
            watch.cancel()
        chosen = node.preferred("nvidia.com/gpu", ["GPU-fell-off-the-bus", *ids], 3)
        assert len(chosen) == 3
        assert ids[0] not in chosen


def _fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


def test_kubelet_restarts_re_register_without_leaks(tmp_path: Path) -> None:
    with running_node(tmp_path, "mixed-gpu-npu") as node:
        resources = node.resources
        node.kubelet.wait_registered(resources)
        seen = len(node.kubelet.registrations)
        node.kubelet.restart()  # warm up grpc's own lazily created threads
        node.kubelet.wait_registered(resources, after=seen)
        threads, fds = threading.active_count(), _fds()
        slowest = 0.0
        for _ in range(100):
            seen = len(node.kubelet.registrations)
            node.kubelet.restart()
            slowest = max(slowest, node.kubelet.wait_registered(resources, after=seen))
        sockets = sorted(p.name for p in node.kubelet.directory.iterdir())
        assert len(sockets) == len(resources) + 1
        assert "kubelet.sock" in sockets
        assert slowest <= 1.0, f"slowest re-registration took {slowest:.2f}s"
        assert threading.active_count() <= threads + 2
        assert _fds() <= fds + 8
        assert node.agent.plugins.counters.server_restarts >= 100 * len(resources)


def test_a_kubelet_restart_is_acted_on_when_its_socket_appears_not_at_the_next_tick(
    tmp_path: Path,
) -> None:
    """With a tick far longer than the test may wait, only the watch on kubelet's directory can
    bring the re-registration in time."""
    ticks = {"tick_seconds": 120.0, "watched_tick_seconds": 120.0}
    with running_node(tmp_path, "dgx-h100", agent_args=ticks) as node:
        node.kubelet.wait_registered(node.resources)
        for _ in range(3):
            seen = len(node.kubelet.registrations)
            node.kubelet.restart()
            node.kubelet.wait_registered(node.resources, after=seen, timeout=20)


def test_registration_retries_until_kubelet_appears(tmp_path: Path) -> None:
    with running_node(tmp_path, "kunlun-p800x8") as node:
        node.kubelet.wait_registered(node.resources)
        node.kubelet.stop()  # kubelet away: its socket is gone
        for path in node.kubelet.directory.glob("*.sock"):
            path.unlink()
        seen = len(node.kubelet.registrations)
        node.kubelet.start()
        node.kubelet.wait_registered(node.resources, after=seen)


def test_run_command_serves_until_sigterm(tmp_path: Path) -> None:
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edl_agent.cli",
            "run",
            "--simulate",
            "dgx-h100",
            "--kubelet-dir",
            str(kubelet.directory),
            "--log-format",
            "json",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=60)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=20)
    finally:
        if agent.poll() is None:
            agent.kill()
        kubelet.stop()
    assert agent.returncode == 0, err
    assert "Traceback" not in err
    assert "nvidia.com/gpu  8" in out
    assert '"event": "registered with kubelet"' in err
    # Our sockets are gone; the one-agent-per-node lock file stays for the next agent.
    assert [p.name for p in kubelet.directory.iterdir()] == [LOCK_NAME]


def test_socket_paths_fit_a_unix_socket() -> None:
    from edl_agent.plugin.server import MAX_SOCKET_PATH, socket_path

    short = socket_path(Path("/var/lib/kubelet/device-plugins"), "nvidia.com/gpu")
    assert short.name == "edl-nvidia.com_gpu.sock"
    deep = Path("/x" * 30)
    long_one = socket_path(deep, "baidu.com/v100_32g_cgpu_memory")
    other = socket_path(deep, "baidu.com/v100_32g_cgpu_core")
    assert len(str(long_one)) <= MAX_SOCKET_PATH
    assert long_one != other
    assert long_one == socket_path(deep, "baidu.com/v100_32g_cgpu_memory")


class EndingCall:
    """A call context that ends right after the stream's first look at it: the wake-up of its
    end comes before the stream waits, which must not make the stream wait for anything else."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.active = True

    def add_callback(self, callback: Any) -> bool:
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        active = self.active
        if active:
            self.active = False
            for callback in self.callbacks:
                callback()
        return active


def test_a_stream_whose_call_ends_before_it_waits_ends_at_once(tmp_path: Path) -> None:
    from edl_agent.devices.discovery import discover_node
    from edl_agent.devices.hostroot import HostRoot
    from edl_agent.health.state import DeviceState
    from edl_agent.plugin.service import DevicePluginService

    build_tree(load_profile("dgx-h100"), tmp_path)
    settings = load_settings(overrides={"host_root": str(tmp_path)})
    state = DeviceState(discover_node(settings))
    service = DevicePluginService(
        resource="nvidia.com/gpu", state=state, settings=settings.plugin, root=HostRoot.at(tmp_path)
    )
    sent: list[api_pb2.ListAndWatchResponse] = []
    stream = threading.Thread(
        target=lambda: sent.extend(service.ListAndWatch(api_pb2.Empty(), EndingCall()))  # type: ignore[arg-type]
    )
    stream.start()
    stream.join(timeout=3)  # nothing changes: only the call's end can end it
    ended = not stream.is_alive()
    service.stop()
    stream.join(timeout=10)
    assert ended
    assert len(sent) == 1
