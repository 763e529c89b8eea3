"""NVML health events and telemetry on simulated nodes: the real pynvml bindings, the fake
libnvidia-ml.so.1 and faults appended to its fault file."""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from edl_agent.devices import nvidia
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.model import HealthEvent, Level
from edl_agent.health.nvml_telemetry import NvmlTelemetry, read_nvidia_telemetry
from edl_agent.health.nvml_watch import NvmlWatcher
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.supervisor import StopSignal, Supervisor
from edl_agent.sim import inject, nvidia_tree
from edl_agent.sim.profile import load_profile, stable_uuid
from edl_agent.sim.tree import build_tree
from tests.parts import stop as stop_parts
from tests.waiting import wait_until

TIMEOUT = 5.0


def classify(code: int) -> Level:
    return {79: Level.NODE_FATAL, 48: Level.DEVICE_FATAL, 13: Level.IGNORE}.get(code, Level.WARN)


def gpu_uuid(profile: str, index: int) -> str:
    return "GPU-" + stable_uuid(profile, "gpu", index)


class Events:
    """What a watcher reported, with the monotonic time each on_event call happened."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[float, HealthEvent]] = queue.Queue()

    def __call__(self, event: HealthEvent) -> None:
        self.queue.put((time.monotonic(), event))

    def next(self, timeout: float = TIMEOUT) -> HealthEvent:
        return self.next_timed(timeout)[1]

    def next_timed(self, timeout: float = TIMEOUT) -> tuple[float, HealthEvent]:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no health event within {timeout}s")

    def until(self, reason: str, *, cleared: bool = False) -> HealthEvent:
        deadline = time.monotonic() + TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            event = self.next(left)
            if event.reason == reason and event.cleared == cleared:
                return event
        pytest.fail(f"no {reason} event (cleared={cleared})")

    def none_within(self, seconds: float) -> None:
        try:
            _, event = self.queue.get(timeout=seconds)
        except queue.Empty:
            return
        pytest.fail(f"unexpected event {event}")


@pytest.fixture
def node(tmp_path: Path) -> Path:
    build_tree(load_profile("dgx-h100"), tmp_path)
    return tmp_path


def supervise(watcher: NvmlWatcher, retry_seconds: float = 0.05) -> Supervisor:
    """A started supervisor running `watcher` as the agent does: its own retry backoff."""
    supervisor = Supervisor(StopSignal())
    supervisor.add(watcher, backoff=Backoff(retry_seconds, retry_seconds))
    supervisor.start()
    return supervisor


# The supervisor of each watcher `start` runs, for `restarts`.
supervisors: dict[NvmlWatcher, Supervisor] = {}


def restarts(watcher: NvmlWatcher) -> int:
    """How often `watcher` failed and was run again."""
    return supervisors[watcher].restarts(watcher.name)


@pytest.fixture
def start() -> Iterator[Callable[..., tuple[NvmlWatcher, Events]]]:
    """Run watchers on a tree, each under a supervisor; every one is stopped at the end of the
    test."""
    supervisors.clear()

    def run(
        root: Path, *, ready: bool = True, retry_seconds: float = 0.05
    ) -> tuple[NvmlWatcher, Events]:
        events = Events()
        watcher = NvmlWatcher(HostRoot.at(root), events, classify, wait_ms=200)
        supervisors[watcher] = supervise(watcher, retry_seconds)
        if ready:
            wait_until(lambda: watcher.ready, timeout=TIMEOUT)
        return watcher, events

    yield run
    for supervisor in supervisors.values():
        stop_parts(supervisor)


def test_xids_reach_on_event(node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    _, events = start(node)

    inject.inject_xid(node, 3, 79)
    inject.inject_xid(node, 5, 13)

    first, second = events.next(), events.next()
    assert first.vendor is Vendor.NVIDIA
    assert (first.device_id, first.reason, first.level, first.code) == (
        gpu_uuid("dgx-h100", 3),
        "XID79",
        Level.NODE_FATAL,
        79,
    )
    assert not first.cleared
    assert first.at <= time.monotonic()
    assert (second.device_id, second.reason, second.level) == (
        gpu_uuid("dgx-h100", 5),
        "XID13",
        Level.IGNORE,
    )
    events.none_within(0.3)  # an XID line alone does not take the GPU off the bus


def test_ecc_errors(node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    watcher, events = start(node)

    inject.inject_ecc_sbe(node, 2)
    inject.inject_ecc_sbe(node, 2)
    inject.inject_ecc_dbe(node, 2)

    event = events.next()
    assert (event.device_id, event.reason, event.level) == (
        gpu_uuid("dgx-h100", 2),
        "ECC_DBE",
        Level.DEVICE_FATAL,
    )
    assert watcher.single_bit_errors == {gpu_uuid("dgx-h100", 2): 2}


def test_xid_on_a_mig_device(
    tmp_path: Path, start: Callable[..., tuple[NvmlWatcher, Events]]
) -> None:
    build_tree(load_profile("dgx-a100-mig"), tmp_path)
    _, events = start(tmp_path)

    inject.inject_xid(tmp_path, 0, 31, mig_index=1)
    inject.inject_xid(tmp_path, 0, 31)

    on_mig, on_gpu = events.next(), events.next()
    assert on_mig.device_id == "MIG-" + stable_uuid("dgx-a100-mig", "mig", 0, 1)
    assert on_gpu.device_id == gpu_uuid("dgx-a100-mig", 0)


def test_lost_gpu(node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    _, events = start(node)

    inject.inject_lost(node, 4)

    xid, lost = events.next(), events.next()
    assert (xid.reason, xid.device_id) == ("XID79", gpu_uuid("dgx-h100", 4))
    assert (lost.reason, lost.level, lost.device_id, lost.cleared) == (
        "GPU_LOST",
        Level.NODE_FATAL,
        gpu_uuid("dgx-h100", 4),
        False,
    )
    report = nvidia.discover(HostRoot.at(node))
    assert report is not None
    assert report.error == "GPU 4: GPU is lost"

    inject.inject_recover(node, 4)

    found = events.until("GPU_LOST", cleared=True)
    assert found.device_id == gpu_uuid("dgx-h100", 4)


def test_gpu_lost_before_the_watcher_starts(
    node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]
) -> None:
    inject.inject_lost(node, 6)  # a restarted agent must still see it

    _, events = start(node)

    lost = events.until("GPU_LOST")
    assert lost.device_id is None  # NVML cannot name a GPU that is already gone
    assert lost.detail.startswith("GPU 6: GPU is lost")

    inject.inject_recover(node, 6)
    events.until("GPU_LOST", cleared=True)
    inject.inject_xid(node, 6, 94)  # registered once it answered again
    assert events.until("XID94").device_id == gpu_uuid("dgx-h100", 6)


def test_init_failure_is_retried_and_cleared(
    node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]
) -> None:
    inject.set_nvml_init_failure(node, on=True)

    watcher, events = start(node, ready=False)

    failed = events.next()
    assert (failed.vendor, failed.device_id, failed.reason, failed.level) == (
        Vendor.NVIDIA,
        None,
        "NVML_INIT_FAILED",
        Level.NODE_FATAL,
    )
    assert "Driver Not Loaded" in failed.detail
    wait_until(lambda: restarts(watcher) >= 3, timeout=TIMEOUT)
    assert not watcher.ready
    assert events.queue.empty()  # reported once, not on every retry

    inject.set_nvml_init_failure(node, on=False)

    cleared = events.next()
    assert (cleared.device_id, cleared.reason, cleared.cleared) == (None, "NVML_INIT_FAILED", True)
    wait_until(lambda: watcher.ready, timeout=TIMEOUT)


def test_broken_event_loop(node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    watcher, events = start(node)

    inject.set_nvml_init_failure(node, on=True)

    broken = events.next()
    assert (broken.device_id, broken.reason, broken.level) == (
        None,
        "NVML_EVENT_LOOP_FAILED",
        Level.NODE_FATAL,
    )
    assert "nvmlEventSetWait" in broken.detail
    assert events.next().reason == "NVML_INIT_FAILED"  # the retry cannot initialise either
    assert not watcher.ready

    inject.set_nvml_init_failure(node, on=False)

    cleared = {events.next().reason, events.next().reason}
    assert cleared == {"NVML_EVENT_LOOP_FAILED", "NVML_INIT_FAILED"}
    wait_until(lambda: watcher.ready, timeout=TIMEOUT)
    inject.inject_xid(node, 1, 45)
    assert events.next().reason == "XID45"


def test_missing_library(tmp_path: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    _, events = start(tmp_path, ready=False)

    failed = events.next()
    assert failed.reason == "NVML_INIT_FAILED"
    assert "libnvidia-ml.so.1 not found" in failed.detail


def test_old_fault_lines_are_not_replayed(
    node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]
) -> None:
    inject.inject_xid(node, 0, 31)
    inject.inject_ecc_dbe(node, 1)

    _, events = start(node)
    events.none_within(0.3)
    inject.inject_xid(node, 2, 43)

    assert events.next().reason == "XID43"
    events.none_within(0.3)


def test_a_new_event_set_starts_at_the_end_of_the_fault_file(node: Path) -> None:
    inject.inject_xid(node, 0, 31)
    with nvidia.nvml_session(str(node / nvidia_tree.LIBRARY.lstrip("/"))):
        event_set = pynvml.nvmlEventSetCreate()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
            with pytest.raises(pynvml.NVMLError_Timeout):
                pynvml.nvmlEventSetWait(event_set, 50)
            inject.inject_xid(node, 0, 32)
            inject.inject_xid(node, 1, 33)  # GPU 1 is not registered in this set
            inject.inject_xid(node, 0, 34)
            codes = [pynvml.nvmlEventSetWait(event_set, 1000).eventData for _ in range(2)]
            assert codes == [32, 34]
            with pytest.raises(pynvml.NVMLError_Timeout):
                pynvml.nvmlEventSetWait(event_set, 0)
        finally:
            pynvml.nvmlEventSetFree(event_set)


def test_stop_joins_promptly(node: Path) -> None:
    watcher = NvmlWatcher(HostRoot.at(node), lambda _: None, classify, wait_ms=500)
    supervisor = supervise(watcher)
    wait_until(lambda: watcher.ready and supervisor.ready() == (True, "ok"), timeout=TIMEOUT)

    began = time.monotonic()
    stop_parts(supervisor)

    assert time.monotonic() - began < 1.0
    assert not watcher.ready


def test_waiting_costs_no_cpu(node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    start(node)
    time.sleep(0.2)

    cpu = time.process_time()
    time.sleep(2.0)
    used = time.process_time() - cpu

    print(f"\nCPU time of an idle watcher over 2 s: {used * 1000:.1f} ms")
    assert used < 0.05


def test_xid_latency(node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]) -> None:
    _, events = start(node)
    latencies = []
    for n in range(200):
        began = time.monotonic()
        inject.inject_xid(node, n % 8, 31)
        delivered, event = events.next_timed()
        assert event.reason == "XID31"
        latencies.append(delivered - began)

    latencies.sort()
    p50 = statistics.median(latencies)
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(f"\ninjected XID -> on_event: p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms")
    assert p99 < 1.0


def test_discovery_runs_beside_the_watcher(
    node: Path, start: Callable[..., tuple[NvmlWatcher, Events]]
) -> None:
    start(node)

    began = time.monotonic()
    report = nvidia.discover(HostRoot.at(node))

    assert report is not None
    assert report.error is None
    assert len(report.devices) == 8
    assert time.monotonic() - began < 1.0


def test_an_event_handler_that_raises_does_not_stop_the_watcher(node: Path) -> None:
    seen: list[str] = []

    def handler(event: HealthEvent) -> None:
        seen.append(event.reason)
        raise RuntimeError("handler bug")

    watcher = NvmlWatcher(HostRoot.at(node), handler, classify, wait_ms=100)
    supervisor = supervise(watcher)
    try:
        wait_until(lambda: watcher.ready, timeout=TIMEOUT)
        inject.inject_xid(node, 0, 31)
        inject.inject_xid(node, 0, 32)
        wait_until(lambda: len(seen) == 2, timeout=TIMEOUT)
        assert watcher.ready
        assert supervisor.restarts(watcher.name) == 0
    finally:
        stop_parts(supervisor)


# ---- telemetry ----------------------------------------------------------------------------------


def test_telemetry(node: Path) -> None:
    inject.set_gpu_telemetry(
        node, 1, temperature_c=71, power_w=412, utilization_percent=87, memory_used_mib=20000
    )
    inject.inject_ecc_sbe(node, 2)
    inject.inject_ecc_dbe(node, 2)
    inject.inject_ecc_dbe(node, 2)

    figures = {t.device_id: t for t in read_nvidia_telemetry(HostRoot.at(node))}

    assert list(figures) == [gpu_uuid("dgx-h100", i) for i in range(8)]
    busy = figures[gpu_uuid("dgx-h100", 1)]
    assert (busy.temperature_c, busy.power_w, busy.utilization_percent) == (71.0, 412.0, 87.0)
    assert busy.memory_total_mib == 81559
    reserved = 81559 // 160
    assert busy.memory_used_mib == 20000 + reserved
    idle = figures[gpu_uuid("dgx-h100", 0)]
    assert (idle.temperature_c, idle.power_w, idle.utilization_percent) == (33.0, 70.0, 0.0)
    assert idle.memory_used_mib == reserved
    assert (idle.ecc_corrected_total, idle.ecc_uncorrected_total) == (0, 0)
    faulty = figures[gpu_uuid("dgx-h100", 2)]
    assert (faulty.ecc_corrected_total, faulty.ecc_uncorrected_total) == (1, 2)


def test_telemetry_of_a_lost_gpu_and_mig_devices(tmp_path: Path) -> None:
    build_tree(load_profile("dgx-a100-mig"), tmp_path)
    with NvmlTelemetry(HostRoot.at(tmp_path)) as telemetry:
        before = telemetry.read()
        inject.inject_lost(tmp_path, 7)
        after = {t.device_id: t for t in telemetry.read()}

    assert len(before) == 8 + 24
    mig = next(t for t in before if t.device_id.startswith("MIG-"))
    assert mig.memory_total_mib == 40192
    assert mig.temperature_c is None
    lost = after[gpu_uuid("dgx-a100-mig", 7)]
    assert lost.temperature_c is None
    assert lost.memory_total_mib is None


def test_telemetry_is_cheap(node: Path) -> None:
    with NvmlTelemetry(HostRoot.at(node)) as telemetry:
        telemetry.read()
        timings = []
        for _ in range(50):
            began = time.perf_counter()
            assert len(telemetry.read()) == 8
            timings.append(time.perf_counter() - began)

    p50 = statistics.median(timings)
    print(f"\ntelemetry read of 8 GPUs: p50 {p50 * 1000:.2f} ms, max {max(timings) * 1000:.2f} ms")
    assert p50 < 0.05


def test_telemetry_without_nvml(tmp_path: Path) -> None:
    assert read_nvidia_telemetry(HostRoot.at(tmp_path)) == []


def test_telemetry_while_init_fails(node: Path) -> None:
    telemetry = NvmlTelemetry(HostRoot.at(node))
    inject.set_nvml_init_failure(node, on=True)
    assert telemetry.read() == []
    inject.set_nvml_init_failure(node, on=False)
    assert len(telemetry.read()) == 8
    telemetry.close()


def test_sessions_on_one_library_run_concurrently(node: Path) -> None:
    library = str(node / nvidia_tree.LIBRARY.lstrip("/"))
    inside = threading.Barrier(2, timeout=TIMEOUT)

    def session() -> None:
        with nvidia.nvml_session(library):
            inside.wait()  # both threads are in a session at once
            assert pynvml.nvmlDeviceGetCount() == 8

    threads = [threading.Thread(target=session) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not inside.broken


def test_a_session_on_another_library_waits(
    node: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = tmp_path_factory.mktemp("other")
    build_tree(load_profile("cgpu-v100"), other)
    entered = threading.Event()
    uuids: list[str] = []

    def other_session() -> None:
        with nvidia.nvml_session(str(other / nvidia_tree.LIBRARY.lstrip("/"))):
            entered.set()
            uuids.append(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))

    with nvidia.nvml_session(str(node / nvidia_tree.LIBRARY.lstrip("/"))):
        thread = threading.Thread(target=other_session)
        thread.start()
        assert not entered.wait(0.2)
        assert pynvml.nvmlDeviceGetCount() == 8
    thread.join(TIMEOUT)
    assert entered.is_set()
    assert uuids == [gpu_uuid("cgpu-v100", 0)]
