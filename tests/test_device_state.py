"""The device state the plugin servers read: health and DRA-held devices, kept apart."""

from __future__ import annotations

from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.health.state import DeviceState


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


def test_a_device_goes_to_the_device_plugin_or_to_a_claim_never_both() -> None:
    state = DeviceState(_inventory())
    assert state.hand_out({"GPU-1"}, now=100.0) == frozenset()
    # kubelet has not listed it on pod-resources yet: the hand-out itself is the record
    assert state.reserve_for_claim("GPU-1", (), since=90.0) == "held by a device-plugin pod"
    assert state.reserve_for_claim("MIG-0", {"GPU-0"}, since=90.0) == "held by a device-plugin pod"
    assert state.reserve_for_claim("MIG-0", (), since=90.0) is None
    assert state.snapshot().withheld == {"MIG-0"}
    assert state.hand_out({"GPU-0"}, now=101.0) == {"GPU-0"}  # its partition is claimed
    # a refused hand-out records nothing: the GPU can still go to a claim
    assert state.reserve_for_claim("GPU-0", (), since=90.0) is None


def test_a_hand_out_older_than_the_window_no_longer_blocks_a_claim() -> None:
    state = DeviceState(_inventory())
    state.hand_out({"GPU-1"}, now=100.0)
    assert state.reserve_for_claim("GPU-1", (), since=160.0) is None
