"""The README's label catalog names every label the code writes, and nothing else: the node
labels of `labels.compute.node_labels` over nodes of every vendor, MIG strategy and sharing
kind, and the restarter's leader label."""

from __future__ import annotations

import re

from edl_agent.config import Settings, load_settings
from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.labels.compute import node_labels
from edl_agent.restarter.adapters.leader import LEADER_LABEL
from tests.readme_blocks import README

VENDOR_KEY = re.compile(r"^edl\.io/(nvidia|kunlunxin|hygon|ascend)\.")
MIG_KEY = re.compile(r"^nvidia\.com/mig-.+\.(\w+)$")
A100 = "NVIDIA A100-SXM4-80GB"


def catalog() -> set[str]:
    """The keys of the README's label catalog; `.minor` after a key stands for that key with
    its last part replaced."""
    text = README.read_text(encoding="utf-8")
    section = text.split("### Label catalog", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "no label catalog in the README"
    keys: set[str] = set()
    for row in rows:
        first, *more = re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])
        keys.add(first)
        keys.update(first.rsplit(".", 1)[0] + short for short in more if short.startswith("."))
        keys.update(key for key in more if not key.startswith("."))
    return keys


def generic(key: str) -> str:
    """A key as the catalog writes it: `<vendor>` and `<profile>` for the parts that vary."""
    mig = MIG_KEY.match(key)
    if mig:
        return f"nvidia.com/mig-<profile>.{mig.group(1)}"
    return VENDOR_KEY.sub("edl.io/<vendor>.", key)


def device(vendor: Vendor, index: int, product: str, **attributes: str) -> Device:
    kind = {Vendor.NVIDIA: "gpu", Vendor.ASCEND: "npu", Vendor.KUNLUNXIN: "xpu"}.get(vendor, "dcu")
    return Device(
        vendor, kind, index, f"{vendor.value}-{index}", product, 65536, attributes=attributes
    )


def mig(index: int, parent: str, profile: str) -> Device:
    return Device(
        Vendor.NVIDIA, "mig", index, f"MIG-{index}", f"{A100} MIG {profile}", 9728,
        parent=parent, attributes={"mig_profile": profile},
    )  # fmt: skip


def written(inventory: Inventory, settings: Settings) -> set[str]:
    labels = node_labels(inventory=inventory, unhealthy={}, settings=settings, machine="DGX")
    return {generic(key) for key in labels}


def every_written_key() -> set[str]:
    driver = {"driver_version": "580.159.04", "cuda_driver_version": "13.0"}
    gpu = {"compute_capability": "8.0", "mig_mode": "enabled"}
    gpu |= {"pci_class": "0x030200", "vgpu": "false"}  # what sysfs shows a privileged agent
    mixed = Inventory(
        "node",
        (
            VendorReport(
                Vendor.NVIDIA,
                (device(Vendor.NVIDIA, 0, A100, **gpu), mig(1, "nvidia-0", "1g.10gb")),
                driver,
            ),
            *(
                VendorReport(vendor, (device(vendor, 0, "P800"),), {"driver_version": "5.0"})
                for vendor in (Vendor.KUNLUNXIN, Vendor.HYGON, Vendor.ASCEND)
            ),
        ),
        (),
    )
    keys: set[str] = {LEADER_LABEL}
    for strategy in ("none", "single", "mixed"):
        keys |= written(mixed, load_settings(overrides={"nvidia": {"mig_strategy": strategy}}))
    return keys


def test_the_catalog_names_every_label_the_code_writes() -> None:
    assert every_written_key() - catalog() == set()


def test_the_catalog_names_no_label_the_code_does_not_write() -> None:
    assert catalog() - every_written_key() == set()
