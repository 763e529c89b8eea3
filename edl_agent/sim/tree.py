"""Write a simulated node's host-root tree from a profile."""

from __future__ import annotations

import uuid
from pathlib import Path

from edl_agent.sim import ascend_tree, hygon_tree, kunlunxin_tree, nvidia_tree
from edl_agent.sim.files import BOOT_ID, write_file
from edl_agent.sim.profile import Profile, numa_cpulist


def build_tree(profile: Profile, root: Path) -> None:
    """Write everything a node of `profile` shows to the agent under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    write_file(root, "/etc/hostname", profile.node.hostname + "\n")
    write_file(root, BOOT_ID, f"{uuid.uuid4()}\n")
    write_file(root, "/sys/class/dmi/id/product_name", profile.node.machine + "\n")
    for numa in range(profile.node.numa_nodes):
        write_file(root, f"/sys/devices/system/node/node{numa}/cpulist", numa_cpulist(numa) + "\n")
    if profile.nvidia is not None:
        nvidia_tree.write(profile.nvidia, profile, root)
    if profile.kunlunxin is not None:
        kunlunxin_tree.write(profile.kunlunxin, profile, root)
    if profile.hygon is not None:
        hygon_tree.write(profile.hygon, profile, root)
    if profile.ascend is not None:
        ascend_tree.write(profile.ascend, profile, root)
