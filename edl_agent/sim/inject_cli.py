"""`edl-agent simulate inject`: put a fault into a simulated node while an agent runs on it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.errors import UsageError

HEX_CODE = re.compile(r"^(0[xX])?[0-9a-fA-F]{8}$")
PCIE_LINK = re.compile(r"^(?P<gen>[0-9]+)?(?:x(?P<width>[0-9]+))?$")

DESCRIPTION = """\
Inject a fault into the simulated node under DIR (built by `simulate build`, or the temporary
tree a `--simulate` agent logs). NVIDIA faults go through the fake NVML library's fault file and
reach a running agent as NVML events; --remove deletes the device's /dev node (any vendor);
--health sets what the vendor tool reports for an NPU/XPU/DCU on its next poll; --reset shows
what a reset of the device shows; --reboot what a reboot of the node shows (a new boot id).
"""

HEALTH_HELP = (
    "NPU: a Health word (OK, Warning, Alarm, Critical) or a fault code such as 0x80E01801; "
    "XPU/DCU: a state (Normal, Warning, Fault, Lost)"
)


def bit_mask(text: str) -> int:
    """A mask in decimal or 0x hex (argparse names the function in its error)."""
    return int(text, 0)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "inject",
        help="inject a fault into a simulated node",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", metavar="DIR", type=Path, help="the simulated node's root")
    parser.add_argument(
        "--device",
        metavar="N",
        help="device index (every fault but --reboot); a GPU also by its uuid (GPU-...)",
    )
    parser.add_argument(
        "--vendor",
        choices=[v.value for v in Vendor],
        help="which vendor's device N (default: the only vendor, or nvidia for GPU faults)",
    )
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--xid", type=int, metavar="CODE", help="an NVIDIA XID event, e.g. 79")
    fault.add_argument("--ecc-dbe", action="store_true", help="an NVIDIA double-bit ECC error")
    fault.add_argument(
        "--ecc-sbe",
        nargs="?",
        const=1,
        type=int,
        metavar="COUNT",
        help="COUNT (default 1) NVIDIA single-bit ECC errors, reported as one event",
    )
    fault.add_argument(
        "--clocks",
        type=bit_mask,
        metavar="REASONS",
        help="the GPU's clocks-event reasons from now on, a mask such as 0x48 (0: none)",
    )
    fault.add_argument(
        "--pcie",
        metavar="GENxWIDTH",
        help="the GPU's PCIe link trains lower: 4x16, 4 (generation only) or x8 (width only)",
    )
    fault.add_argument("--rows-pending", type=int, metavar="N", help="N rows wait for remapping")
    fault.add_argument("--rows-failed", type=int, metavar="N", help="N rows failed remapping")
    fault.add_argument("--lost", action="store_true", help="the GPU falls off the bus")
    fault.add_argument("--recover", action="store_true", help="a lost GPU answers again")
    fault.add_argument(
        "--nvml-init-fail",
        choices=("on", "off"),
        help="make NVML fail to initialise (and break the event loop) until off",
    )
    fault.add_argument("--remove", action="store_true", help="delete the device's /dev node")
    fault.add_argument("--health", metavar="CODE", help=HEALTH_HELP)
    fault.add_argument(
        "--reset",
        action="store_true",
        help="device N was reset: its tools show what they show after a reset (any vendor)",
    )
    fault.add_argument(
        "--reboot",
        action="store_true",
        help="the node rebooted: a new boot id, and the faults its drivers held are gone",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _inject(args)
    except ValueError as exc:  # the inject functions explain bad input in one line
        raise UsageError(str(exc)) from None


def _inject(args: argparse.Namespace) -> int:
    # The simulated trees are imported only here: `edl-agent run` builds the parser too.
    from edl_agent.sim import inject

    root: Path = args.directory
    if not root.is_dir():
        msg = f"{root}: not a directory (build one with `edl-agent simulate build`)"
        raise ValueError(msg)
    if args.reboot:
        print(f"injected: reboot ({inject.reboot(root)}) under {root}")
        return 0
    if args.device is None:
        msg = "--device N is required (every fault but --reboot names a device)"
        raise ValueError(msg)
    index = _device_index(root, args.device)
    wear = _wear(root, index, args)
    if wear is not None:
        done = wear
    elif args.reset:
        vendor = Vendor(args.vendor) if args.vendor else _only_vendor(root)
        done = inject.reset_device(root, vendor, index)
    elif args.xid is not None:
        inject.inject_xid(root, index, args.xid)
        done = f"XID {args.xid} on GPU {index}"
    elif args.ecc_dbe:
        inject.inject_ecc_dbe(root, index)
        done = f"double-bit ECC error on GPU {index}"
    elif args.lost:
        inject.inject_lost(root, index)
        done = f"GPU {index} lost"
    elif args.recover:
        inject.inject_recover(root, index)
        done = f"GPU {index} recovered"
    elif args.nvml_init_fail is not None:
        inject.set_nvml_init_failure(root, args.nvml_init_fail == "on")
        done = f"NVML initialisation failure {args.nvml_init_fail}"
    elif args.remove:
        vendor = Vendor(args.vendor) if args.vendor else _only_vendor(root)
        removed = inject.remove_device_node(root, vendor, index)
        done = f"removed {', '.join(removed)}"
    else:
        vendor = Vendor(args.vendor) if args.vendor else _only_vendor(root, polled=True)
        _set_health(root, vendor, index, args.health)
        done = f"{vendor.value} device {index} reports {args.health}"
    print(f"injected: {done} under {root}")
    return 0


def _wear(root: Path, index: int, args: argparse.Namespace) -> str | None:
    """A reading that warns before GPU `index` fails, set; None when `args` ask for none."""
    from edl_agent.sim import inject

    if args.ecc_sbe is not None:
        inject.inject_ecc_sbe(root, index, count=args.ecc_sbe)
        return f"{args.ecc_sbe} single-bit ECC error(s) on GPU {index}"
    if args.clocks is not None:
        inject.set_clock_event_reasons(root, index, args.clocks)
        return f"clocks-event reasons {args.clocks:#x} on GPU {index}"
    if args.pcie is not None:
        generation, width = _pcie_link(args.pcie)
        inject.set_pcie_link(root, index, generation=generation, width=width)
        return f"PCIe link {args.pcie} on GPU {index}"
    if args.rows_pending is not None or args.rows_failed is not None:
        inject.set_remapped_rows(root, index, pending=args.rows_pending, failed=args.rows_failed)
        return f"remapped rows on GPU {index}"
    return None


def _pcie_link(text: str) -> tuple[int | None, int | None]:
    found = PCIE_LINK.match(text)
    if found is None or not text:
        msg = f"--pcie: {text!r} is not GENxWIDTH (4x16), GEN (4) or xWIDTH (x8)"
        raise ValueError(msg)
    gen, width = found.group("gen"), found.group("width")
    return (int(gen) if gen else None, int(width) if width else None)


def _device_index(root: Path, device: str) -> int:
    from edl_agent.sim import inject

    if device.isdigit():
        return int(device)
    if device.startswith("GPU-"):
        return inject.gpu_index(root, device)
    msg = f"--device: {device!r} is neither a device index nor a GPU uuid (GPU-...)"
    raise ValueError(msg)


def _set_health(root: Path, vendor: Vendor, index: int, code: str) -> None:
    from edl_agent.sim import ascend_tree, hygon_tree, kunlunxin_tree

    if vendor is Vendor.ASCEND:
        if HEX_CODE.match(code):
            ascend_tree.set_npu_health(root, index, "Critical", fault_codes=(code,))
        else:
            ascend_tree.set_npu_health(root, index, code)
    elif vendor is Vendor.KUNLUNXIN:
        kunlunxin_tree.set_xpu_state(root, index, code)
    elif vendor is Vendor.HYGON:
        hygon_tree.set_dcu_state(root, index, code)
    else:
        msg = "--health is for NPU/XPU/DCU; use --xid, --ecc-dbe or --lost for NVIDIA GPUs"
        raise ValueError(msg)


def _only_vendor(root: Path, *, polled: bool = False) -> Vendor:
    from edl_agent.sim import hygon_tree

    host = HostRoot.at(root)
    present = [
        vendor
        for vendor, pattern in (
            (Vendor.NVIDIA, "nvidia[0-9]*"),
            (Vendor.KUNLUNXIN, "xpu[0-9]*"),
            (Vendor.ASCEND, "davinci[0-9]*"),
        )
        if host.glob("/dev", pattern)
    ]
    if any(host.exists(tool) for tool in hygon_tree.TOOLS):
        present.append(Vendor.HYGON)
    return pick_vendor(root, present, polled=polled)


def pick_vendor(root: Path, present: list[Vendor], *, polled: bool) -> Vendor:
    """The one vendor a fault without --vendor is for, or ValueError naming what the tree has.
    `polled`: the fault is a health code, which only the tool-polled vendors (not NVIDIA) take."""
    candidates = [v for v in present if not (polled and v is Vendor.NVIDIA)]
    if len(candidates) == 1:
        return candidates[0]
    if not present:
        msg = f"{root}: no simulated devices found (build a node with `edl-agent simulate build`)"
    elif not candidates:
        msg = (
            f"{root} has nvidia GPUs only; --health is for ascend, hygon and kunlunxin devices "
            "(for a GPU: --xid, --ecc-dbe or --lost)"
        )
    else:
        found = ", ".join(v.value for v in candidates)
        msg = f"{root} has devices of {found}: say which with --vendor"
    raise ValueError(msg)
