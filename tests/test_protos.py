"""The committed gRPC stubs match what protos/ generates, and speak kubelet's wire format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2

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
