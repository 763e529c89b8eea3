"""The committed gRPC stubs match what protos/ generates, and speak kubelet's wire format
(device plugin, DRA plugin, DRA device health, plugin registration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2
from edl_agent._proto.dra.v1 import api_pb2 as dra
from edl_agent._proto.drahealth.v1alpha1 import api_pb2 as health
from edl_agent._proto.pluginregistration.v1 import api_pb2 as registration

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/gen-protos"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_field_numbers_follow_kubelet() -> None:
    fields = {
        (message.name, field.name): field.number
        for message in api_pb2.DESCRIPTOR.message_types_by_name.values()
        for field in message.fields
    }
    assert fields[("RegisterRequest", "resource_name")] == 3
    assert fields[("RegisterRequest", "options")] == 4
    assert fields[("ContainerPreferredAllocationRequest", "allocation_size")] == 3
    assert fields[("ContainerAllocateResponse", "cdi_devices")] == 5
    assert fields[("Device", "topology")] == 3
    assert api_pb2.DESCRIPTOR.package == "v1beta1"
    services = api_pb2.DESCRIPTOR.services_by_name
    assert set(services) == {"Registration", "DevicePlugin"}
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]


def test_wire_bytes_match_a_hand_encoded_register_request() -> None:
    request = api_pb2.RegisterRequest(version="v1beta1", endpoint="a.sock", resource_name="x/y")
    # field 1 (len 7) "v1beta1", field 2 (len 6) "a.sock", field 3 (len 3) "x/y"
    assert request.SerializeToString() == b"\n\x07v1beta1\x12\x06a.sock\x1a\x03x/y"


def test_dra_services_keep_kubelets_names() -> None:
    # A gRPC method's path is /<package>.<service>/<method>: these names are the wire contract.
    paths = {
        f"/{service.full_name}/{method.name}"
        for module in (dra, health, registration)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert paths == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    }
    watch = health.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods[0]
    assert watch.server_streaming
    assert not watch.client_streaming
    assert dra.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert dict(health.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_dra_wire_bytes_match_hand_encoded_messages() -> None:
    # Claim: namespace 1, uid 2, name 3.
    claim = dra.Claim(namespace="ns", uid="u", name="n")
    assert claim.SerializeToString() == b"\n\x02ns\x12\x01u\x1a\x01n"
    # Device: request_names 1, pool_name 2, device_name 3, cdi_device_ids 4, share_id 5.
    device = dra.Device(
        request_names=["r"], pool_name="p", device_name="d", cdi_device_ids=["c"], share_id="s"
    )
    assert device.SerializeToString() == b"\n\x01r\x12\x01p\x1a\x01d\x22\x01c\x2a\x01s"
    # claims 1 is a map: entries of key 1 (the uid) and value 2 (error 2 inside).
    response = dra.NodePrepareResourcesResponse(
        claims={"u": dra.NodePrepareResourceResponse(error="e")}
    )
    assert response.SerializeToString() == b"\n\x08\n\x01u\x12\x03\x12\x01e"
    unprepared = dra.NodeUnprepareResourcesResponse(
        claims={"u": dra.NodeUnprepareResourceResponse(error="e")}
    )
    assert unprepared.SerializeToString() == b"\n\x08\n\x01u\x12\x03\n\x01e"
    # DeviceHealth: device 1 {pool_name 1, device_name 2}, health 2, last_updated_time 3,
    # health_check_timeout_seconds 4, message 5.
    device_health = health.DeviceHealth(
        device=health.DeviceIdentifier(pool_name="p", device_name="d"),
        health=health.UNHEALTHY,
        last_updated_time=300,
        health_check_timeout_seconds=30,
        message="m",
    )
    expected = b"\n\x06\n\x01p\x12\x01d\x10\x02\x18\xac\x02\x20\x1e\x2a\x01m"
    assert device_health.SerializeToString() == expected
    watched = health.NodeWatchResourcesResponse(devices=[device_health])
    assert watched.SerializeToString() == b"\n" + bytes([len(expected)]) + expected
    # PluginInfo: type 1, name 2, endpoint 3, supported_versions 4.
    info = registration.PluginInfo(
        type="DRAPlugin", name="x", endpoint="e", supported_versions=["v1.DRAPlugin"]
    )
    assert info.SerializeToString() == b"\n\tDRAPlugin\x12\x01x\x1a\x01e\x22\x0cv1.DRAPlugin"
    # RegistrationStatus: plugin_registered 1, error 2.
    status = registration.RegistrationStatus(plugin_registered=True, error="e")
    assert status.SerializeToString() == b"\x08\x01\x12\x01e"
