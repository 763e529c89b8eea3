"""The device table `discover` and `run` print: one row per device, then the resources."""

from __future__ import annotations

from collections.abc import Sequence

from edl_agent.devices.model import Inventory


def render_table(inventory: Inventory) -> str:
    header = ("VENDOR", "KIND", "INDEX", "ID", "PRODUCT", "MEMORY", "NUMA", "PCI", "HEALTH")
    index_of = {d.id: d.index for d in inventory.devices}
    rows = [
        (
            d.vendor.value,
            d.kind,
            str(d.index) if d.parent is None else f"{index_of.get(d.parent, '?')}:{d.index}",
            d.id,
            d.product,
            f"{d.memory_mib} MiB",
            "-" if d.numa_node is None else str(d.numa_node),
            d.pci_bus_id or "-",
            d.health.value,
        )
        for d in inventory.devices
    ]
    lines = [f"node {inventory.node}: {device_counts(inventory)}"]
    if rows:
        lines += _columns([header, *rows])
    else:
        from edl_agent.labels.condition import no_accelerators

        lines.append(no_accelerators(inventory).message)
    for vendor, error in sorted(inventory.errors.items()):
        lines.append(f"error {vendor}: {error}")
    lines.append("")
    lines += _columns(
        [("RESOURCE", "COUNT"), *((r.name, str(len(r.units))) for r in inventory.resources)]
    )
    return "\n".join(lines)


# How the table counts each kind of device (a MIG device is a slice of a GPU, not another GPU).
KIND_NAMES = {"gpu": "GPU", "mig": "MIG device", "npu": "NPU", "xpu": "XPU", "dcu": "DCU"}


def device_counts(inventory: Inventory) -> str:
    """`8 GPUs, 24 MIG devices`: each kind counted apart, in the order they are listed."""
    counts: dict[str, int] = {}
    for device in inventory.devices:
        counts[device.kind] = counts.get(device.kind, 0) + 1
    if not counts:
        return "0 accelerators"
    return ", ".join(
        f"{n} {KIND_NAMES.get(kind, kind)}{'' if n == 1 else 's'}" for kind, n in counts.items()
    )


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
