"""What the host shows besides devices, for saying why discovery found none: whether the host
root is mounted at all (`/dev`, `/sys`), which vendors the settings turn off, and which
accelerators the PCI bus shows whatever the drivers say.

The PCI classes counted are among those Node Feature Discovery labels by default: display
controllers (03) and processing accelerators (12); for Huawei only the latter, as its BMC's
graphics (03) and network cards share Ascend's vendor id. The DaemonSet's node affinity reads
the same classes in NFD's labels.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import PCI_VENDORS, HostFacts, Vendor

PCI_DEVICES = "/sys/bus/pci/devices"
ACCELERATOR_CLASSES: dict[Vendor, tuple[str, ...]] = {
    Vendor.NVIDIA: ("03", "12"),
    Vendor.ASCEND: ("12",),
    Vendor.HYGON: ("03", "12"),
    Vendor.KUNLUNXIN: ("03", "12"),
}
_BY_ID = {f"0x{pci_id}": vendor for vendor, pci_id in PCI_VENDORS.items()}


def host_facts(root: HostRoot, *, disabled: Iterable[Vendor] = ()) -> HostFacts:
    missing = tuple(where for where in ("/dev", "/sys") if not root.path(where).is_dir())
    return HostFacts(
        host_root=str(root.root),
        missing=missing,
        disabled=tuple(disabled),
        pci=dict(sorted(accelerator_pci(root).items())),
    )


def accelerator_pci(root: HostRoot) -> Counter[Vendor]:
    """Accelerator-class PCI functions under the root's sysfs, by vendor."""
    found: Counter[Vendor] = Counter()
    for device in root.glob(PCI_DEVICES, "*"):
        vendor = _BY_ID.get((root.read_optional(f"{device}/vendor") or "").lower())
        klass = (root.read_optional(f"{device}/class") or "").lower().removeprefix("0x")
        if vendor is not None and klass.startswith(ACCELERATOR_CLASSES[vendor]):
            found[vendor] += 1
    return found
