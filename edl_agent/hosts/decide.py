"""Which of a job's worker pods an elastic launcher may train on, and with how many slots. Pure:
pods, nodes and ResourceClaims (JSON dicts as the API returns them) in, `host[:slots]` lines out.

A pod is a host when all of these hold; otherwise it is left out, with the first reason found:

  the pod                                   left out when
  metadata.deletionTimestamp                set: it is going (the restarter deletes a pod it
                                            replaces; a force delete; an eviction)
  condition DisruptionTarget                True, whatever the reason: `DeletionByEdlRestarter`
                                            (the restarter replaces it), the taint manager,
                                            preemption, the Eviction API
  another selected pod's annotation         names its uid: the restarter made that pod to replace
  `edl.io/replaces-uid`                     it (created before the old pod is deleted)
  status.phase, condition Ready             not Running, or not Ready
  allocatedResourcesStatus (KEP-4680)       a device of the pod reported `Unhealthy` by kubelet
                                            (device plugin: our ListAndWatch health, so cordoned,
                                            quarantined and degraded devices too: Horovod then
                                            lets the host go at its next commit; DRA: our
                                            health stream, where degraded reads Healthy)
  its node (unless nodes are not read)      gone; Ready not True; tainted
                                            `node.kubernetes.io/unreachable` or
                                            `.../out-of-service` (an operator's word that it is
                                            down); or its `AcceleratorHealthy`
                                            condition False while the pod holds accelerators and
                                            kubelet reports no device health for the pod (no
                                            way to tell whether the pod's devices are the bad
                                            ones: left out to be safe)
  an address                                none: no IPv4 pod IP (Horovod splits a line at `:`,
                                            so an IPv6 address cannot be written; use DNS names)

Device health `Unknown` (kubelet has not heard from the plugin within its timeout, as while an
agent restarts) does not leave a pod out: a launcher would shrink every job on that node for a
restart of ours.

The host is the pod's IPv4 address, or with `dns` its `<hostname>.<subdomain>` name where the pod
has both (a StatefulSet's pods, an indexed Job's with a headless Service); a pod without them
keeps its address. Slots: a fixed number, or a positive integer in a label or annotation of the
pod, or else the accelerators the pod holds: the limits (else requests) of its containers for
known accelerator resources, plus the devices allocated to its ResourceClaims by known
accelerator drivers. No count (0, or a missing or bad label) prints the bare host: the launcher's
default slots apply (`horovodrun --slots-per-host`). Lines are sorted by pod name; a host already
printed is not printed again.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edl_agent.labels.condition import CONDITION_TYPE as ACCELERATOR_CONDITION
from edl_agent.restarter.core.replacement import REPLACES_UID_ANNOTATION

Obj = Mapping[str, Any]

# Extended resources that are one accelerator each: the names our device plugin advertises by
# default and those of the vendors' own plugins. Shares (memory units, time-slicing replicas
# under their own names) are not accelerators.
KNOWN_RESOURCES = re.compile(
    r"^(nvidia\.com/(gpu|mig-[A-Za-z0-9.+-]+)|amd\.com/gpu|kunlunxin\.com/xpu|baidu\.com/xpu"
    r"|hygon\.com/(dcu|dcunum)|huawei\.com/Ascend[A-Za-z0-9]+(-[0-9]+c)?)$"
)
# DRA drivers whose devices are accelerators: ours (edl_agent.devices.names) and NVIDIA's.
KNOWN_DRIVERS = frozenset(
    {
        "gpu.nvidia.edl.io",
        "xpu.kunlunxin.edl.io",
        "dcu.hygon.edl.io",
        "npu.ascend.edl.io",
        "gpu.nvidia.com",
    }
)
# Not `node.kubernetes.io/not-ready`: the Ready condition says the same, and the NoSchedule
# taint admission puts on every new node stays where no node lifecycle controller removes it.
NODE_DOWN_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/out-of-service")


@dataclass(frozen=True)
class SlotRule:
    """Where a host's slots come from: `fixed`, else the pod's `source` ("label" or
    "annotation", key), else its accelerators (`resources`: extended resource names and DRA
    driver names that count; empty: the known ones)."""

    fixed: int | None = None
    source: tuple[str, str] | None = None
    resources: frozenset[str] = frozenset()


@dataclass(frozen=True)
class HostRules:
    dns: bool = False
    slots: SlotRule = field(default_factory=SlotRule)


@dataclass(frozen=True)
class LeftOut:
    pod: str  # namespace/name
    reason: str


@dataclass(frozen=True)
class Hosts:
    lines: tuple[str, ...]
    left_out: tuple[LeftOut, ...] = ()
    notes: tuple[str, ...] = ()  # what a person should fix (a slots label that is no number)


@dataclass(frozen=True)
class Snapshot:
    """What was read: the selected pods; each node they are on (None: gone), or None when nodes
    were not read; the namespace's ResourceClaims by name (read only when needed)."""

    pods: Sequence[Obj]
    nodes: Mapping[str, Obj | None] | None = None
    claims: Mapping[str, Obj] = field(default_factory=dict)


def discover_hosts(snapshot: Snapshot, rules: HostRules) -> Hosts:
    """The `host[:slots]` lines for the pods fit to train on, and why the others are not."""
    replaced = _replaced_uids(snapshot.pods)
    lines: list[str] = []
    hosts: set[str] = set()
    left_out: list[LeftOut] = []
    notes: list[str] = []
    for pod in sorted(snapshot.pods, key=_name):
        reason = pod_unfit(pod, replaced) or _health_unfit(pod, snapshot, rules)
        host = None if reason else _host(pod, dns=rules.dns)
        if host is None:
            why = reason or "no IPv4 address (a host line cannot hold an IPv6 one: use --dns)"
            left_out.append(LeftOut(_name(pod), why))
            continue
        if host in hosts:
            continue
        hosts.add(host)
        slots, note = _slots(pod, snapshot.claims, rules.slots)
        if note:
            notes.append(note)
        lines.append(f"{host}:{slots}" if slots else host)
    return Hosts(tuple(lines), tuple(left_out), tuple(notes))


def pod_unfit(pod: Obj, replaced: Mapping[str, str]) -> str | None:
    """Why the pod itself (not its node or devices) is no host, or None."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "being deleted"
    disruption = _condition(status, "DisruptionTarget")
    if disruption is not None and disruption.get("status") == "True":
        return f"DisruptionTarget ({disruption.get('reason') or 'no reason'})"
    successor = replaced.get(str(meta.get("uid") or ""))
    if successor:
        return f"being replaced by {successor}"
    if status.get("phase") != "Running":
        return f"phase {status.get('phase') or 'unknown'}"
    ready = _condition(status, "Ready")
    if ready is None or ready.get("status") != "True":
        return "not Ready"
    return None


def nodes_to_read(pods: Iterable[Obj]) -> list[str]:
    """The nodes of the pods that are fit as far as the pods themselves say, sorted."""
    pods = list(pods)
    replaced = _replaced_uids(pods)
    names = {
        str((p.get("spec") or {}).get("nodeName") or "")
        for p in pods
        if not pod_unfit(p, replaced) and not unhealthy_devices(p)
    }
    return sorted(names - {""})


def needs_claims(pods: Iterable[Obj], rules: HostRules) -> bool:
    """Whether a pod's slots depend on its ResourceClaims (so they must be read)."""
    if rules.slots.fixed is not None or rules.slots.source is not None:
        return False
    return any(_claim_names(p) for p in pods)


def _health_unfit(pod: Obj, snapshot: Snapshot, rules: HostRules) -> str | None:
    unhealthy = unhealthy_devices(pod)
    if unhealthy:
        return "device unhealthy: " + ", ".join(unhealthy)
    if snapshot.nodes is None:
        return None
    name = str((pod.get("spec") or {}).get("nodeName") or "")
    node = snapshot.nodes.get(name)
    if node is None:
        return f"node {name} is gone"
    why = node_unfit(node)
    if why:
        return f"node {name} {why}"
    condition = _condition(node.get("status") or {}, ACCELERATOR_CONDITION)
    holds = _accelerators(pod, snapshot.claims, rules.slots.resources) > 0 or _claim_names(pod)
    if (
        condition is not None
        and condition.get("status") == "False"
        and holds
        and not _health_reported(pod)
    ):
        return (
            f"node {name} {ACCELERATOR_CONDITION}=False ({condition.get('reason') or ''}) "
            "and kubelet reports no device health for the pod"
        )
    return None


def node_unfit(node: Obj) -> str | None:
    """Why nothing on this node can train: NotReady, or a taint that says it is down."""
    ready = _condition(node.get("status") or {}, "Ready")
    if ready is None or ready.get("status") != "True":
        return f"Ready={(ready or {}).get('status') or 'missing'}"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("key") in NODE_DOWN_TAINTS:
            return f"tainted {taint.get('key')}"
    return None


def unhealthy_devices(pod: Obj) -> list[str]:
    """`<resourceID> (<resource>)` for each device kubelet reports Unhealthy in the pod."""
    found = []
    for entry in _resource_statuses(pod):
        for device in entry.get("resources") or []:
            if device.get("health") == "Unhealthy":
                found.append(f"{device.get('resourceID')} ({entry.get('name')})")
    return list(dict.fromkeys(found))


def _health_reported(pod: Obj) -> bool:
    return any(entry.get("resources") for entry in _resource_statuses(pod))


def _resource_statuses(pod: Obj) -> Iterable[Obj]:
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or []:
            yield from container.get("allocatedResourcesStatus") or []


def _replaced_uids(pods: Iterable[Obj]) -> dict[str, str]:
    """uid of a pod being replaced → the name of the replacement naming it."""
    replaced = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid = (meta.get("annotations") or {}).get(REPLACES_UID_ANNOTATION)
        if uid:
            replaced[str(uid)] = str(meta.get("name") or "")
    return replaced


def _host(pod: Obj, *, dns: bool) -> str | None:
    spec = pod.get("spec") or {}
    if dns and spec.get("hostname") and spec.get("subdomain"):
        return f"{spec['hostname']}.{spec['subdomain']}"
    status = pod.get("status") or {}
    addresses = [str(a.get("ip") or "") for a in status.get("podIPs") or []]
    addresses.append(str(status.get("podIP") or ""))
    return next((a for a in addresses if _ipv4(a)), None)


def _ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def _slots(pod: Obj, claims: Mapping[str, Obj], rule: SlotRule) -> tuple[int, str | None]:
    """(slots, a note for a person); 0: no count, the launcher's default applies."""
    if rule.fixed is not None:
        return rule.fixed, None
    if rule.source is not None:
        kind, key = rule.source
        values = (pod.get("metadata") or {}).get(f"{kind}s") or {}
        value = values.get(key)
        if value is None:
            return 0, None
        text = str(value).strip()
        if text.isascii() and text.isdigit() and int(text) > 0:
            return int(text), None
        return 0, f"{_name(pod)}: {kind} {key}={value!r} is not a positive integer"
    return _accelerators(pod, claims, rule.resources), None


def _accelerators(pod: Obj, claims: Mapping[str, Obj], resources: frozenset[str]) -> int:
    """Accelerators of the pod's containers (extended resources) and of its claims (DRA)."""

    def counts(name: str) -> bool:
        return name in resources if resources else bool(KNOWN_RESOURCES.match(name))

    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        given = container.get("resources") or {}
        amounts = given.get("limits") or given.get("requests") or {}
        total += sum(_count(v) for k, v in amounts.items() if counts(k))
    for claim_name in _claim_names(pod):
        claim = claims.get(claim_name) or {}
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = (allocation.get("devices") or {}).get("results") or []
        drivers = resources or KNOWN_DRIVERS
        total += sum(1 for r in results if r.get("driver") in drivers)
    return total


def _claim_names(pod: Obj) -> list[str]:
    """The names of the ResourceClaims the pod uses (made from templates: as its status says)."""
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    names = []
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = entry.get("resourceClaimName") or generated.get(entry.get("name"))
        if name:
            names.append(str(name))
    return names


def _count(value: object) -> int:
    try:
        return max(int(str(value)), 0)
    except ValueError:
        return 0


def _condition(status: Obj, kind: str) -> Obj | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def _name(pod: Obj) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
