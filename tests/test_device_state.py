"""The device state the plugin servers read: health and DRA-held devices, kept apart."""

from __future__ import annotations

from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.plugin.state import DeviceState


def _inventory() -> Inventory:
    gpu0 = Device(Vendor.NVIDIA, "gpu", 0, "GPU-0", "A100", 81920)
    mig = Device(Vendor.NVIDIA, "mig", 0, "MIG-0", "A100 MIG 3g.40gb", 40192, parent="GPU-0")
    gpu1 = Device(Vendor.NVIDIA, "gpu", 1, "GPU-1", "A100", 81920)
    return Inventory("n", (VendorReport(Vendor.NVIDIA, (gpu0, mig, gpu1)),), ())


def test_a_claimed_partition_makes_its_gpu_unavailable_but_not_unhealthy() -> None:
    state = DeviceState(_inventory())
    assert state.set_withheld({"MIG-0"})
    snapshot = state.snapshot()
    assert snapshot.unavailable == {"MIG-0", "GPU-0"}
    assert snapshot.unhealthy_all == frozenset()
    assert not state.set_withheld({"MIG-0"})  # no change, no new version


def test_a_claimed_gpu_takes_its_partitions_and_health_still_counts() -> None:
    state = DeviceState(_inventory())
    state.set_withheld({"GPU-0"})
    state.set_unhealthy({"GPU-1"})
    snapshot = state.snapshot()
    assert snapshot.unavailable == {"GPU-0", "MIG-0", "GPU-1"}
    assert snapshot.unhealthy_all == {"GPU-1"}
    state.set_withheld(set())
    assert state.snapshot().unavailable == {"GPU-1"}


def test_recent_device_plugin_handouts_are_remembered_until_they_age_out() -> None:
    state = DeviceState(_inventory())
    state.note_allocated({"GPU-0"}, now=100.0)
    state.note_allocated({"GPU-1"}, now=130.0)
    assert state.allocated_since(90.0) == {"GPU-0", "GPU-1"}
    assert state.allocated_since(120.0) == {"GPU-1"}
    assert state.allocated_since(90.0) == {"GPU-1"}  # the aged record is gone for good
