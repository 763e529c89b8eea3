"""Write a simulated node's host-root tree from a profile."""

from __future__ import annotations

import uuid
from pathlib import Path

from edl_agent.sim.profile import Profile, numa_cpulist

BOOT_ID = "/proc/sys/kernel/random/boot_id"

# PCI domain per vendor in simulated trees (see profile.pci_bus_id).
VENDOR_SLOT = {"nvidia": 0, "kunlunxin": 1, "hygon": 2, "ascend": 3}


def write_file(root: Path, host_path: str, text: str = "", *, mode: int = 0o644) -> Path:
    """Create `host_path` under `root` with `text`; parents are created as needed."""
    local = root / host_path.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(text, encoding="utf-8")
    local.chmod(mode)
    return local


def build_tree(profile: Profile, root: Path) -> None:
    """Write everything a node of `profile` shows to the agent under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    write_file(root, "/etc/hostname", profile.node.hostname + "\n")
    write_file(root, BOOT_ID, f"{uuid.uuid4()}\n")
    write_file(root, "/sys/class/dmi/id/product_name", profile.node.machine + "\n")
    for numa in range(profile.node.numa_nodes):
        write_file(root, f"/sys/devices/system/node/node{numa}/cpulist", numa_cpulist(numa) + "\n")
    if profile.nvidia is not None:
        from edl_agent.sim import nvidia_tree

        nvidia_tree.write(profile.nvidia, profile, root)
    if profile.kunlunxin is not None:
        from edl_agent.sim import kunlunxin_tree

        kunlunxin_tree.write(profile.kunlunxin, profile, root)
    if profile.hygon is not None:
        from edl_agent.sim import hygon_tree

        hygon_tree.write(profile.hygon, profile, root)
    if profile.ascend is not None:
        from edl_agent.sim import ascend_tree

        ascend_tree.write(profile.ascend, profile, root)
