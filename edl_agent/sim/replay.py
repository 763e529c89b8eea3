"""A simulated node that shows what a recording (sim/record.py) captured on a real node.

The recording's `tree/` is copied under the new root, the fake libnvidia-ml.so.1 is installed
beside the recorded data file, and `nvidia-smi` prints the recorded `-q`, `-L` and `topo -m`
outputs (and takes `--gpu-reset -i N` as the profile-built stand-in does).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

from edl_agent.errors import UsageError
from edl_agent.sim import nvidia_tree
from edl_agent.sim.files import BOOT_ID, write_file
from edl_agent.sim.record import FAKE_NVML_DATA, FORMAT, SMI_TOOLS

RECORDED_OUTPUTS = "/usr/share/edl-agent/recorded"


class RecordingError(UsageError):
    """Not a recording this version can replay; the message names the directory and why."""


def is_recording(path: Path) -> bool:
    return (path / "recording.json").is_file() and (path / "tree").is_dir()


def read_meta(recording: Path) -> dict[str, Any]:
    try:
        meta = json.loads((recording / "recording.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        msg = f"{recording}: not a recording ({exc})"
        raise RecordingError(msg) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        msg = f"{recording}: recording format {meta.get('format')!r}, this version reads {FORMAT}"
        raise RecordingError(msg)
    if not (recording / "tree").is_dir() or not (recording / FAKE_NVML_DATA).is_file():
        msg = f"{recording}: has no tree/ directory or no {FAKE_NVML_DATA}"
        raise RecordingError(msg)
    return meta


def replay(recording: Path, root: Path) -> None:
    """Write the host-root tree of `recording` under `root` (which may exist and be empty)."""
    read_meta(recording)
    shutil.copytree(recording / "tree", root, dirs_exist_ok=True)
    nvidia_tree.install_library(root)
    write_file(root, nvidia_tree.DATA, (recording / FAKE_NVML_DATA).read_text(encoding="utf-8"))
    (root / nvidia_tree.FAULTS.lstrip("/")).unlink(missing_ok=True)
    write_file(root, BOOT_ID, f"{uuid.uuid4()}\n")
    for name in SMI_TOOLS:
        recorded = recording / "tools" / f"nvidia-smi-{name}.txt"
        if recorded.is_file():
            write_file(root, f"{RECORDED_OUTPUTS}/nvidia-smi-{name}.txt", recorded.read_text())
    write_file(root, nvidia_tree.SMI, SMI_SCRIPT, mode=0o755)


# The profile-built stand-in's reset, plus the recorded outputs.
SMI_SCRIPT = """#!/bin/sh
# nvidia-smi stand-in for a node replayed from a recording: -q, -L and topo -m print what the
# real node printed; --gpu-reset -i <index> (or -r -i <index>) as on every simulated node.
here=$(dirname "$0")
recorded="$here/../share/edl-agent/recorded"
show() {
  if [ -f "$recorded/nvidia-smi-$1.txt" ]; then cat "$recorded/nvidia-smi-$1.txt"; exit 0; fi
  echo "nvidia-smi (replayed): nothing was recorded for this command" >&2; exit 2
}
case "$*" in
  "-q") show q ;;
  "-L") show L ;;
  "topo -m") show topo-m ;;
esac
""" + nvidia_tree.SMI_SCRIPT.split("\n", 2)[2]
