"""The kubelet DevicePlugin service for one resource: gRPC in, pure decisions, gRPC out."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping

import grpc
import structlog

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from edl_agent.config import PluginSettings
from edl_agent.devices.container import AllocationError
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, ResourceUnit
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.plugin import allocation, preferred
from edl_agent.threaded_servicer import CallContext


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(
        self,
        *,
        resource: str,
        state: DeviceState,
        settings: PluginSettings,
        root: HostRoot,
    ) -> None:
        self.resource = resource
        self._state = state
        self._settings = settings
        self._root = root
        self._stopping = threading.Event()
        self._streams: set[threading.Event] = set()  # each open stream's end
        self._streams_lock = threading.Lock()
        self._log = structlog.get_logger().bind(resource=resource)

    def stop(self) -> None:
        """End every ListAndWatch stream of this service."""
        with self._streams_lock:
            self._stopping.set()
            streams = list(self._streams)
        for ended in streams:
            ended.set()
        self._state.wake()

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: CallContext
    ) -> api_pb2.DevicePluginOptions:
        return plugin_options(self._settings)

    def ListAndWatch(
        self, request: api_pb2.Empty, context: CallContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        # The stream waits for a newer snapshot, its call's end (kubelet gone) or the service's
        # stop, with no timeout: each of those sets `ended` before it wakes the waiters, so a
        # wake-up that comes before the wait begins is not lost.
        ended = threading.Event()

        def end() -> None:
            ended.set()
            self._state.wake()

        with self._streams_lock:
            self._streams.add(ended)
            if self._stopping.is_set():
                ended.set()
        if not context.add_callback(end):
            ended.set()
        try:
            yield from self._watch(context, ended)
        finally:
            with self._streams_lock:
                self._streams.discard(ended)
        self._log.info("list and watch ended")

    def _watch(
        self, context: CallContext, ended: threading.Event
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        snapshot = self._state.snapshot()
        sent = self._device_list(snapshot)
        self._log.info("list and watch started", devices=len(sent.devices))
        yield sent
        while not ended.is_set() and context.is_active():
            newer = self._state.wait_newer(snapshot.version, None, ended)
            if newer is None:
                if self._state.closed:
                    break
                continue
            snapshot = newer
            update = self._device_list(snapshot)
            if update != sent:
                unhealthy = [d.ID for d in update.devices if d.health != "Healthy"]
                self._log.info(
                    "device list changed", devices=len(update.devices), unhealthy=len(unhealthy)
                )
                sent = update
                yield update

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: CallContext
    ) -> api_pb2.PreferredAllocationResponse:
        snapshot = self._state.snapshot()
        units = snapshot.units.get(self.resource, {})
        unhealthy = snapshot.unavailable
        responses = []
        for request_one in request.container_requests:
            choice = preferred.preferred_allocation(
                available=list(request_one.available_deviceIDs),
                must_include=list(request_one.must_include_deviceIDs),
                size=request_one.allocation_size,
                units=units,
                devices=snapshot.devices,
                unhealthy=unhealthy,
                placement=self._settings.slice_placement,
            )
            if choice.fallback_reason is not None:
                self._log.warning("preferred allocation fell back", reason=choice.fallback_reason)
            self._log.info(
                "preferred allocation",
                ids=list(choice.ids),
                available=len(request_one.available_deviceIDs),
                must_include=list(request_one.must_include_deviceIDs),
            )
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=choice.ids))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: CallContext
    ) -> api_pb2.AllocateResponse:
        snapshot = self._state.snapshot()
        units = snapshot.units.get(self.resource, {})
        unhealthy = snapshot.withdrawn
        responses = []
        for container in request.container_requests:
            try:
                granted = allocation.allocate(
                    requested_ids=list(container.devices_ids),
                    units=units,
                    devices=snapshot.devices,
                    unhealthy=unhealthy,
                    existing_paths=self._existing_paths(snapshot, units, container.devices_ids),
                    settings=self._settings,
                )
            except AllocationError as exc:
                code = (
                    grpc.StatusCode.INVALID_ARGUMENT
                    if exc.kind == "invalid_argument"
                    else grpc.StatusCode.FAILED_PRECONDITION
                )
                self._log.warning(
                    "allocate refused", ids=list(container.devices_ids), error=str(exc)
                )
                context.abort(code, str(exc))
            held = self._state.hand_out(
                {units[i].device_id for i in container.devices_ids}, time.monotonic()
            )
            if held:
                message = f"held by a DRA claim: {', '.join(sorted(held))}"
                self._log.warning(
                    "allocate refused", ids=list(container.devices_ids), error=message
                )
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
            responses.append(to_response(granted))
            self._log.info("allocated", ids=list(container.devices_ids))
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: CallContext
    ) -> api_pb2.PreStartContainerResponse:
        self._log.debug("pre-start container", ids=list(request.devices_ids))
        return api_pb2.PreStartContainerResponse()

    def _device_list(self, snapshot: Snapshot) -> api_pb2.ListAndWatchResponse:
        resource = snapshot.resources.get(self.resource)
        devices = []
        for unit in resource.units if resource is not None else ():
            device = snapshot.devices.get(unit.device_id)
            numa = device.numa_node if device is not None else None
            topology = (
                api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)])
                if numa is not None
                else None
            )
            devices.append(
                api_pb2.Device(
                    ID=unit.id, health=snapshot.unit_health(unit).value, topology=topology
                )
            )
        return api_pb2.ListAndWatchResponse(devices=devices)

    def _existing_paths(
        self, snapshot: Snapshot, units: Mapping[str, ResourceUnit], ids: Iterable[str]
    ) -> frozenset[str]:
        """Which of the nodes the answer may name exist right now (read at every Allocate:
        health polling may not have noticed a node that just went)."""
        devices: list[Device] = []
        for unit_id in ids:
            unit = units.get(unit_id)
            device = snapshot.devices.get(unit.device_id) if unit is not None else None
            while device is not None:
                devices.append(device)
                device = snapshot.devices.get(device.parent) if device.parent else None
        paths = allocation.paths_to_check(devices, self._settings)
        return frozenset(path for path in paths if self._root.exists(path))


def plugin_options(settings: PluginSettings) -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(
        pre_start_required=settings.pre_start_required,
        get_preferred_allocation_available=True,
    )


def to_response(granted: allocation.ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=dict(granted.envs),
        mounts=[
            api_pb2.Mount(
                container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
            )
            for m in granted.mounts
        ],
        devices=[
            api_pb2.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in granted.devices
        ],
        annotations=dict(granted.annotations),
        cdi_devices=[api_pb2.CDIDevice(name=name) for name in granted.cdi_devices],
    )
