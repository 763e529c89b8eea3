"""Files of a simulated node's host-root tree: how one is written, and the paths and PCI domains
the vendor trees share."""

from __future__ import annotations

from pathlib import Path

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
