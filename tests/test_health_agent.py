"""The agent's health stream end to end: faults injected into simulated nodes reach kubelet's
ListAndWatch through the real NVML event path (fake library, real pynvml) and vendor polls."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2
from edl_agent.sim import ascend_tree, inject
from tests.kubelet_standin import Watch
from tests.test_plugin import Node, running_node


def health_of(update: api_pb2.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in update.devices}


def gpu_ids(node: Node) -> list[str]:
    return list(node.agent.state.snapshot().resources["nvidia.com/gpu"].device_ids)


def wait_for(predicate: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not (callable(predicate) and predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def watch_gpus(node: Node) -> Watch:
    node.kubelet.wait_registered({"nvidia.com/gpu"})
    wait_for(lambda: node.agent.ready()[0])
    watch = node.kubelet.watch("nvidia.com/gpu")
    watch.next()
    return watch


def test_xid_79_makes_the_gpu_unhealthy_at_once(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_xid(node.tree, 3, 79)
        update = watch.until(lambda u: health_of(u)[ids[3]] == "Unhealthy")
        assert [i for i, h in health_of(update).items() if h != "Healthy"] == [ids[3]]
        assert node.agent.unhealthy()[ids[3]].reason == "XID79"
        watch.cancel()


def test_xid_13_is_counted_and_changes_nothing(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        ids = gpu_ids(node)
        watch_gpus(node).cancel()
        inject.inject_xid(node.tree, 2, 13)
        inject.inject_xid(node.tree, 2, 13)
        wait_for(lambda: node.agent.tracker.counts.xid_errors[(ids[2], 13)] == 2)
        assert node.agent.unhealthy() == {}
        assert {node.device_list("nvidia.com/gpu").devices[i].health for i in range(8)} == {
            "Healthy"
        }


def test_double_bit_ecc_makes_the_gpu_unhealthy(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_ecc_dbe(node.tree, 5)
        watch.until(lambda u: health_of(u)[ids[5]] == "Unhealthy")
        watch.cancel()


def test_transient_fault_recovers_after_the_quiet_period(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.agent.tracker.quiet_seconds = 1.0
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_xid(node.tree, 1, 48)
        watch.until(lambda u: health_of(u)[ids[1]] == "Unhealthy")
        went_bad = time.monotonic()
        watch.until(lambda u: health_of(u)[ids[1]] == "Healthy", timeout=10)
        assert time.monotonic() - went_bad >= 0.9
        watch.cancel()


def test_lost_gpu_stays_unhealthy_until_rediscovery_finds_it(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100") as node:
        node.agent.tracker.quiet_seconds = 0.2
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_lost(node.tree, 6)
        watch.until(lambda u: health_of(u)[ids[6]] == "Unhealthy")
        time.sleep(0.5)
        assert node.agent.unhealthy()[ids[6]].level.value == "node_fatal"
        # Re-discovery cannot read a lost GPU; it stays advertised, Unhealthy, not dropped.
        before = node.agent.state.snapshot().version
        node.agent._rediscovery.due = 0
        wait_for(lambda: node.agent._rediscovery.due > 0)
        time.sleep(0.3)
        assert node.agent.state.snapshot().version >= before
        listed = health_of(node.device_list("nvidia.com/gpu"))
        assert len(listed) == 8
        assert listed[ids[6]] == "Unhealthy"
        inject.inject_recover(node.tree, 6)
        node.agent._rediscovery.due = 0  # ask for the periodic re-discovery now
        watch.until(lambda u: health_of(u)[ids[6]] == "Healthy", timeout=10)
        watch.cancel()


def test_nvml_failure_marks_every_gpu_unhealthy_and_not_ready(tmp_path: Path) -> None:
    with running_node(tmp_path, "mixed-gpu-npu") as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)  # the NVML watcher runs once the agent is ready
        assert node.agent.nvml is not None
        node.agent.nvml.retry_seconds = 0.2
        assert node.agent.ready() == (True, "ok")
        inject.set_nvml_init_failure(node.tree, on=True)
        update = watch.until(lambda u: set(health_of(u).values()) == {"Unhealthy"})
        assert set(health_of(update)) == set(ids)
        ready, why = node.agent.ready()
        assert not ready
        assert "NVML" in why
        npus = node.agent.state.snapshot().resources["huawei.com/Ascend910"].units
        assert not any(node.agent.state.snapshot().is_unhealthy(u.device_id) for u in npus)
        inject.set_nvml_init_failure(node.tree, on=False)
        watch.until(lambda u: set(health_of(u).values()) == {"Healthy"}, timeout=10)
        wait_for(lambda: node.agent.ready()[0])
        watch.cancel()


@pytest.mark.parametrize("code", ["Critical", "0x80E18402"])
def test_npu_health_code_makes_that_npu_unhealthy(tmp_path: Path, code: str) -> None:
    with running_node(tmp_path, "ascend-910bx8") as node:
        resource = "huawei.com/Ascend910"
        node.kubelet.wait_registered({resource})
        units = node.agent.state.snapshot().resources[resource].units
        watch = node.kubelet.watch(resource)
        watch.next()
        if code.startswith("0x"):
            ascend_tree.set_npu_health(node.tree, 2, "Critical", fault_codes=(code,))
        else:
            ascend_tree.set_npu_health(node.tree, 2, code)
        update = watch.until(lambda u: health_of(u)[units[2].id] == "Unhealthy", timeout=10)
        assert [i for i, h in health_of(update).items() if h != "Healthy"] == [units[2].id]
        watch.cancel()
