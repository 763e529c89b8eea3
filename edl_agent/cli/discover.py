"""`edl-agent discover`: the node's accelerators and the resources kubelet would see, or how
the physical accelerators connect (--topology)."""

from __future__ import annotations

import argparse
import json

from edl_agent.cli.parser import SETTINGS_EPILOG
from edl_agent.cli.settings import node_settings
from edl_agent.cli.table import render_table

# `discover --format json`: tests/test_cli_help.py checks it against real output.
DISCOVER_JSON_SHAPE = (
    '{"node", "devices": [...], "resources": [{"name", "devices": [ids]}], '
    '"vendors": [{"vendor", "count", "driver", "error"}]}'
)


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], node: argparse.ArgumentParser
) -> None:
    discover = commands.add_parser(
        "discover",
        parents=[node],
        help="list the node's accelerators and the resources kubelet would see",
        description="Discover every accelerator under the host root and print the inventory: "
        "one row per device and the resources that would be advertised to kubelet (slices "
        "included). A vendor whose library or tool fails is reported as an error and the "
        "others are still listed.",
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    discover.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help=f"table for people (default), json for programs: {DISCOVER_JSON_SHAPE}",
    )
    discover.add_argument(
        "--topology",
        action="store_true",
        help="print how the physical accelerators connect instead, as `nvidia-smi topo -m` "
        "does: a matrix of direct links (NV# NVLinks, HCCS, HCCS_SW, SIO, UB, XGMI) or else PCIe "
        "paths (PIX, PXB, PHB, NODE, SYS), with each device's CPU and NUMA affinity. NVIDIA: NVML "
        "(NVLink counts, common ancestor, affinity). Ascend: npu-smi info -t topo (HCCS, HCCS_SW "
        "through a switch, SIO between the dies of an A3 NPU, UB; not counted). "
        "Hygon: xGMI links in the KFD topology (not counted). Kunlunxin: no XPU Links are read. "
        "Everything else, and every pair of different vendors, from sysfs (PCI tree, NUMA "
        "nodes). With --format json: "
        '{"node", "devices", "pairs", "matrix", "vendors": [{"vendor", "known", "error"}], '
        '"legend"}',
    )
    discover.set_defaults(handler=discover_command)


def discover_command(args: argparse.Namespace) -> int:
    from edl_agent.devices.discovery import discover_node

    with node_settings(args) as settings:
        inventory = discover_node(settings)
        if args.topology:
            from edl_agent.devices.hostroot import HostRoot
            from edl_agent.devices.topology import render_matrix
            from edl_agent.devices.topology_read import read_topology

            topology = read_topology(HostRoot.at(settings.host_root), inventory)
            if args.format == "json":
                print(json.dumps(topology.to_json(), indent=2))
            else:
                print(render_matrix(topology))
            return 0
    if args.format == "json":
        print(json.dumps(inventory.to_json(), indent=2))
    else:
        print(render_table(inventory))
    return 0
