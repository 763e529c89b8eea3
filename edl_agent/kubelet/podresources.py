"""Which containers hold which of our devices, from kubelet's pod-resources API (`List`).

Kubelet reports the ids our plugins advertised — replica, memory and core unit ids for shared
devices — so the caller passes the snapshot's unit maps and every id resolves to the physical
device it stands for. Read at scrape time: it never raises, a missing socket (no kubelet, or
the directory not mounted) is quietly "no pods", and a failure is logged once until it changes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from edl_agent._proto.podresources.v1 import api_pb2, api_pb2_grpc
from edl_agent.devices.model import ResourceUnit

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True, order=True)
class PodRef:
    """One container holding (a unit of) a device, as kubelet's pod-resources API reports it."""

    namespace: str
    pod: str
    container: str
    resource: str


Units = Mapping[str, Mapping[str, ResourceUnit]]
"""Resource name → advertised unit id → unit, as in `Snapshot.units`."""
Claimable = Mapping[tuple[str, str, str], str]
"""(DRA driver, pool, device name) → physical device id, for the devices we publish in
ResourceSlices (`devices.names.claimable`)."""


def attribute(
    response: api_pb2.ListPodResourcesResponse, units: Units, claimable: Claimable | None = None
) -> dict[str, list[PodRef]]:
    """Physical device id → the containers holding it (sorted, each once), from a List answer:
    device-plugin ids through `units`, DRA claims through `claimable` (the ref's resource is
    then `claim:<namespace>/<claim>`).

    Ids of resources we do not advertise, and ids we no longer advertise, are left out.
    """
    holders: dict[str, set[PodRef]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for dynamic in container.dynamic_resources if claimable else ():
                claim = f"claim:{dynamic.claim_namespace}/{dynamic.claim_name}"
                for resource in dynamic.claim_resources:
                    key = (resource.driver_name, resource.pool_name, resource.device_name)
                    device_id = claimable.get(key) if claimable else None
                    if device_id is not None:
                        ref = PodRef(pod.namespace, pod.name, container.name, claim)
                        holders.setdefault(device_id, set()).add(ref)
            for assigned in container.devices:
                resource_units = units.get(assigned.resource_name)
                if resource_units is None:
                    continue
                ref = PodRef(
                    namespace=pod.namespace,
                    pod=pod.name,
                    container=container.name,
                    resource=assigned.resource_name,
                )
                for unit_id in assigned.device_ids:
                    unit = resource_units.get(unit_id)
                    if unit is not None:
                        holders.setdefault(unit.device_id, set()).add(ref)
    return {device_id: sorted(refs) for device_id, refs in sorted(holders.items())}


class PodResourcesClient:
    """Calls `List` on kubelet's pod-resources socket, on a channel of its own each time.

    A connected gRPC channel keeps gRPC core's threads waking (about 5 times a second) whether it
    is used or not, and the callers are rare (a scrape, a fault, a reset): a connection over a
    unix socket per call costs less than holding one, and a kubelet that re-created its socket is
    reached at its new one without asking."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] = DEFAULT_SOCKET,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._lock = threading.Lock()  # one call at a time, and one report of each problem
        self._problem: str | None = None
        self._log = structlog.get_logger().bind(socket=str(self.socket_path))

    def pod_devices(
        self, units: Units, claimable: Claimable | None = None
    ) -> dict[str, list[PodRef]]:
        """Physical device id → containers holding it; {} when kubelet cannot be asked."""
        return self.pod_devices_known(units, claimable) or {}

    def pod_devices_known(
        self, units: Units, claimable: Claimable | None = None
    ) -> dict[str, list[PodRef]] | None:
        """As `pod_devices`, but None when kubelet could not be asked: an action that must not
        touch a held device (a reset) cannot take "no answer" for "no pods"."""
        with self._lock:
            try:
                response = self._list()
            except Exception as exc:  # a scrape must never fail on attribution
                self._report(_describe(exc))
                return None
            if response is None:
                self._problem = None  # absent socket: quiet, and a later failure is news again
                return None
            if self._problem is not None:
                self._log.info("pod-resources API answers again")
                self._problem = None
        return attribute(response, units, claimable)

    def close(self) -> None:
        """Nothing is held between calls; kept for the callers that close what they made."""

    def _list(self) -> api_pb2.ListPodResourcesResponse | None:
        if not self.socket_path.exists():
            return None
        with grpc.insecure_channel(f"unix://{self.socket_path}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
            response: api_pb2.ListPodResourcesResponse = stub.List(
                api_pb2.ListPodResourcesRequest(), timeout=self.timeout
            )
        return response

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            self._log.warning("pod-resources API failed; pods left off metrics", error=problem)
            self._problem = problem


def pod_devices(
    socket_path: str | os.PathLike[str], timeout: float, units: Units
) -> dict[str, list[PodRef]]:
    """One-shot `PodResourcesClient(...).pod_devices(units)`; long-lived callers keep a client."""
    client = PodResourcesClient(socket_path, timeout=timeout)
    try:
        return client.pod_devices(units)
    finally:
        client.close()


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
