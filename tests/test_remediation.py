"""Remediation: the pure choice of which idle device to reset, and the agent resetting simulated
GPUs through the fake `nvidia-smi` with kubelet's pod-resources answered by a stand-in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from edl_agent.devices.model import Device, Vendor
from edl_agent.health.remediation_rules import (
    Attempt,
    History,
    choose,
    command_for,
    held_ids,
    record,
)
from edl_agent.health_settings import RemediationSettings
from edl_agent.sim import inject
from tests.podresources_standin import PodResourcesStandIn
from tests.test_health_agent import gpu_ids, health_of, watch_gpus
from tests.test_plugin import Node, running_node
from tests.waiting import wait_until

GPUS = [Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", "H100", 81559) for i in range(4)]
MIG = Device(Vendor.NVIDIA, "mig", 0, "MIG-0", "H100 1g", 9000, parent="GPU-1")
NPU = Device(Vendor.ASCEND, "npu", 0, "npu-0", "Ascend910B3", 65536)
# The second die of an A3 NPU: npu-smi names it by NPU id and chip id, not by /dev/davinci index.
A3_DIE = Device(
    Vendor.ASCEND,
    "npu-3",
    3,
    "npu-3",
    "Ascend910",
    65536,
    attributes={"npu_id": "1", "chip_id": "1"},
)
ON = RemediationSettings(enabled=True, max_per_hour=2, max_attempts=2)


@pytest.mark.parametrize(
    ("waiting", "held", "history", "settings", "chosen"),
    [
        (GPUS[:2], set(), History(), ON, "GPU-0"),
        (GPUS[:2], {"GPU-0"}, History(), ON, "GPU-1"),
        (GPUS[:2], {"GPU-0", "GPU-1"}, History(), ON, None),
        (GPUS[:2], set(), History(), RemediationSettings(), None),  # off by default
        (GPUS[:2], set(), History(failures={"GPU-0": 2}), ON, "GPU-1"),  # attempts used up
        (
            GPUS[:2],
            set(),
            History((Attempt("GPU-2", 10, ok=True), Attempt("GPU-3", 20, ok=False))),
            ON,
            None,  # two resets in the last hour already
        ),
        (
            GPUS[:2],
            set(),
            History((Attempt("GPU-2", -4000, ok=True), Attempt("GPU-3", 20, ok=False))),
            ON,
            "GPU-0",  # one of them more than an hour ago
        ),
        ([NPU], set(), History(), RemediationSettings(enabled=True, commands={}), None),
    ],
)
def test_choose(
    waiting: list[Device],
    held: set[str],
    history: History,
    settings: RemediationSettings,
    chosen: str | None,
) -> None:
    device = choose(waiting=waiting, held=held, history=history, now=100, settings=settings)
    assert (device.id if device else None) == chosen


def test_a_gpu_is_held_through_its_mig_devices() -> None:
    assert held_ids([*GPUS, MIG], {"MIG-0"}) == {"MIG-0", "GPU-1"}


def test_record_counts_failures_until_a_success() -> None:
    history = record(History(), Attempt("GPU-0", 0, ok=False), now=0)
    history = record(history, Attempt("GPU-0", 10, ok=False), now=10)
    assert history.failures == {"GPU-0": 2}
    history = record(history, Attempt("GPU-0", 4000, ok=True), now=4000)
    assert history.failures == {}
    assert [a.at for a in history.attempts] == [4000]  # older than an hour: dropped


def test_command_for_fills_in_the_index_and_the_device_attributes() -> None:
    assert command_for(GPUS[3], ON) == ["nvidia-smi", "--gpu-reset", "-i", "3"]
    assert command_for(A3_DIE, ON) == ["npu-smi", "set", "-t", "reset", "-i", "1", "-c", "1"]
    custom = RemediationSettings(commands={"ascend": ["reset-npu", "--dev={index}", "{chip_id}"]})
    assert command_for(A3_DIE, custom) == ["reset-npu", "--dev=3", "1"]


def test_a_device_lacking_what_its_command_names_is_never_chosen() -> None:
    """An NPU npu-smi did not list has no NPU id: resetting `-i {index}` would reset another."""
    assert command_for(NPU, ON) is None
    chosen = choose(waiting=[NPU, A3_DIE], held=set(), history=History(), now=0, settings=ON)
    assert chosen == A3_DIE


@contextlib.contextmanager
def remediating_node(
    tmp_path: Path, **remediation: object
) -> Iterator[tuple[Node, PodResourcesStandIn]]:
    pods = PodResourcesStandIn(tmp_path / "pod-resources.sock")
    pods.start()
    settings = {"enabled": True, "interval_seconds": 0.2, **remediation}
    extra = {
        "pod_resources_socket": str(pods.socket),
        "health": {"remediation": settings},
    }
    try:
        with running_node(tmp_path, "dgx-h100", extra=extra) as node:
            yield node, pods
    finally:
        pods.stop()


def rounds_after(node: Node, count: int) -> None:
    """Wait until the remediation part has completed `count` more rounds."""
    remediation = node.agent.health.remediation
    target = remediation.rounds + count
    wait_until(lambda: remediation.rounds >= target, 15, what=f"{count} remediation rounds")


def resets_in(tree: Path) -> list[str]:
    lines = inject.fault_file(tree).read_text().splitlines()
    return [line for line in lines if line.startswith("reset")]


def test_an_idle_gpu_is_reset_and_returns_to_service_a_held_one_never(tmp_path: Path) -> None:
    with remediating_node(tmp_path) as (node, pods):
        ids = gpu_ids(node)
        pods.assign({("train", "job-0"): {"main": {"nvidia.com/gpu": [ids[3]]}}})
        watch = watch_gpus(node)
        inject.inject_xid(node.tree, 3, 119)  # held by a pod
        inject.inject_xid(node.tree, 2, 119)  # idle
        watch.until(lambda u: health_of(u)[ids[3]] == "Unhealthy")
        watch.until(
            lambda u: health_of(u)[ids[2]] == "Healthy" and health_of(u)[ids[3]] != "Healthy",
            timeout=15,
        )
        assert resets_in(node.tree) == ["reset gpu=2"]
        rounds_after(node, 3)  # the held GPU is left alone
        assert resets_in(node.tree) == ["reset gpu=2"]
        assert node.agent.health.remediation.counts[("nvidia", "reset")] == 1
        assert node.agent.unhealthy()[ids[3]].clears_by.value == "reset"
        pods.assign({})  # its pod ended: now it is reset too
        watch.until(lambda u: set(health_of(u).values()) == {"Healthy"}, timeout=15)
        assert resets_in(node.tree) == ["reset gpu=2", "reset gpu=3"]
        watch.cancel()


def test_no_reset_while_kubelet_cannot_say_who_holds_the_gpu(tmp_path: Path) -> None:
    with remediating_node(tmp_path) as (node, pods):
        import grpc

        pods.fail_with(grpc.StatusCode.UNAVAILABLE)
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_xid(node.tree, 1, 119)
        watch.until(lambda u: health_of(u)[ids[1]] == "Unhealthy")
        rounds_after(node, 3)
        assert resets_in(node.tree) == []
        watch.cancel()


def test_failed_resets_escalate_to_an_operators_release(tmp_path: Path) -> None:
    with remediating_node(
        tmp_path, commands={"nvidia": ["no-such-reset-tool", "{index}"]}, max_attempts=2
    ) as (node, _pods):
        ids = gpu_ids(node)
        watch = watch_gpus(node)
        inject.inject_xid(node.tree, 0, 119)
        watch.until(lambda u: health_of(u)[ids[0]] == "Unhealthy")
        wait_until(lambda: node.agent.health.remediation.counts[("nvidia", "escalated")] == 1)
        assert node.agent.health.remediation.counts[("nvidia", "failed")] == 2
        assert node.agent.unhealthy()[ids[0]].clears_by.value == "release"
        rounds_after(node, 3)  # no more attempts
        assert node.agent.health.remediation.counts[("nvidia", "failed")] == 2
        watch.cancel()
