"""The agent serving a vendor through DRA (`serve: dra` / `both`) on a simulated node, without an
API server: its plugin socket in the registry directory, the CDI specs, the health stream from
the agent's one health model, and the device plugin's view of claimed devices after a restart."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from edl_agent._proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from edl_agent._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from edl_agent._proto.pluginregistration.v1 import api_pb2 as registration_pb2
from edl_agent._proto.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from edl_agent.agent import Agent
from edl_agent.config import load_settings
from edl_agent.devices import names
from edl_agent.dra.checkpoint import PreparedClaim, PreparedClaims, PreparedDevice
from edl_agent.dra.node import DEVICE_PLUGIN_TAINT, _with_taint
from edl_agent.sim import inject
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.kubelet_standin import KubeletStandIn

DRIVER = "gpu.nvidia.edl.io"


@contextlib.contextmanager
def dra_node(tmp_path: Path, serve: str, **extra: Any) -> Iterator[Agent]:
    profile = load_profile("dgx-h100")
    tree = tmp_path / "node"
    if not tree.exists():
        build_tree(profile, tree)
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    settings = load_settings(
        defaults=profile.config,
        overrides={
            "host_root": str(tree),
            "metrics_addr": "",
            "nvidia": {"serve": serve},
            "plugin": {
                "kubelet_dir": str(kubelet.directory),
                "health_poll_seconds": 0.1,
                **extra.pop("plugin", {}),
            },
            "faults": {"state_dir": str(tmp_path / "state")},
            "dra": {
                "plugins_registry_dir": str(tmp_path / "registry"),
                "cdi_dir": str(tmp_path / "cdi"),
            },
            **extra,
        },
    )
    agent = Agent.discover(settings)
    agent.start_dra(None)
    thread = threading.Thread(target=agent.run, name="agent")
    thread.start()
    try:
        yield agent
    finally:
        agent.stop.set()
        thread.join(timeout=10)
        kubelet.stop()
    assert not thread.is_alive()
    assert not (tmp_path / "registry" / f"{DRIVER}.sock").exists()  # removed at stop


def test_a_dra_vendor_registers_writes_cdi_and_streams_health_from_the_agent(
    tmp_path: Path,
) -> None:
    with dra_node(tmp_path, "dra") as agent:
        assert agent.state.snapshot().resources == {}  # nothing for the device plugin
        socket = tmp_path / "registry" / f"{DRIVER}.sock"
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            info = registration_grpc.RegistrationStub(channel).GetInfo(  # type: ignore[no-untyped-call]
                registration_pb2.InfoRequest(), timeout=5
            )
            assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, "")
            assert list(info.supported_versions) == ["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(  # type: ignore[no-untyped-call]
                health_pb2.NodeWatchResourcesRequest(), timeout=20
            )
            first = next(stream)
            assert {d.device.device_name for d in first.devices} == {f"gpu-{i}" for i in range(8)}
            assert {d.health for d in first.devices} == {health_pb2.HEALTHY}
            inject.inject_xid(Path(agent.settings.host_root), 3, 79)
            for update in stream:
                sick = [d for d in update.devices if d.health == health_pb2.UNHEALTHY]
                if sick:
                    break
            assert [(d.device.device_name, d.device.pool_name) for d in sick] == [
                ("gpu-3", agent.state.snapshot().inventory.node)
            ]
            assert "XID79" in sick[0].message
            stream.cancel()
        spec = (tmp_path / "cdi" / "edl.io-nvidia.json").read_text()
        assert '"kind": "nvidia.edl.io/gpu"' in spec


def test_claims_prepared_before_a_restart_are_withheld_from_the_device_plugin(
    tmp_path: Path,
) -> None:
    """Served both ways: a claim the checkpoint holds keeps its GPU off the device plugin from
    the first moment of a new agent, before kubelet asks anything."""
    with dra_node(tmp_path, "both") as agent:
        node = agent.state.snapshot().inventory.node
        gpu5 = next(d for d in agent.state.snapshot().inventory.devices if d.index == 5)
        assert agent.state.snapshot().withheld == frozenset()
    PreparedClaims(tmp_path / "state").put(
        PreparedClaim(
            uid="uid-1",
            namespace="team",
            name="train",
            driver=DRIVER,
            devices=(
                PreparedDevice(
                    requests=("gpus",),
                    pool=node,
                    device="gpu-5",
                    cdi_ids=(names.cdi_id(gpu5.vendor, "gpu-5"),),
                ),
            ),
        )
    )
    with dra_node(tmp_path, "both") as agent:
        snapshot = agent.state.snapshot()
        assert snapshot.withheld == {gpu5.id}
        # no plugin watcher here to accept the plugin; the claim counts from the checkpoint
        assert agent.agent_counts().dra_plugins == {DRIVER: (False, 1)}
        assert set(snapshot.resources["nvidia.com/gpu"].device_ids) >= {gpu5.id}


def test_devices_the_device_plugin_holds_are_tainted_for_the_scheduler() -> None:
    desired = {
        DRIVER: [
            {"devices": [{"name": "gpu-0"}, {"name": "gpu-1", "taints": [{"key": "x"}]}]},
            {"sharedCounters": [{"name": "gpu-0"}]},
        ]
    }
    tainted = _with_taint(desired, {"gpu-1"})
    devices = tainted[DRIVER][0]["devices"]
    assert "taints" not in devices[0]
    assert [t["key"] for t in devices[1]["taints"]] == ["x", DEVICE_PLUGIN_TAINT]
    assert tainted[DRIVER][1] == desired[DRIVER][1]
    assert desired[DRIVER][0]["devices"][1]["taints"] == [{"key": "x"}]  # not changed in place


def test_with_plugin_cdi_only_the_specs_are_written_and_no_plugin_serves(tmp_path: Path) -> None:
    with dra_node(tmp_path, "device-plugin", plugin={"cdi": True}) as agent:
        assert agent.dra is not None
        assert agent.dra.servers == {}
        assert set(agent.state.snapshot().resources) == {"nvidia.com/gpu"}
        spec = tmp_path / "cdi" / "edl.io-nvidia.json"
        assert '"name": "gpu-7"' in spec.read_text()
        assert not (tmp_path / "registry").exists()
