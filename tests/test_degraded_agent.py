"""Degraded GPUs end to end on a simulated node: readings and warning XIDs through the real
pynvml and the fake NVML library reach kubelet's ListAndWatch (no new allocation), the node
condition, the metrics and the restarter's fault outbox; evidence brings the GPUs back."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edl_agent.devices.model import Vendor
from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.faults.outbox import Outbox
from edl_agent.health.model import Level
from edl_agent.health.nvml_wear import CLOCKS_THROTTLED, PCIE_DOWNGRADED, ROWS_PENDING
from edl_agent.labels.condition import DEGRADED_REASON, accelerator_health
from edl_agent.metrics.collectors import EdlCollector, build_registry
from edl_agent.sim import ascend_tree, inject
from tests import waiting
from tests.podresources_standin import PodResourcesStandIn
from tests.test_agent_faults import (
    agent_with_faults,
    pod_resources,  # noqa: F401 - a fixture
    running_with_faults,
)
from tests.test_health_agent import gpu_ids, health_of, watch_gpus
from tests.test_plugin import Node, running_node

wait_until = functools.partial(waiting.wait_until, timeout=20.0)
FAST = {
    "health": {"degraded": {"poll_seconds": 0.05, "throttle_seconds": 0.2, "pcie_seconds": 0.2}}
}


def degraded_reasons(node: Node, device_id: str) -> str | None:
    condition = node.agent.hub.degraded().get(device_id)
    return None if condition is None else condition.reason


def test_rows_pending_degrade_a_gpu_until_a_reset_applies_them(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100", extra=FAST) as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.set_remapped_rows(node.tree, 2, pending=1)
        update = watch.until(lambda u: health_of(u)[ids[2]] == "Unhealthy")
        assert [i for i, h in health_of(update).items() if h != "Healthy"] == [ids[2]]
        assert degraded_reasons(node, ids[2]) == ROWS_PENDING
        assert node.agent.unhealthy() == {}  # not a fault: the pod on it keeps running
        health = accelerator_health(
            inventory=node.agent.state.snapshot().inventory,
            unhealthy=node.agent.unhealthy(),
            degraded=node.agent.hub.degraded(),
        )
        assert (health.status, health.reason) == ("True", DEGRADED_REASON)
        assert f"1 degraded: nvidia 2 ({ids[2]}) ROWS_PENDING" in health.message

        inject.reset_device(node.tree, "nvidia", 2)
        watch.until(lambda u: health_of(u)[ids[2]] == "Healthy")
        assert node.agent.hub.degraded() == {}
        watch.cancel()


def test_throttling_and_a_narrow_link_degrade_after_they_held(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100", extra=FAST) as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.set_clock_event_reasons(node.tree, 1, 0x40)
        inject.set_pcie_link(node.tree, 4, width=8)
        watch.until(lambda u: {health_of(u)[ids[1]], health_of(u)[ids[4]]} == {"Unhealthy"})
        assert degraded_reasons(node, ids[1]) == CLOCKS_THROTTLED
        assert node.agent.hub.degraded()[ids[1]].detail == "clocks held down by hw_thermal"
        assert degraded_reasons(node, ids[4]) == PCIE_DOWNGRADED

        samples = scrape(node)
        assert samples[("edl_device_degraded", ids[1])] == 1.0
        assert samples[("edl_device_degraded", ids[0])] == 0.0

        inject.set_clock_event_reasons(node.tree, 1, 0x1)
        watch.until(lambda u: health_of(u)[ids[1]] == "Healthy")
        assert set(node.agent.hub.degraded()) == {ids[4]}
        watch.cancel()


def test_a_contained_error_degrades_and_a_fatal_one_takes_the_gpu(tmp_path: Path) -> None:
    with running_node(tmp_path, "dgx-h100", extra=FAST) as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_xid(node.tree, 6, 94)
        watch.until(lambda u: health_of(u)[ids[6]] == "Unhealthy")
        assert degraded_reasons(node, ids[6]) == "XID94"
        inject.inject_xid(node.tree, 6, 79)
        wait_until(lambda: ids[6] in node.agent.unhealthy())
        assert node.agent.hub.degraded() == {}
        watch.cancel()


def test_the_reader_is_off_when_asked(tmp_path: Path) -> None:
    off = {"health": {"degraded": {"enabled": False}}}
    with running_node(tmp_path, "dgx-h100", extra=off) as node:
        watch_gpus(node).cancel()
        assert node.agent.health.wear is None


def scrape(node: Node) -> dict[tuple[str, str], float]:
    text = generate_latest(build_registry(EdlCollector(snapshot=node.agent.state.snapshot)))
    return {
        (sample.name, sample.labels.get("device_id", "")): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_a_held_gpu_turning_degraded_then_unhealthy_is_two_faults(
    tmp_path: Path,
    pod_resources: PodResourcesStandIn,  # noqa: F811 - the fixture imported above
) -> None:
    agent = agent_with_faults(tmp_path, pod_resources)
    gpus = {d.index: d for d in agent.state.snapshot().inventory.devices}
    pod_resources.assign({("ml", "trainer-x"): {"main": {"nvidia.com/gpu": [gpus[3].id]}}})
    with running_with_faults(agent) as outbox:
        inject.inject_xid(tmp_path / "node", 3, 94)
        wait_until(lambda: len(outbox) == 1)
        inject.inject_xid(tmp_path / "node", 3, 95)
        wait_until(lambda: len(outbox) == 2)
        faults = sorted(outbox.pending(), key=lambda f: f.kind)
    degraded, unhealthy = faults
    assert (degraded.kind, degraded.reason) == (FaultKind.DEVICE_DEGRADED, "XID94")
    assert (unhealthy.kind, unhealthy.reason) == (FaultKind.DEVICE_UNHEALTHY, "XID95")
    assert degraded.pods == unhealthy.pods == (PodRef("ml", "trainer-x"),)
    assert degraded.id.startswith("degraded/")
    assert unhealthy.id.startswith("device/")
    reopened = Outbox(tmp_path / "state" / "outbox")  # both outlive the agent
    try:
        assert {f.id for f in reopened.pending()} == {degraded.id, unhealthy.id}
    finally:
        reopened.close()


def test_shadow_mode_reports_health_and_withdraws_nothing(tmp_path: Path) -> None:
    shadow = {"health": {"shadow": True, "degraded": FAST["health"]["degraded"]}}
    with running_node(tmp_path, "dgx-h100", extra=shadow) as node:
        ids = gpu_ids(node)
        watch_gpus(node).cancel()
        inject.inject_xid(node.tree, 3, 79)
        inject.set_remapped_rows(node.tree, 5, pending=1)
        wait_until(lambda: ids[3] in node.agent.unhealthy())
        wait_until(lambda: ids[5] in node.agent.hub.degraded())
        listed = node.device_list("nvidia.com/gpu")
        assert {d.health for d in listed.devices} == {"Healthy"}  # kubelet still places pods
        samples = scrape(node)
        assert samples[("edl_device_healthy", ids[3])] == 0.0  # but the truth is reported
        assert samples[("edl_device_degraded", ids[5])] == 1.0


@pytest.mark.parametrize(
    ("code", "clears"),
    [
        ("0x80818C06", "while reported"),  # SubHealthFault: over when the driver stops it
        ("0x8118043C", "release"),  # PreSeparateNPU: isolated once its job left, until released
    ],
)
def test_an_ascend_warning_level_degrades_the_chip(tmp_path: Path, code: str, clears: str) -> None:
    with running_node(tmp_path, "ascend-910bx8") as node:
        resource = "huawei.com/Ascend910"
        node.kubelet.wait_registered({resource})
        units = node.agent.state.snapshot().resources[resource].units
        chip = units[2].device_id
        watch = node.kubelet.watch(resource)
        watch.next()
        ascend_tree.set_npu_health(node.tree, 2, "Warning", fault_codes=(code,))
        watch.until(lambda u: health_of(u)[units[2].id] == "Unhealthy", timeout=10)
        assert node.agent.hub.degraded()[chip].reason == f"NPU_FAULT_0x{code[2:].upper()}"
        assert node.agent.unhealthy() == {}
        # What Volcano's device info lists it by (kept from new work, at its own level).
        assert node.agent.hub.withdrawing()[chip].level is Level.DEGRADED
        ascend_tree.set_npu_health(node.tree, 2, "OK")
        if clears == "release":
            polls = node.agent.health.polls
            for _ in range(2):  # two whole polls read the chip OK
                last = polls.telemetry.get(Vendor.ASCEND)
                wait_until(lambda last=last: polls.telemetry.get(Vendor.ASCEND) is not last)
            assert chip in node.agent.hub.degraded()  # PreSeparateNPU waits for a release
            node.agent.hub.release({chip})
        watch.until(lambda u: health_of(u)[units[2].id] == "Healthy", timeout=10)
        watch.cancel()


def test_corrected_errors_climbing_degrade_a_gpu(tmp_path: Path) -> None:
    rate = {"health": {"degraded": {"poll_seconds": 0.05, "ecc_corrected_errors": 5}}}
    with running_node(tmp_path, "dgx-h100", extra=rate) as node:
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_ecc_sbe(node.tree, 7, count=4)  # below the threshold
        wait_until(lambda: node.agent.health.wear is not None and node.agent.health.wear.rounds > 2)
        rounds = node.agent.health.wear.rounds
        wait_until(lambda: node.agent.health.wear.rounds > rounds + 2)
        assert node.agent.hub.degraded() == {}
        inject.inject_ecc_sbe(node.tree, 7)  # the fifth within the window
        watch.until(lambda u: health_of(u)[ids[7]] == "Unhealthy")
        assert degraded_reasons(node, ids[7]) == "ECC_SBE_RATE"
        watch.cancel()
