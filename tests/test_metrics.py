"""Metrics: pod attribution over kubelet's pod-resources API (a stand-in on a real unix socket),
the collector's exposition read back with prometheus_client's parser, the HTTP server, Debian's
`promtool check metrics`, and a real Prometheus scraping the server."""

from __future__ import annotations

import gzip
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries
from structlog.testing import capture_logs

from edl_agent import __version__
from edl_agent._proto.podresources.v1 import api_pb2
from edl_agent.config import load_settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.tool_runs import TOOL_RUNS
from edl_agent.health.model import DeviceTelemetry, Level
from edl_agent.health.state import DeviceState
from edl_agent.kubelet.podresources import PodRef, PodResourcesClient, attribute, pod_devices
from edl_agent.metrics.collectors import EdlCollector, build_registry
from edl_agent.metrics.inputs import AgentCounts, HealthCounts
from edl_agent.metrics.server import MetricsServer, parse_address
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.podresources_standin import PodResourcesStandIn
from tests.prometheus_runner import get, need, running_prometheus
from tests.waiting import wait_until

GPU = "nvidia.com/gpu"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def node_state(root: Path, profile: str = "dgx-h100", **overrides: object) -> DeviceState:
    build_tree(load_profile(profile), root)
    settings = load_settings(overrides={"host_root": str(root), **overrides})
    return DeviceState(discover_node(settings))


@pytest.fixture
def state(tmp_path: Path) -> DeviceState:
    return node_state(tmp_path / "node")


@pytest.fixture
def shared_state(tmp_path: Path) -> DeviceState:
    """Each GPU advertised as 4 time-slicing replicas `<uuid>::<i>`."""
    return node_state(tmp_path / "node", sharing=[{"resource": GPU, "replicas": 4}])


def gpu_ids(state: DeviceState) -> list[str]:
    devices = sorted(state.snapshot().devices.values(), key=lambda d: d.index)
    return [d.id for d in devices if d.parent is None]


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[PodResourcesStandIn]:
    server = PodResourcesStandIn(tmp_path / "pod-resources" / "kubelet.sock")
    server.start()
    yield server
    server.stop()


def scrape(collector: EdlCollector) -> str:
    from prometheus_client import generate_latest

    return generate_latest(build_registry(collector)).decode()


def samples(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in found, f"duplicate series {key}"
            found[key] = sample.value
    return found


def series(found: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    return {
        key_labels: value
        for (sample_name, key_labels), value in found.items()
        if sample_name == name and set(labels.items()) <= key_labels
    }


# --- the pod-resources API ------------------------------------------------------------------


def test_podresources_proto_follows_kubelet() -> None:
    fields = {
        (message.name, field.name): field.number
        for message in api_pb2.DESCRIPTOR.message_types_by_name.values()
        for field in message.fields
    }
    assert api_pb2.DESCRIPTOR.package == "v1"
    assert fields[("ListPodResourcesResponse", "pod_resources")] == 1
    assert fields[("PodResources", "containers")] == 3
    assert fields[("PodResources", "memory")] == 5
    assert fields[("ContainerResources", "devices")] == 2
    assert fields[("ContainerResources", "dynamic_resources")] == 5
    assert fields[("ContainerDevices", "device_ids")] == 2
    assert fields[("ContainerDevices", "topology")] == 3
    assert fields[("DynamicResource", "claim_name")] == 2
    assert fields[("GetPodResourcesRequest", "pod_namespace")] == 2
    methods = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"].methods
    assert [m.full_name for m in methods] == [
        "v1.PodResourcesLister.List",
        "v1.PodResourcesLister.GetAllocatableResources",
        "v1.PodResourcesLister.Get",
    ]


def test_replica_ids_resolve_to_their_physical_gpu(shared_state: DeviceState) -> None:
    snapshot = shared_state.snapshot()
    gpu0, gpu1 = gpu_ids(shared_state)[:2]
    response = api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                namespace="train",
                name="job-0",
                containers=[
                    api_pb2.ContainerResources(
                        name="worker",
                        devices=[
                            # two replicas of one GPU: the container is listed once
                            api_pb2.ContainerDevices(
                                resource_name=GPU, device_ids=[f"{gpu0}::0", f"{gpu0}::3"]
                            ),
                            api_pb2.ContainerDevices(resource_name="rdma/ib", device_ids=["x"]),
                        ],
                    )
                ],
            ),
            api_pb2.PodResources(
                namespace="infer",
                name="svc",
                containers=[
                    api_pb2.ContainerResources(
                        name="main",
                        devices=[
                            api_pb2.ContainerDevices(
                                resource_name=GPU,
                                device_ids=[f"{gpu0}::1", f"{gpu1}::0", "GPU-gone::0"],
                            )
                        ],
                    )
                ],
            ),
        ]
    )
    assert attribute(response, snapshot.units) == {
        gpu0: [PodRef("infer", "svc", "main", GPU), PodRef("train", "job-0", "worker", GPU)],
        gpu1: [PodRef("infer", "svc", "main", GPU)],
    }


def test_attribution_names_the_pods_whose_dra_claims_hold_a_device() -> None:
    """A claim's devices arrive as (driver, pool, device name); only ours, on our pool, count."""
    claimable = {("gpu.nvidia.edl.io", "n1", "gpu-1"): "GPU-1"}

    def claim(name: str, driver: str, pool: str, device: str) -> api_pb2.DynamicResource:
        return api_pb2.DynamicResource(
            claim_name=name,
            claim_namespace="train",
            claim_resources=[
                api_pb2.ClaimResource(driver_name=driver, pool_name=pool, device_name=device)
            ],
        )

    response = api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                namespace="train",
                name="job-0",
                containers=[
                    api_pb2.ContainerResources(
                        name="worker",
                        dynamic_resources=[
                            claim("gpus", "gpu.nvidia.edl.io", "n1", "gpu-1"),
                            claim("other-pool", "gpu.nvidia.edl.io", "n2", "gpu-1"),
                            claim("other-driver", "gpu.example.com", "n1", "gpu-1"),
                        ],
                    )
                ],
            )
        ]
    )
    assert attribute(response, {}, claimable) == {
        "GPU-1": [PodRef("train", "job-0", "worker", "claim:train/gpus")]
    }
    assert attribute(response, {}) == {}


def test_pod_devices_over_a_unix_socket(
    shared_state: DeviceState, standin: PodResourcesStandIn
) -> None:
    gpu0, _, _, gpu3 = gpu_ids(shared_state)[:4]
    standin.assign(
        {
            ("train", "job-0"): {"worker": {GPU: [f"{gpu3}::2"]}},
            ("train", "job-1"): {"worker": {GPU: [f"{gpu3}::0", f"{gpu0}::1"]}},
        }
    )
    units = shared_state.snapshot().units
    expected = {
        gpu0: [PodRef("train", "job-1", "worker", GPU)],
        gpu3: [PodRef("train", "job-0", "worker", GPU), PodRef("train", "job-1", "worker", GPU)],
    }
    assert pod_devices(standin.socket, 2.0, units) == expected
    client = PodResourcesClient(standin.socket, timeout=2.0)
    try:
        assert client.pod_devices(units) == expected
        standin.assign({})
        assert client.pod_devices(units) == {}
    finally:
        client.close()


def test_absent_socket_is_no_pods_quietly(tmp_path: Path, state: DeviceState) -> None:
    client = PodResourcesClient(tmp_path / "no-kubelet" / "kubelet.sock", timeout=1.0)
    with capture_logs() as logs:
        assert client.pod_devices(state.snapshot().units) == {}
        assert client.pod_devices(state.snapshot().units) == {}
    assert logs == []


def test_failures_are_no_pods_and_logged_once_per_change(
    state: DeviceState, standin: PodResourcesStandIn
) -> None:
    gpu0 = gpu_ids(state)[0]
    standin.assign({("ns", "p"): {"c": {GPU: [gpu0]}}})
    units = state.snapshot().units
    client = PodResourcesClient(standin.socket, timeout=2.0)
    try:
        with capture_logs() as logs:
            standin.fail_with(grpc.StatusCode.UNAVAILABLE)
            for _ in range(3):
                assert client.pod_devices(units) == {}
            standin.fail_with(grpc.StatusCode.PERMISSION_DENIED)
            for _ in range(2):
                assert client.pod_devices(units) == {}
            standin.fail_with(None)
            assert client.pod_devices(units) == {gpu0: [PodRef("ns", "p", "c", GPU)]}
            assert client.pod_devices(units) == {gpu0: [PodRef("ns", "p", "c", GPU)]}
    finally:
        client.close()
    assert [(e["log_level"], e["error"].split(":")[0] if "error" in e else None) for e in logs] == [
        ("warning", "UNAVAILABLE"),
        ("warning", "PERMISSION_DENIED"),
        ("info", None),
    ]


def test_a_socket_that_is_not_kubelet_is_no_pods(tmp_path: Path, state: DeviceState) -> None:
    path = tmp_path / "kubelet.sock"
    path.write_text("not a socket")
    client = PodResourcesClient(path, timeout=1.0)
    with capture_logs() as logs:
        assert client.pod_devices(state.snapshot().units) == {}
        assert client.pod_devices(state.snapshot().units) == {}
    client.close()
    assert [e["log_level"] for e in logs] == ["warning"]


def test_kubelet_restart_replaces_the_socket_and_the_client_follows(
    state: DeviceState, tmp_path: Path
) -> None:
    gpu0 = gpu_ids(state)[0]
    path = tmp_path / "pod-resources" / "kubelet.sock"
    units = state.snapshot().units
    first = PodResourcesStandIn(path)
    first.start()
    first.assign({("ns", "before"): {"c": {GPU: [gpu0]}}})
    client = PodResourcesClient(path, timeout=2.0)
    try:
        assert client.pod_devices(units)[gpu0][0].pod == "before"
        first.stop()
        assert client.pod_devices(units) == {}  # gone: no pods
        second = PodResourcesStandIn(path)
        second.start()
        try:
            second.assign({("ns", "after"): {"c": {GPU: [gpu0]}}})
            assert client.pod_devices(units)[gpu0][0].pod == "after"
        finally:
            second.stop()
    finally:
        client.close()


# --- the collector --------------------------------------------------------------------------


def test_device_healthy_with_pod_attribution(
    shared_state: DeviceState, standin: PodResourcesStandIn
) -> None:
    gpus = gpu_ids(shared_state)
    standin.assign(
        {
            ("train", "job-0"): {"worker": {GPU: [f"{gpus[3]}::0"]}},
            ("train", "job-1"): {"worker": {GPU: [f"{gpus[3]}::1"]}},
        }
    )
    client = PodResourcesClient(standin.socket, timeout=2.0)
    collector = EdlCollector(
        snapshot=shared_state.snapshot,
        pods=lambda: client.pod_devices(shared_state.snapshot().units),
    )
    try:
        found = samples(scrape(collector))
        healthy = series(found, "edl_device_healthy")
        assert len(healthy) == 9  # 7 unattributed GPUs + GPU 3 once per holding container
        gpu3 = series(found, "edl_device_healthy", index="3")
        assert {dict(k)["pod"] for k in gpu3} == {"job-0", "job-1"}
        assert all(v == 1.0 for v in gpu3.values())
        labels = dict(next(iter(series(found, "edl_device_healthy", index="0"))))
        assert labels == {
            "vendor": "nvidia",
            "index": "0",
            "device_id": gpus[0],
            "product": "NVIDIA H100 80GB HBM3",
            "resource": GPU,
            "namespace": "",
            "pod": "",
            "container": "",
        }

        shared_state.set_unhealthy({gpus[3]})
        found = samples(scrape(collector))
        assert set(series(found, "edl_device_healthy", index="3").values()) == {0.0}
        assert set(series(found, "edl_device_healthy", index="2").values()) == {1.0}
    finally:
        client.close()


def test_a_partition_follows_its_parent_and_keeps_a_unique_index(tmp_path: Path) -> None:
    state = node_state(tmp_path / "node", "dgx-a100-mig")
    snapshot = state.snapshot()
    gpu3 = next(d for d in snapshot.devices.values() if d.parent is None and d.index == 3)
    migs = [d for d in snapshot.devices.values() if d.parent == gpu3.id]
    assert migs
    state.set_unhealthy({gpu3.id})
    found = samples(scrape(EdlCollector(snapshot=state.snapshot)))
    physical = series(found, "edl_device_healthy", index="3")
    assert [dict(k)["device_id"] for k in physical] == [gpu3.id]
    for mig in migs:
        [(labels, value)] = series(found, "edl_device_healthy", device_id=mig.id).items()
        assert dict(labels)["index"] == f"3/{mig.index}"
        assert value == 0.0
    healthy_children = [
        v
        for k, v in series(found, "edl_device_healthy").items()
        if dict(k)["index"].startswith("4/")
    ]
    assert healthy_children
    assert set(healthy_children) == {1.0}


def test_telemetry_health_and_agent_figures(state: DeviceState) -> None:
    gpus = gpu_ids(state)
    telemetry = [
        DeviceTelemetry(gpus[0], temperature_c=40.0),  # superseded by the later reading
        DeviceTelemetry(
            gpus[0],
            temperature_c=61.0,
            power_w=412.5,
            utilization_percent=87.0,
            memory_used_mib=1024,
            memory_total_mib=81559,
            ecc_corrected_total=3,
            ecc_uncorrected_total=0,
        ),
        DeviceTelemetry(gpus[1], power_w=90.0),  # what a device does not report is left off
    ]
    health = HealthCounts(
        xid_errors={(gpus[2], 79): 1, (gpus[2], 13): 4},
        transitions={(gpus[2], "Unhealthy", "XID79"): 1},
        events={(gpus[2], "XID79", Level.NODE_FATAL): 1, ("", "NVML_INIT_FAILED", "warn"): 2},
    )
    agent = AgentCounts(
        discovery_seconds=0.25,
        nvml_event_loop_restarts=1,
        registrations=3,
        registration_failures=2,
        plugin_server_restarts=1,
        step_failures={"plugin_sync": 5},
        dra_plugins={"gpu.nvidia.edl.io": (True, 2), "npu.ascend.edl.io": (False, 0)},
        dra_publish_failures=4,
    )
    collector = EdlCollector(
        snapshot=state.snapshot,
        telemetry=lambda: iter(telemetry),
        health_counts=lambda: health,
        agent_counts=lambda: agent,
        version="9.9.9",
    )
    found = samples(scrape(collector))
    gpu0 = {("vendor", "nvidia"), ("index", "0"), ("device_id", gpus[0])}
    assert found[("edl_device_temperature_celsius", frozenset(gpu0))] == 61.0
    assert found[("edl_device_power_watts", frozenset(gpu0))] == 412.5
    assert found[("edl_device_utilization_ratio", frozenset(gpu0))] == pytest.approx(0.87)
    assert found[("edl_device_memory_used_bytes", frozenset(gpu0))] == 1024 * 2**20
    assert found[("edl_device_memory_total_bytes", frozenset(gpu0))] == 81559 * 2**20
    assert found[("edl_device_ecc_errors_total", frozenset({*gpu0, ("type", "corrected")}))] == 3
    assert found[("edl_device_ecc_errors_total", frozenset({*gpu0, ("type", "uncorrected")}))] == 0
    assert series(found, "edl_device_temperature_celsius", device_id=gpus[1]) == {}
    assert list(series(found, "edl_device_power_watts", device_id=gpus[1]).values()) == [90.0]

    xids = {dict(k)["xid"]: v for k, v in series(found, "edl_xid_errors_total").items()}
    assert xids == {"79": 1, "13": 4}
    assert {dict(k)["index"] for k in series(found, "edl_xid_errors_total")} == {"2"}
    [(labels, _)] = series(found, "edl_device_health_transitions_total").items()
    assert dict(labels) == {"device_id": gpus[2], "to": "Unhealthy", "reason": "XID79"}
    events = series(found, "edl_health_events_total")
    assert (
        events[frozenset({("device_id", ""), ("reason", "NVML_INIT_FAILED"), ("level", "warn")})]
        == 2
    )
    assert (
        events[frozenset({("device_id", gpus[2]), ("reason", "XID79"), ("level", "node_fatal")})]
        == 1
    )

    assert found[("edl_discovery_duration_seconds", frozenset())] == 0.25
    assert found[("edl_nvml_event_loop_restarts_total", frozenset())] == 1
    assert found[("edl_plugin_registrations_total", frozenset())] == 3
    assert found[("edl_plugin_registration_failures_total", frozenset())] == 2
    assert found[("edl_plugin_server_restarts_total", frozenset())] == 1
    assert found[("edl_agent_step_failures_total", frozenset({("step", "plugin_sync")}))] == 5
    assert found[("edl_agent_info", frozenset({("version", "9.9.9")}))] == 1
    gpu, npu = (
        frozenset({("driver", "gpu.nvidia.edl.io")}),
        frozenset({("driver", "npu.ascend.edl.io")}),
    )
    assert found[("edl_dra_plugin_registered", gpu)] == 1
    assert found[("edl_dra_plugin_registered", npu)] == 0
    assert found[("edl_dra_prepared_claims", gpu)] == 2
    assert found[("edl_dra_slice_publish_failures_total", frozenset())] == 4


def test_every_family_has_help_and_the_prefix(state: DeviceState) -> None:
    families = list(text_string_to_metric_families(scrape(EdlCollector(snapshot=state.snapshot))))
    assert families
    for family in families:
        assert family.name.startswith("edl_")
        assert family.documentation


def test_a_broken_source_costs_only_its_own_figures(state: DeviceState) -> None:
    def broken() -> list[DeviceTelemetry]:
        raise RuntimeError("tool hung")

    collector = EdlCollector(snapshot=state.snapshot, telemetry=broken)
    with capture_logs() as logs:
        first = samples(scrape(collector))
        second = samples(scrape(collector))
    assert len(series(second, "edl_device_healthy")) == 8
    assert series(first, "edl_device_temperature_celsius") == {}
    errors = series(second, "edl_metrics_source_errors_total", source="telemetry")
    assert list(errors.values()) == [2]
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "metrics source failed; its metrics are left off"
    ]


def test_the_registry_is_our_own(state: DeviceState) -> None:
    collector = EdlCollector(snapshot=state.snapshot)
    registry = build_registry(collector)
    assert registry is not REGISTRY
    assert REGISTRY.get_sample_value("edl_agent_info", {"version": __version__}) is None
    assert registry.get_sample_value("edl_agent_info", {"version": __version__}) == 1
    with pytest.raises(DuplicateTimeseries):
        registry.register(EdlCollector(snapshot=state.snapshot))


# --- the HTTP server ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        (":9400", ("", 9400)),
        ("127.0.0.1:9400", ("127.0.0.1", 9400)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9400", ("::1", 9400)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),  # noqa: S104 - parsing only
    ],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("9400", "no port"),
        ("127.0.0.1", "no port"),
        ("127.0.0.1:", "not a number"),
        (":http", "not a number"),
        (":65536", "not a number"),
        (":-1", "not a number"),
        ("::1:9400", "brackets"),
        ("[]:9400", "empty brackets"),
    ],
)
def test_parse_address_refuses(address: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_address(address)


@pytest.fixture
def readiness() -> list[tuple[bool, str]]:
    return [(False, "waiting for kubelet registration")]


@pytest.fixture
def server(state: DeviceState, readiness: list[tuple[bool, str]]) -> Iterator[MetricsServer]:
    collector = EdlCollector(snapshot=state.snapshot)
    metrics = MetricsServer("127.0.0.1:0", build_registry(collector), ready=lambda: readiness[-1])
    metrics.start()
    yield metrics
    metrics.stop()


def test_server_endpoints(server: MetricsServer, readiness: list[tuple[bool, str]]) -> None:
    assert server.port != 0
    status, body, headers = get(f"{server.url}/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert len(series(samples(body.decode()), "edl_device_healthy")) == 8

    assert get(f"{server.url}/healthz")[:2] == (200, b"ok\n")
    assert get(f"{server.url}/readyz")[:2] == (503, b"waiting for kubelet registration\n")
    readiness.append((True, "registered 1 resource"))
    assert get(f"{server.url}/readyz?verbose=1")[:2] == (200, b"registered 1 resource\n")
    assert get(f"{server.url}/")[0] == 404
    assert get(f"{server.url}/metricsx")[0] == 404


def test_server_negotiates_openmetrics_and_gzip(server: MetricsServer) -> None:
    status, body, headers = get(
        f"{server.url}/metrics",
        {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
    )
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(body).decode()
    assert text.endswith("# EOF\n")
    assert 'edl_agent_info{version="' in text


def test_a_readiness_check_that_raises_is_not_ready(state: DeviceState) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("state unknown")

    registry = build_registry(EdlCollector(snapshot=state.snapshot))
    with MetricsServer("127.0.0.1:0", registry, ready=broken) as metrics, capture_logs():
        status, body, _ = get(f"{metrics.url}/readyz")
    assert status == 503
    assert b"state unknown" in body


def test_a_collector_that_raises_answers_500_and_the_server_goes_on(state: DeviceState) -> None:
    class Broken:
        def collect(self) -> list[object]:
            raise RuntimeError("boom")

    registry = CollectorRegistry()
    registry.register(Broken())  # type: ignore[arg-type]
    with MetricsServer("127.0.0.1:0", registry) as metrics, capture_logs():
        assert get(f"{metrics.url}/metrics")[0] == 500
        assert get(f"{metrics.url}/healthz")[0] == 200


def test_stop_releases_the_port_and_a_taken_port_is_refused(state: DeviceState) -> None:
    registry = build_registry(EdlCollector(snapshot=state.snapshot))
    first = MetricsServer("127.0.0.1:0", registry)
    first.start()
    port = first.port
    taken = MetricsServer(f"127.0.0.1:{port}", registry)
    with pytest.raises(OSError, match="in use"):
        taken.start()
    first.stop()
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", port), timeout=2),
    ):
        pass
    again = MetricsServer(f"127.0.0.1:{port}", registry)
    again.start()
    try:
        assert get(f"{again.url}/healthz")[0] == 200
    finally:
        again.stop()


def test_an_empty_host_serves_every_interface(state: DeviceState) -> None:
    registry = build_registry(EdlCollector(snapshot=state.snapshot))
    with MetricsServer(":0", registry) as metrics:
        assert metrics.port != 0
        assert get(f"http://127.0.0.1:{metrics.port}/healthz")[0] == 200
        if socket.has_dualstack_ipv6():
            assert get(f"http://[::1]:{metrics.port}/healthz")[0] == 200


# --- promtool and a real Prometheus ---------------------------------------------------------


def test_promtool_accepts_the_exposition(
    shared_state: DeviceState, standin: PodResourcesStandIn
) -> None:
    promtool = need("promtool")
    gpus = gpu_ids(shared_state)
    standin.assign({("train", "job-0"): {"worker": {GPU: [f"{gpus[1]}::0"]}}})
    client = PodResourcesClient(standin.socket, timeout=2.0)
    collector = EdlCollector(
        snapshot=shared_state.snapshot,
        telemetry=lambda: [DeviceTelemetry(g, 50.0, 300.0, 40.0, 10.0, 80.0, 0, 0) for g in gpus],
        health_counts=lambda: HealthCounts(
            xid_errors={(gpus[2], 79): 1},
            transitions={(gpus[2], "Unhealthy", "XID79"): 1},
            events={(gpus[2], "XID79", "node_fatal"): 1},
        ),
        agent_counts=lambda: AgentCounts(discovery_seconds=0.1, step_failures={"sync": 1}),
        pods=lambda: client.pod_devices(shared_state.snapshot().units),
    )
    try:
        with MetricsServer("127.0.0.1:0", build_registry(collector)) as metrics:
            _, body, _ = get(f"{metrics.url}/metrics")
    finally:
        client.close()
    assert b'pod="job-0"' in body
    done = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_a_real_prometheus_sees_a_device_go_unhealthy(state: DeviceState, tmp_path: Path) -> None:
    gpu3 = gpu_ids(state)[3]
    registry = build_registry(EdlCollector(snapshot=state.snapshot))
    with (
        MetricsServer("127.0.0.1:0", registry) as metrics,
        running_prometheus([metrics.url[7:]], tmp_path) as prometheus,
    ):
        value = prometheus.value
        wait_until(
            lambda: value('edl_device_healthy{index="3"}') == "1",
            what="GPU 3 healthy",
            timeout=60,
            poll=0.2,
        )
        [sample] = prometheus.query('edl_device_healthy{index="3"}')
        assert sample["metric"]["device_id"] == gpu3
        assert value('up{job="edl"}') == "1"
        assert value(f'edl_agent_info{{version="{__version__}"}}') == "1"

        state.set_unhealthy({gpu3})
        wait_until(
            lambda: value('edl_device_healthy{index="3"}') == "0",
            what="GPU 3 unhealthy",
            timeout=60,
            poll=0.2,
        )
        assert value('sum(edl_device_healthy{index!="3"})') == "7"


def test_every_vendor_tool_run_is_counted_with_its_time(tmp_path: Path, state: DeviceState) -> None:
    """A tool that works and one that fails both count: each is a process the agent started."""
    from edl_agent.devices.hostroot import HostRoot, ToolError
    from edl_agent.devices.tool_runs import ToolRuns

    tools = tmp_path / "usr" / "bin"
    tools.mkdir(parents=True)
    for name, status in (("fine-smi", 0), ("broken-smi", 3)):
        (tools / name).write_text(f"#!/bin/sh\necho reading\nexit {status}\n")
        (tools / name).chmod(0o755)
    root = HostRoot.at(tmp_path)
    before = TOOL_RUNS.snapshot()
    assert root.read_tool("fine-smi", [], str.strip) == "reading"
    assert root.read_tool("fine-smi", ["-q"], str.strip) == "reading"
    with pytest.raises(ToolError):
        root.read_tool("broken-smi", [], str.strip)
    after = TOOL_RUNS.snapshot()
    ran = {tool: after[tool].runs - (before[tool].runs if tool in before else 0) for tool in after}
    assert ran["fine-smi"] == 2
    assert ran["broken-smi"] == 1
    assert after["fine-smi"].seconds > 0

    counted = ToolRuns()
    counted.record("npu-smi", 0.25)
    counted.record("npu-smi", 0.5)
    found = samples(scrape(EdlCollector(snapshot=state.snapshot, tool_runs=counted.snapshot)))
    assert series(found, "edl_vendor_tool_runs_total") == {frozenset({("tool", "npu-smi")}): 2.0}
    assert series(found, "edl_vendor_tool_seconds_total") == {
        frozenset({("tool", "npu-smi")}): 0.75
    }
