"""The ConfigMap Volcano's Ascend scheduling reads (`mindx-dl-deviceinfo-<node>`): its shape, the
CheckCode recomputed here from the published algorithm, fault levels, the unhealthy lists; and the
writer part against a fake API (our own boundary): it creates, replaces only on a change or the
refresh, and retries a failed call."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.agent import Agent
from edl_agent.config import load_settings
from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.health.model import ClearsBy, Level
from edl_agent.health.state import DeviceState
from edl_agent.health.tracker import Condition
from edl_agent.kube import ApiError
from edl_agent.labels.volcano_deviceinfo import (
    BASE_DEVICE_INFOS,
    NpuReport,
    base_device_infos,
    check_code,
    configmap,
    configmap_data,
    go_json,
    npu_report,
)
from edl_agent.labels.volcano_writer import VolcanoDeviceInfo, next_update_time, write_due
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.mindcluster_check import check, checker
from tests.parts import supervised
from tests.waiting import wait_for

SINCE = 1000.0  # monotonic
WALL_OFFSET = 1_780_000_000.0  # wall = monotonic + this
SPEC_DEVICE_INFO = {
    # MindCluster's system-test spec (tests/st/spec/910ax8.py): a DeviceInfo and its CheckCode.
    "DeviceList": {
        "huawei.com/Ascend910": "Ascend910-0,Ascend910-1,Ascend910-2,Ascend910-3,"
        "Ascend910-4,Ascend910-5,Ascend910-6,Ascend910-7",
        "huawei.com/Ascend910-NetworkUnhealthy": "",
    },
    "UpdateTime": 1720679215,
}
SPEC_CHECK_CODE = "0c1aaed0a363a68edfa245b38dad622e9ac6e3a73751217ca7b6198fa6b14a9e"


def npu(i: int, product: str = "Ascend910B3") -> Device:
    return Device(Vendor.ASCEND, "npu", i, f"ascend-npu{i}", product, 65536)


def fault(reason: str, detail: str = "", level: Level = Level.DEVICE_FATAL, **kw: Any) -> Condition:
    return Condition(reason, level, since=SINCE, last_seen=SINCE, detail=detail, **kw)


def report(
    devices: list[Device],
    conditions: Mapping[str, Condition] | None = None,
    unhealthy: set[str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> NpuReport:
    made = npu_report(
        devices=devices,
        unhealthy=unhealthy or set(conditions or {}),
        conditions=conditions or {},
        overrides=overrides,
    )
    assert made is not None
    return made


def parsed(rep: NpuReport, update_time: int = 1780000100) -> dict[str, Any]:
    data = configmap_data(rep, update_time=update_time, wall_offset=WALL_OFFSET)
    cfg: dict[str, Any] = json.loads(data["DeviceInfoCfg"])
    return cfg


def faults_of(cfg: Mapping[str, Any], key: str = "huawei.com/Ascend910") -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = json.loads(cfg["DeviceInfo"]["DeviceList"][key + "-Fault"])
    return listed


def independent_check_code(device_info: Mapping[str, Any]) -> str:
    """The published algorithm, written again: SHA-256 over Go's compact JSON of
    {DeviceList (keys sorted), UpdateTime}."""
    body = (
        '{"DeviceList":'
        + json.dumps(
            device_info["DeviceList"], sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        + ',"UpdateTime":'
        + str(device_info["UpdateTime"])
        + "}"
    )
    return hashlib.sha256(body.encode()).hexdigest()


# --- CheckCode -----------------------------------------------------------------------------------


def test_the_check_code_of_mindclusters_published_example() -> None:
    assert check_code(SPEC_DEVICE_INFO) == SPEC_CHECK_CODE
    assert independent_check_code(SPEC_DEVICE_INFO) == SPEC_CHECK_CODE


def test_the_written_check_code_is_the_hash_of_the_written_device_info() -> None:
    rep = report([npu(i) for i in range(8)], {"ascend-npu3": fault("NPU_FAULT_0x80E18402")})
    cfg = parsed(rep)
    assert cfg["CheckCode"] == independent_check_code(cfg["DeviceInfo"])
    assert list(cfg) == ["DeviceInfo", "SuperPodID", "ServerIndex", "CheckCode"]
    assert list(cfg["DeviceInfo"]) == ["DeviceList", "UpdateTime"]
    assert cfg["DeviceInfo"]["UpdateTime"] == 1780000100
    assert (cfg["SuperPodID"], cfg["ServerIndex"]) == (-2, -2)


@given(st.dictionaries(st.text(), st.text(), max_size=5), st.integers(0, 2**40))
def test_go_json_matches_the_independent_hash_for_any_strings(
    device_list: dict[str, str], update_time: int
) -> None:
    info = {"DeviceList": device_list, "UpdateTime": update_time}
    if any(c in "<>&\u2028\u2029" for text in device_list.items() for c in "".join(text)):
        return  # Go escapes these (see the next test); json.dumps does not
    assert check_code(info) == independent_check_code(info)


def test_go_json_escapes_as_go_does() -> None:
    assert go_json({"a": "<&>\u2028\u2029é"}) == '{"a":"\\u003c\\u0026\\u003e\\u2028\\u2029é"}'


@pytest.mark.timeout(900)  # the first run builds the checker (about a minute on 2 cores)
def test_mindclusters_own_code_reads_and_writes_it_so() -> None:
    """MindCluster's device-plugin code parses what we write, computes the same CheckCode and
    marshals the parsed value back to the very same bytes (fault lists included)."""
    binary = checker()
    conditions = {
        "ascend-npu1": fault("NPU_FAULT_0x8C0E4E00", "fault codes 0x8C0E4E00, 0x80E3A201 <&>"),
        "ascend-npu3": fault("NPU_HEALTH_ALARM", clears_by=ClearsBy.RELEASE),
        "ascend-npu4": fault("NPU_FAULT_0x80E01801", level=Level.NODE_FATAL),
    }
    devices = [npu(i) for i in range(8)] + [npu(8, "Ascend310P3")]
    rep = report(devices, conditions, unhealthy={*conditions, "ascend-npu6"})
    data = configmap_data(rep, update_time=1780000100, wall_offset=WALL_OFFSET)
    accepted, output = check(binary, json.dumps(data))
    assert accepted, output

    cfg = json.loads(data["DeviceInfoCfg"])
    cfg["DeviceInfo"]["UpdateTime"] += 1  # a CheckCode that no longer matches
    accepted, output = check(binary, json.dumps({**data, "DeviceInfoCfg": go_json(cfg)}))
    assert not accepted
    assert "CheckCode" in output


# --- shape and lists -----------------------------------------------------------------------------


def test_the_configmap_object() -> None:
    rep = report([npu(0), npu(1)])
    data = configmap_data(rep, update_time=5, wall_offset=0.0)
    body = configmap("node-a", data)
    assert body["metadata"] == {
        "name": "mindx-dl-deviceinfo-node-a",
        "namespace": "kube-system",
        "labels": {"mx-consumer-cim": "true"},
    }
    assert set(body["data"]) == {"DeviceInfoCfg", "ManuallySeparateNPU", "UpgradeFaultReason"}
    assert body["data"]["ManuallySeparateNPU"] == ""
    assert body["data"]["UpgradeFaultReason"] == "{}"
    devices = json.loads(data["DeviceInfoCfg"])["DeviceInfo"]["DeviceList"]
    assert devices == {
        "huawei.com/Ascend910": "Ascend910-0,Ascend910-1",
        "huawei.com/Ascend910-Fault": "[]",
        "huawei.com/Ascend910-NetworkUnhealthy": "",
        "huawei.com/Ascend910-Recovering": "",
        "huawei.com/Ascend910-Unhealthy": "",
    }
    assert list(devices) == sorted(devices)


def test_unhealthy_npus_leave_the_available_list_sorted_by_number() -> None:
    devices = [npu(i) for i in (10, 2, 0, 1)]
    conditions = {"ascend-npu2": fault("NPU_HEALTH_ALARM"), "ascend-npu10": fault("NPU_MISSING")}
    lists = parsed(report(devices, conditions))["DeviceInfo"]["DeviceList"]
    assert lists["huawei.com/Ascend910"] == "Ascend910-0,Ascend910-1"
    assert lists["huawei.com/Ascend910-Unhealthy"] == "Ascend910-2,Ascend910-10"
    assert [f["npu_name"] for f in faults_of(parsed(report(devices, conditions)))] == [
        "Ascend910-2",
        "Ascend910-10",
    ]


def test_each_chip_family_has_its_keys_and_310p_has_no_network_lists() -> None:
    devices = [npu(0, "Ascend310P3"), npu(1, "Ascend310P3"), npu(2, "310"), npu(3, "unknown")]
    rep = report(devices, {"ascend-npu1": fault("NPU_HEALTH_CRITICAL")})
    lists = parsed(rep)["DeviceInfo"]["DeviceList"]
    assert lists == {
        "huawei.com/Ascend310": "Ascend310-2",
        "huawei.com/Ascend310-Fault": "[]",
        "huawei.com/Ascend310-Unhealthy": "",
        "huawei.com/Ascend310P": "Ascend310P-0",
        "huawei.com/Ascend310P-Fault": lists["huawei.com/Ascend310P-Fault"],
        "huawei.com/Ascend310P-Unhealthy": "Ascend310P-1",
    }
    assert faults_of(parsed(rep), "huawei.com/Ascend310P")[0]["npu_name"] == "Ascend310P-1"


def test_no_ascend_npu_no_report() -> None:
    gpu = Device(Vendor.NVIDIA, "gpu", 0, "GPU-0", "H100", 81559)
    assert npu_report(devices=[gpu, npu(1, "")], unhealthy=set(), conditions={}) is None


def test_a_device_unhealthy_by_discovery_alone_is_listed_with_no_code() -> None:
    entry = faults_of(parsed(report([npu(0)], {}, unhealthy={"ascend-npu0"})))[0]
    assert entry["fault_code"] == ""
    assert entry["fault_level"] == "SeparateNPU"
    assert entry["fault_time_and_level_map"] == {}


# --- fault levels --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("condition", "level", "codes"),
    [
        # The table says SeparateNPU.
        (fault("NPU_FAULT_0x80E18402", "fault codes 0x80E18402 (SeparateNPU)"), "SeparateNPU",
         {"80E18402": "SeparateNPU"}),
        # The code only restarts the job, but our decision took the chip out until a reset.
        (fault("NPU_FAULT_0x80E01801"), "RestartNPU", {"80E01801": "RestartBusiness"}),
        # Two codes: the worst decides; the map keeps each code's own level.
        (fault("NPU_FAULT_0x8C0E4E00", "fault codes 0x8C0E4E00, 0x80E3A201"), "SeparateNPU",
         {"8C0E4E00": "FreeRestartNPU", "80E3A201": "SeparateNPU"}),
        # A code the table lacks takes our condition's level.
        (fault("NPU_FAULT_0x81234567", level=Level.NODE_FATAL), "SeparateNPU",
         {"81234567": "SeparateNPU"}),
        # No code: our level; out until a person releases it reads SeparateNPU.
        (fault("NPU_HEALTH_ALARM"), "RestartNPU", {}),
        (fault("NPU_HEALTH_ALARM", clears_by=ClearsBy.RELEASE), "SeparateNPU", {}),
    ],
)  # fmt: skip
def test_fault_levels(condition: Condition, level: str, codes: dict[str, str]) -> None:
    entry = faults_of(parsed(report([npu(0), npu(1)], {"ascend-npu1": condition})))[0]
    assert list(entry) == [
        "fault_type",
        "npu_name",
        "large_model_fault_level",
        "fault_level",
        "fault_handling",
        "fault_code",
        "fault_time_and_level_map",
    ]
    assert entry["fault_type"] == "CardUnhealthy"
    assert entry["npu_name"] == "Ascend910-1"
    assert entry["fault_level"] == entry["fault_handling"] == level
    assert entry["large_model_fault_level"] == level
    assert entry["fault_code"] == ",".join(codes)
    millis = round((SINCE + WALL_OFFSET) * 1000)
    assert entry["fault_time_and_level_map"] == {
        code: {"fault_time": millis, "fault_level": own} for code, own in codes.items()
    }


def test_an_operators_override_sets_the_codes_level() -> None:
    overrides = {"0x80E01801": "node_fatal"}
    rep = report([npu(0)], {"ascend-npu0": fault("NPU_FAULT_0x80E01801")}, overrides=overrides)
    entry = faults_of(parsed(rep))[0]
    assert entry["fault_level"] == "SeparateNPU"
    assert entry["fault_time_and_level_map"]["80E01801"]["fault_level"] == "SeparateNPU"


# --- when to write -------------------------------------------------------------------------------


def test_update_time_rises_by_a_second_at_least() -> None:
    assert next_update_time(100.7, None) == 100
    assert next_update_time(100.7, 99) == 100
    assert next_update_time(100.7, 100) == 101
    assert next_update_time(90.0, 120) == 121  # the wall clock went back


def test_write_only_on_a_change_or_the_refresh() -> None:
    a, b = report([npu(0)]), report([npu(0)], {"ascend-npu0": fault("NPU_HEALTH_ALARM")})
    assert write_due(a, None, now=0.0, refresh_at=300.0)
    assert not write_due(a, report([npu(0)]), now=299.0, refresh_at=300.0)
    assert write_due(b, a, now=1.0, refresh_at=300.0)
    assert write_due(a, a, now=300.0, refresh_at=300.0)


def test_base_device_infos_lists_every_npu_with_its_address() -> None:
    with_ip = Device(
        Vendor.ASCEND, "npu", 10, "ascend-npu10", "Ascend910B3", 65536,
        attributes={"device_ip": "192.168.100.11"},
    )  # fmt: skip
    value = base_device_infos([npu(2), with_ip, npu(0, "Ascend310P3")])
    assert value == (
        '{"Ascend310P-0":{"IP":"","SuperDeviceID":0},'
        '"Ascend910-10":{"IP":"192.168.100.11","SuperDeviceID":0},'
        '"Ascend910-2":{"IP":"","SuperDeviceID":0}}'
    )  # Go's map order: keys sorted as strings
    assert base_device_infos([Device(Vendor.NVIDIA, "gpu", 0, "GPU-0", "H100", 1)]) is None


def test_the_writer_annotates_the_node_once_per_inventory() -> None:
    api, clock, conditions = FakeApi(), Clock(), {}
    writer, state = writer_for(api, conditions, clock, [npu(0), npu(1)])
    writer.sync()
    assert json.loads(api.annotations[BASE_DEVICE_INFOS]) == {
        "Ascend910-0": {"IP": "", "SuperDeviceID": 0},
        "Ascend910-1": {"IP": "", "SuperDeviceID": 0},
    }
    conditions["ascend-npu1"] = fault("NPU_FAULT_0x80E18402")
    state.set_unhealthy({"ascend-npu1"})
    writer.sync()  # an unhealthy NPU is still one of the node's
    assert [call[0] for call in api.calls].count("PATCH") == 1


# --- the writer, on a fake API -------------------------------------------------------------------


class FakeApi:
    """ConfigMaps in memory, as the API server answers PUT and POST, and the Node's annotations
    as a merge patch leaves them; `fail` makes calls fail."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.annotations: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail = 0

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", f"/api/v1/nodes/{name}"))
        if self.fail:
            self.fail -= 1
            raise ApiError(503, "unavailable")
        self.annotations.update(patch["metadata"]["annotations"])
        return {"metadata": {"name": name, "annotations": dict(self.annotations)}}

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, **_: Any
    ) -> dict[str, Any]:
        self.calls.append((method, path))
        if self.fail:
            self.fail -= 1
            raise ApiError(503, "unavailable")
        assert body is not None
        name = body["metadata"]["name"]
        if method == "PUT":
            if name not in self.objects:
                raise ApiError(404, "not found")
        elif name in self.objects:
            raise ApiError(409, "already exists")
        self.objects[name] = dict(body)
        return dict(body)

    def config(self, name: str) -> dict[str, Any]:
        cfg: dict[str, Any] = json.loads(self.objects[name]["data"]["DeviceInfoCfg"])
        return cfg


class Clock:
    def __init__(self) -> None:
        self.now = SINCE

    def __call__(self) -> float:
        return self.now


NAME = "mindx-dl-deviceinfo-node-a"


def writer_for(
    api: FakeApi, conditions: dict[str, Condition], clock: Clock, devices: list[Device]
) -> tuple[VolcanoDeviceInfo, DeviceState]:
    inventory = Inventory("node-a", (VendorReport(Vendor.ASCEND, tuple(devices)),), ())
    state = DeviceState(inventory)
    writer = VolcanoDeviceInfo(
        api=api,  # type: ignore[arg-type]  # the one call the writer makes
        state=state,
        conditions=lambda: dict(conditions),
        refresh_seconds=300.0,
        wall=lambda: clock.now + WALL_OFFSET,
        monotonic=clock,
    )
    return writer, state


def test_created_then_replaced_only_on_a_change_or_the_refresh() -> None:
    api, clock, conditions = FakeApi(), Clock(), {}
    writer, state = writer_for(api, conditions, clock, [npu(0), npu(1)])
    writer.sync()
    assert api.calls == [("PUT", f"/api/v1/namespaces/kube-system/configmaps/{NAME}"),
                         ("POST", "/api/v1/namespaces/kube-system/configmaps"),
                         ("PATCH", "/api/v1/nodes/node-a")]  # fmt: skip
    first = api.config(NAME)["DeviceInfo"]["UpdateTime"]
    clock.now += 10
    writer.sync()
    writer.sync()
    assert writer.writes == 1  # nothing changed: nothing written

    conditions["ascend-npu1"] = fault("NPU_FAULT_0x80E18402")
    state.set_unhealthy({"ascend-npu1"})
    writer.sync()
    cfg = api.config(NAME)
    assert cfg["DeviceInfo"]["DeviceList"]["huawei.com/Ascend910-Unhealthy"] == "Ascend910-1"
    assert cfg["CheckCode"] == independent_check_code(cfg["DeviceInfo"])
    assert cfg["DeviceInfo"]["UpdateTime"] > first
    assert writer.writes == 2

    clock.now += 300
    writer.sync()  # the refresh: the same lists, a newer time
    assert writer.writes == 3
    assert [call for call in api.calls if call[0] == "PATCH"] == [("PATCH", "/api/v1/nodes/node-a")]
    assert api.config(NAME)["DeviceInfo"]["UpdateTime"] == int(clock.now + WALL_OFFSET)
    assert api.calls[-1][0] == "PUT"


def test_the_part_writes_on_a_poke_and_retries_a_failed_call() -> None:
    api, clock, conditions = FakeApi(), Clock(), {}
    api.fail = 2
    writer, state = writer_for(api, conditions, clock, [npu(0)])
    with supervised(writer):
        wait_for("the first write", lambda: writer.writes, lambda n: n == 1)
        assert writer.failures == 2
        conditions["ascend-npu0"] = fault("NPU_HEALTH_ALARM")
        state.set_unhealthy({"ascend-npu0"})  # as the hub does with a new condition...
        writer.poke_event.set()  # ...and its subscription
        wait_for("the second write", lambda: writer.writes, lambda n: n == 2)
    lists = api.config(NAME)["DeviceInfo"]["DeviceList"]
    assert lists["huawei.com/Ascend910-Unhealthy"] == "Ascend910-0"
    assert not [t for t in threading.enumerate() if t.name == "part-volcano-device-info"]
    state.close()


# --- the agent's wiring --------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_the_agent_adds_the_writer_only_when_asked(tmp_path: Path, enabled: bool) -> None:
    profile = load_profile("ascend-910bx8")
    build_tree(profile, tmp_path / "node")
    settings = load_settings(
        defaults=profile.config,
        overrides={
            "host_root": str(tmp_path / "node"),
            "metrics_addr": "",
            "plugin": {"kubelet_dir": str(tmp_path / "kubelet")},
            "faults": {"state_dir": str(tmp_path / "state")},
            "node": {"volcano_device_info": enabled},
        },
    )
    agent = Agent.discover(settings)
    try:
        agent.start_publisher(FakeApi())  # type: ignore[arg-type]  # added, not started
        names = {status.name for status in agent.supervisor.statuses()}
    finally:
        agent.close()
    assert ("volcano-device-info" in names) is enabled
    assert "node-publisher" in names


# --- degraded NPUs and shadow mode ---------------------------------------------------------------


def writer_with_state(
    api: FakeApi, conditions: dict[str, Condition], clock: Clock, *, shadow: bool
) -> tuple[VolcanoDeviceInfo, DeviceState]:
    inventory = Inventory("node-a", (VendorReport(Vendor.ASCEND, (npu(0), npu(1), npu(2))),), ())
    state = DeviceState(inventory, shadow=shadow)
    writer = VolcanoDeviceInfo(
        api=api,  # type: ignore[arg-type]  # the one call the writer makes
        state=state,
        conditions=lambda: dict(conditions),
        wall=lambda: clock.now + WALL_OFFSET,
        monotonic=clock,
    )
    return writer, state


@pytest.mark.parametrize("shadow", [False, True])
def test_a_degraded_npu_is_kept_from_volcano_as_from_kubelet_but_not_in_shadow_mode(
    shadow: bool,
) -> None:
    api, clock = FakeApi(), Clock()
    conditions = {
        "ascend-npu1": fault("NPU_FAULT_0x80818C06", level=Level.DEGRADED),  # SubHealthFault
        "ascend-npu2": fault("NPU_FAULT_0x80E18402"),
    }
    writer, state = writer_with_state(api, conditions, clock, shadow=shadow)
    state.set_unhealthy({"ascend-npu2"}, {"ascend-npu1"})
    writer.sync()
    lists = api.config(NAME)["DeviceInfo"]["DeviceList"]
    if shadow:
        assert lists["huawei.com/Ascend910"] == "Ascend910-0,Ascend910-1,Ascend910-2"
        assert lists["huawei.com/Ascend910-Unhealthy"] == ""
        assert json.loads(lists["huawei.com/Ascend910-Fault"]) == []
        return
    assert lists["huawei.com/Ascend910"] == "Ascend910-0"
    assert lists["huawei.com/Ascend910-Unhealthy"] == "Ascend910-1,Ascend910-2"
    levels = {
        f["npu_name"]: (f["fault_level"], f["fault_code"])
        for f in json.loads(lists["huawei.com/Ascend910-Fault"])
    }
    assert levels == {
        "Ascend910-1": ("SubHealthFault", "80818C06"),
        "Ascend910-2": ("SeparateNPU", "80E18402"),
    }
    # Over: the NPU is offered again.
    del conditions["ascend-npu1"]
    state.set_unhealthy({"ascend-npu2"}, set())
    writer.sync()
    lists = api.config(NAME)["DeviceInfo"]["DeviceList"]
    assert lists["huawei.com/Ascend910"] == "Ascend910-0,Ascend910-1"
    assert lists["huawei.com/Ascend910-Unhealthy"] == "Ascend910-2"
