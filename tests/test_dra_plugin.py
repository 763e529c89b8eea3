"""The DRA kubelet plugin (edl_agent.dra.kubelet_plugin) as kubelet sees it: registration, the
DRA plugin API and the device-health stream, over a real unix socket, with gRPC clients built
from the generated stubs."""

from __future__ import annotations

import contextlib
import queue
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import pytest

from edl_agent._proto.dra.v1 import api_pb2 as dra_pb2
from edl_agent._proto.dra.v1 import api_pb2_grpc as dra_grpc
from edl_agent._proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from edl_agent._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from edl_agent._proto.pluginregistration.v1 import api_pb2 as registration_pb2
from edl_agent._proto.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from edl_agent.dra.kubelet_plugin import DraPluginServer, socket_path
from edl_agent.dra.prepare import ClaimRef
from tests.test_dra_prepare import (
    DRIVER,
    GPU_CDI,
    NODE,
    ClaimApi,
    Node,
    claim_cdi_id,
    gpus,
    resource_claim,
    result,
)


class HealthBoard:
    """Device health that tests set by hand, published the way the agent's device state is."""

    def __init__(self, health: Mapping[str, tuple[bool, str]]) -> None:
        self._changed = threading.Condition()
        self._version = 1
        self._health = dict(health)

    def snapshot(self) -> tuple[int, Mapping[str, tuple[bool, str]]]:
        with self._changed:
            return self._version, dict(self._health)

    def set(self, name: str, healthy: bool, message: str = "") -> None:
        with self._changed:
            self._health[name] = (healthy, message)
            self._version += 1
            self._changed.notify_all()

    def touch(self) -> None:
        """A new version with the same health (something else about the devices changed)."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def wait_newer(self, version: int, timeout: float, cancel: threading.Event) -> bool:
        with self._changed:
            self._changed.wait_for(
                lambda: cancel.is_set() or self._version > version, timeout=timeout
            )
            return not cancel.is_set() and self._version > version

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class HealthWatch:
    """A NodeWatchResources stream, as kubelet holds it, read on its own thread."""

    def __init__(self, channel: grpc.Channel) -> None:
        stub = health_grpc.DRAResourceHealthStub(channel)  # type: ignore[no-untyped-call]
        self.updates: queue.Queue[health_pb2.NodeWatchResourcesResponse] = queue.Queue()
        self.ended = threading.Event()
        self._call = stub.NodeWatchResources(health_pb2.NodeWatchResourcesRequest())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for update in self._call:
                self.updates.put(update)
        self.ended.set()

    def next(self, timeout: float = 5) -> health_pb2.NodeWatchResourcesResponse:
        return self.updates.get(timeout=timeout)

    def cancel(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)


def health_of(update: health_pb2.NodeWatchResourcesResponse) -> dict[str, tuple[int, str]]:
    return {d.device.device_name: (d.health, d.message) for d in update.devices}


class Plugin:
    """One driver's plugin server on a node, and kubelet's side of its socket."""

    def __init__(self, node: Node, registry: Path, *, timeout_seconds: int = 30) -> None:
        self.node = node
        self.board = HealthBoard(dict.fromkeys(node.devices, (True, "")))
        self.server = DraPluginServer(
            driver=DRIVER,
            socket_path=socket_path(registry, DRIVER),
            preparer=node.preparer,
            health=self.board,
            timeout_seconds=timeout_seconds,
        )
        self.server.start()
        self.channel = grpc.insecure_channel(f"unix://{self.server.path}")
        self.dra = dra_grpc.DRAPluginStub(self.channel)  # type: ignore[no-untyped-call]
        self.registration = registration_grpc.RegistrationStub(self.channel)  # type: ignore[no-untyped-call]

    def prepare(self, *claims: ClaimRef) -> dict[str, dra_pb2.NodePrepareResourceResponse]:
        request = dra_pb2.NodePrepareResourcesRequest(claims=[_claim(c) for c in claims])
        return dict(self.dra.NodePrepareResources(request, timeout=5).claims)

    def unprepare(self, *claims: ClaimRef) -> dict[str, str]:
        request = dra_pb2.NodeUnprepareResourcesRequest(claims=[_claim(c) for c in claims])
        response = self.dra.NodeUnprepareResources(request, timeout=5)
        return {uid: answer.error for uid, answer in response.claims.items()}

    def watch(self) -> HealthWatch:
        return HealthWatch(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop()


def _claim(claim: ClaimRef) -> dra_pb2.Claim:
    return dra_pb2.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)


@pytest.fixture
def registry() -> Iterator[Path]:
    """Kubelet's plugins_registry directory, short enough for unix socket paths."""
    with tempfile.TemporaryDirectory(prefix="dra-", dir="/tmp") as directory:
        yield Path(directory)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(root=tmp_path, api=ClaimApi(), devices=gpus(3))


@pytest.fixture
def plugin(node: Node, registry: Path) -> Iterator[Plugin]:
    serving = Plugin(node, registry)
    yield serving
    serving.stop()


def test_the_socket_is_named_after_the_driver() -> None:
    registry = Path("/var/lib/kubelet/plugins_registry")
    assert socket_path(registry, DRIVER) == registry / "gpu.nvidia.edl.io.sock"


def test_registration_names_the_driver_and_the_dra_service(plugin: Plugin) -> None:
    info = plugin.registration.GetInfo(registration_pb2.InfoRequest(), timeout=5)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == ""  # kubelet then calls the DRA services on this socket
    # The health service too: kubelet 1.37 opens the health stream only to a plugin naming it.
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
    assert not plugin.server.registered.is_set()

    refused = registration_pb2.RegistrationStatus(plugin_registered=False, error="no handler")
    plugin.registration.NotifyRegistrationStatus(refused, timeout=5)
    assert not plugin.server.registered.is_set()
    assert plugin.server.registration_error == "no handler"

    accepted = registration_pb2.RegistrationStatus(plugin_registered=True)
    plugin.registration.NotifyRegistrationStatus(accepted, timeout=5)
    assert plugin.server.registered.is_set()
    assert plugin.server.registration_error is None


def test_prepare_and_unprepare_round_trip(plugin: Plugin) -> None:
    api = plugin.node.api
    shared = api.add(
        resource_claim(
            "uid-1",
            [result("gpu-1", share_id="share-1", consumed={"memory": "4Gi", "cores": "25"})],
            name="shared",
        )
    )
    pending = api.add(resource_claim("uid-2", None, name="pending"))
    answers = plugin.prepare(shared, pending)
    assert set(answers) == {"uid-1", "uid-2"}
    assert answers["uid-1"].error == ""
    [device] = answers["uid-1"].devices
    assert list(device.request_names) == ["gpu"]
    assert device.pool_name == NODE
    assert device.device_name == "gpu-1"
    assert list(device.cdi_device_ids) == [f"{GPU_CDI}=gpu-1", claim_cdi_id("uid-1")]
    assert device.HasField("share_id")
    assert device.share_id == "share-1"
    assert "not allocated" in answers["uid-2"].error
    assert not answers["uid-2"].devices
    assert plugin.node.cdi.path("uid-1").exists()

    # A whole device carries no share id.
    whole = api.add(resource_claim("uid-3", [result("gpu-2")], name="whole"))
    [device] = plugin.prepare(whole)["uid-3"].devices
    assert not device.HasField("share_id")

    assert plugin.prepare(shared) == {"uid-1": answers["uid-1"]}  # idempotent
    assert api.reads == 3

    assert plugin.unprepare(shared, pending, whole) == {"uid-1": "", "uid-2": "", "uid-3": ""}
    assert not plugin.node.cdi.path("uid-1").exists()
    assert not plugin.node.cdi.path("uid-3").exists()
    assert plugin.node.preparer.held() == {}
    assert plugin.unprepare(shared) == {"uid-1": ""}


def test_a_restarted_plugin_answers_what_it_answered_before(node: Node, registry: Path) -> None:
    first = Plugin(node, registry)
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    answer = first.prepare(claim)["uid-1"]
    assert answer.error == ""
    first.stop()
    assert not first.server.path.exists()

    node.restart()
    del node.api.claims[("team-a", "train")]  # the API server does not answer any more
    second = Plugin(node, registry)
    try:
        assert second.prepare(claim) == {"uid-1": answer}
        assert node.cdi.writes == 1
        assert node.preparer.held() == {"gpu-0": frozenset({"uid-1"})}
        assert second.unprepare(claim) == {"uid-1": ""}
        assert not node.cdi.path("uid-1").exists()
    finally:
        second.stop()
    node.restart()
    assert node.checkpoint.claims() == ()


def test_the_health_stream_sends_all_devices_then_each_change(plugin: Plugin) -> None:
    watch = plugin.watch()
    try:
        before = time.time()
        first = watch.next()
        healthy = health_pb2.HEALTHY
        assert health_of(first) == {
            "gpu-0": (healthy, ""),
            "gpu-1": (healthy, ""),
            "gpu-2": (healthy, ""),
        }
        for device in first.devices:
            assert device.device.pool_name == NODE
            assert device.health_check_timeout_seconds == 30
            assert before - 1 <= device.last_updated_time <= time.time()

        plugin.board.set("gpu-1", False, "Xid 79: GPU has fallen off the bus")
        changed = watch.next()
        assert health_of(changed)["gpu-1"] == (
            health_pb2.UNHEALTHY,
            "Xid 79: GPU has fallen off the bus",
        )
        assert len(changed.devices) == 3

        plugin.board.set("gpu-2", False, "x" * 5000)
        [message] = [d.message for d in watch.next().devices if d.device.device_name == "gpu-2"]
        assert len(message) == 1024
        assert message.endswith("...")

        plugin.board.touch()  # nothing kubelet sees changed: nothing is sent
        with pytest.raises(queue.Empty):
            watch.next(timeout=0.5)
    finally:
        watch.cancel()


def test_the_health_stream_repeats_itself_within_the_timeout(node: Node, registry: Path) -> None:
    plugin = Plugin(node, registry, timeout_seconds=3)
    watch = plugin.watch()
    try:
        first = watch.next()
        started = time.monotonic()
        again = watch.next(timeout=3)
        waited = time.monotonic() - started
        assert 0.3 <= waited <= 2.5  # every third of the 3 s timeout
        assert health_of(again) == health_of(first)
        assert again.devices[0].health_check_timeout_seconds == 3
        assert again.devices[0].last_updated_time >= first.devices[0].last_updated_time
    finally:
        watch.cancel()
        plugin.stop()


def test_stop_ends_the_health_streams_and_removes_the_socket(node: Node, registry: Path) -> None:
    plugin = Plugin(node, registry)
    watches = [plugin.watch(), plugin.watch()]
    for watch in watches:
        watch.next()
    path = plugin.server.path
    assert path.exists()
    assert plugin.server.serving()
    started = time.monotonic()
    plugin.server.stop()
    assert time.monotonic() - started < 2
    for watch in watches:
        assert watch.ended.wait(timeout=5)
    assert not path.exists()
    assert not plugin.server.serving()
    plugin.channel.close()


def test_a_socket_replaced_by_someone_else_is_left_to_them(plugin: Plugin) -> None:
    path = plugin.server.path
    path.unlink()  # kubelet's plugin directory being cleaned up
    assert not plugin.server.serving()
    path.write_text("someone else's", encoding="utf-8")
    plugin.server.stop()
    assert path.read_text(encoding="utf-8") == "someone else's"
    path.unlink()


def test_a_stopped_plugin_serves_again_on_start(plugin: Plugin) -> None:
    plugin.server.stop()
    plugin.server.start()
    watch = plugin.watch()
    try:
        assert len(watch.next().devices) == 3
        info = plugin.registration.GetInfo(registration_pb2.InfoRequest(), timeout=5)
        assert info.name == DRIVER
    finally:
        watch.cancel()
