"""A node where discovery finds no accelerator: the condition says so, and why it may be (pure,
table tests), from the host's facts as discovery gathers them (a tree on disk)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from edl_agent.config import load_settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.host_facts import host_facts
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, HostFacts, Inventory, Vendor, VendorReport
from edl_agent.health.model import Level
from edl_agent.health.tracker import Condition
from edl_agent.labels.condition import (
    NO_DEVICES_REASON,
    accelerator_health,
    node_condition,
)
from edl_agent.sim.commands import build_tree

ROOT = "/host"
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def facts(
    *,
    missing: tuple[str, ...] = (),
    disabled: tuple[Vendor, ...] = (),
    pci: dict[Vendor, int] | None = None,
) -> HostFacts:
    return HostFacts(host_root=ROOT, missing=missing, disabled=disabled, pci=pci or {})


def empty(host: HostFacts | None, *reports: VendorReport) -> Inventory:
    return Inventory(node="n1", reports=reports, resources=(), host=host)


@pytest.mark.parametrize(
    ("inventory", "says", "never"),
    [
        (
            empty(facts(missing=("/dev", "/sys"))),
            ["no accelerators found under /host", "/dev and /sys missing under /host", "mounted"],
            ["PCI shows"],
        ),
        (
            empty(facts(pci={Vendor.NVIDIA: 8})),
            ["PCI shows 8 nvidia accelerators but none was discovered", "driver", "runtime"],
            ["disabled"],
        ),
        (
            empty(facts(pci={Vendor.ASCEND: 4}, disabled=(Vendor.ASCEND,))),
            ["PCI shows 4 ascend accelerators, but ascend is disabled", "ascend.enabled"],
            ["none was discovered"],
        ),
        (
            empty(facts(), VendorReport(Vendor.NVIDIA, error="NVML initialisation failed: x")),
            ["nvidia discovery failed: NVML initialisation failed: x"],
            ["no accelerator on the PCI bus"],
        ),
        (
            empty(facts(), VendorReport(Vendor.NVIDIA)),
            ["nvidia's driver library or tool answered with no device"],
            ["no accelerator on the PCI bus"],
        ),
        (
            empty(facts(disabled=(Vendor.HYGON, Vendor.KUNLUNXIN))),
            [
                "no accelerator on the PCI bus and no driver library or vendor tool found",
                "(hygon, kunlunxin disabled in the settings)",
                "a node without accelerators",
                "container runtime",
            ],
            ["PCI shows"],
        ),
        (
            empty(None),
            ["no accelerators found under the host root", "a node without accelerators"],
            [],
        ),
    ],
)
def test_no_accelerators_is_unknown_and_says_why(
    inventory: Inventory, says: list[str], never: list[str]
) -> None:
    health = accelerator_health(inventory=inventory, unhealthy={})
    assert (health.status, health.reason) == ("Unknown", NO_DEVICES_REASON)
    for words in says:
        assert words in health.message
    for words in never:
        assert words not in health.message
    assert "healthy" not in health.message


def test_a_node_without_accelerators_is_never_reported_unhealthy() -> None:
    """False is what readers act on (`edl-agent hosts`): a CPU node must not read as broken."""
    condition = node_condition(
        accelerator_health(inventory=empty(facts()), unhealthy={}), previous=None, now=NOW
    )
    assert condition["status"] == "Unknown"
    assert condition["reason"] == "NoAcceleratorsFound"


def test_devices_that_vanished_with_a_fault_still_read_as_faults() -> None:
    """Faults on devices discovery no longer lists keep the node False, not 'none found'."""
    lost = Condition("GPU_LOST", Level.NODE_FATAL, since=1.0, last_seen=1.0, detail="off the bus")
    health = accelerator_health(inventory=empty(facts()), unhealthy={"GPU-1": lost})
    assert (health.status, health.reason) == ("False", "GPULost")


def test_one_device_is_not_none() -> None:
    gpu = Device(Vendor.NVIDIA, "gpu", 0, "GPU-0", "H100", 81920)
    inventory = empty(facts(), VendorReport(Vendor.NVIDIA, devices=(gpu,)))
    health = accelerator_health(inventory=inventory, unhealthy={})
    assert (health.status, health.message) == ("True", "all 1 accelerators healthy")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_host_facts_count_accelerator_classes_only(tmp_path: Path) -> None:
    pci = tmp_path / "sys/bus/pci/devices"
    for name, vendor, klass in [
        ("0000:18:00.0", "0x10de", "0x030200"),  # H100: 3D controller
        ("0000:19:00.0", "0x10de", "0x040300"),  # its audio function: not an accelerator
        ("0000:1a:00.0", "0x19e5", "0x120000"),  # Ascend NPU
        ("0000:1b:00.0", "0x19e5", "0x020000"),  # Huawei network card
        ("0000:1e:00.0", "0x19e5", "0x030000"),  # Huawei iBMC graphics
        ("0000:1c:00.0", "0x1d94", "0x038000"),  # Hygon DCU
        ("0000:1d:00.0", "0x8086", "0x030000"),  # someone else's graphics
    ]:
        write(pci / name / "vendor", vendor + "\n")
        write(pci / name / "class", klass + "\n")
    got = host_facts(HostRoot.at(tmp_path), disabled=[Vendor.KUNLUNXIN])
    assert got.pci == {Vendor.NVIDIA: 1, Vendor.ASCEND: 1, Vendor.HYGON: 1}
    assert got.missing == ("/dev",)
    assert got.disabled == (Vendor.KUNLUNXIN,)
    assert got.host_root == str(tmp_path.resolve())


def test_discovery_on_an_empty_root_says_it_is_not_mounted(tmp_path: Path) -> None:
    settings = load_settings(file=None, environ={}, overrides={"host_root": str(tmp_path)})
    inventory = discover_node(settings, environ={"NODE_NAME": "n1"})
    health = accelerator_health(inventory=inventory, unhealthy={})
    assert health.reason == NO_DEVICES_REASON
    assert f"/dev and /sys missing under {tmp_path.resolve()}" in health.message


def test_a_disabled_vendor_on_a_simulated_node_is_named(tmp_path: Path) -> None:
    build_tree("dgx-h100", tmp_path)
    settings = load_settings(
        file=None,
        environ={},
        overrides={"host_root": str(tmp_path), "nvidia": {"enabled": False}},
    )
    inventory = discover_node(settings, environ={"NODE_NAME": "n1"})
    health = accelerator_health(inventory=inventory, unhealthy={})
    assert health.status == "Unknown"
    assert "PCI shows 8 nvidia accelerators, but nvidia is disabled" in health.message
