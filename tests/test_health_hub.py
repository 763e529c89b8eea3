"""The health hub and the parts around it, without a node: changes reach each subscriber's queue,
the quarantine is written on the writer's thread (a write that hangs holds up no observer), and
the quiet-period part sleeps until the earliest quiet period ends (a fake clock)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from edl_agent.config import HealthSettings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.health.hub import HealthHub
from edl_agent.health.model import ClearsBy, Evidence, HealthEvent, Level
from edl_agent.health.quarantine_store import Quarantine, QuarantineStore
from edl_agent.health.quarantine_writer import QuarantineWriter
from edl_agent.health.quiet_periods import QuietPeriods
from edl_agent.health.reset_watch import ResetEvidence
from edl_agent.health.state import DeviceState
from tests.waiting import wait_until

GPUS = tuple(Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", "H100", 81559) for i in range(2))
INVENTORY = Inventory("node-a", (VendorReport(Vendor.NVIDIA, GPUS),), ())


def xid(
    device_id: str, code: int, at: float = 0.0, clears_by: ClearsBy | None = None
) -> HealthEvent:
    return HealthEvent(
        Vendor.NVIDIA,
        device_id,
        f"XID{code}",
        Level.DEVICE_FATAL,
        at,
        code=code,
        clears_by=clears_by,
    )


class HangingStore(QuarantineStore):
    """A store whose writes wait until the test lets them go."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.writing = threading.Event()
        self.go = threading.Event()
        self.saved: list[Quarantine] = []

    def save(self, quarantine: Quarantine) -> bool:
        self.writing.set()
        self.go.wait(30)
        self.saved.append(quarantine)
        return super().save(quarantine)


def test_changes_reach_every_subscription_and_one_not_taking_holds_up_nobody() -> None:
    state = DeviceState(INVENTORY)
    hub = HealthHub(state, HealthSettings(), boot_id="boot-1")
    eager, idle = threading.Event(), threading.Event()
    taken = hub.subscribe(eager, lambda change: bool(change.turned))
    hub.subscribe(idle)  # never taken from
    poke = threading.Event()
    looker = hub.subscribe(poke, keep=False)  # only told to look again: nothing piles up
    hub.report(xid("GPU-1", 79))
    assert eager.is_set()
    assert poke.is_set()
    assert looker.take() == []
    assert state.snapshot().unhealthy == {"GPU-1"}
    [change] = taken.take()
    assert [device for device, _ in change.turned] == ["GPU-1"]
    assert change.turned[0][1].reason == "XID79"
    hub.report(xid("GPU-1", 79))  # a repeat: no transition, nothing for this subscription
    assert taken.take() == []
    hub.release({"GPU-1"})
    assert state.snapshot().unhealthy == frozenset()


def test_the_quarantine_is_written_on_the_writers_thread_and_a_hung_write_blocks_no_report(
    tmp_path: Path,
) -> None:
    store = HangingStore(tmp_path)
    stop, wake = threading.Event(), threading.Event()
    writer = QuarantineWriter(store, wake)
    hub = HealthHub(DeviceState(INVENTORY), HealthSettings(), boot_id="boot-1", writer=writer)
    thread = threading.Thread(target=writer.run, args=(stop, lambda: None))
    thread.start()
    try:
        hub.report(xid("GPU-0", 79))
        assert store.writing.wait(10)  # the writer is inside the (hung) write
        hub.report(xid("GPU-1", 95))  # returns: the observer never waits for the disk
        assert "GPU-1" in hub.unhealthy()
    finally:
        store.go.set()
        stop.set()
        wake.set()
        thread.join(10)
    assert not thread.is_alive()
    assert set(store.saved[-1].conditions) == {"GPU-0", "GPU-1"}  # the latest, written last
    loaded = QuarantineStore(tmp_path).load()
    assert loaded is not None
    assert set(loaded.conditions) == {"GPU-0", "GPU-1"}


def test_the_quiet_part_sleeps_until_the_earliest_quiet_period_ends() -> None:
    now = [100.0]
    hub = HealthHub(DeviceState(INVENTORY), HealthSettings(quiet_seconds=30), boot_id=None)
    wake = threading.Event()
    quiet = QuietPeriods(hub, wake, clock=lambda: now[0])
    assert quiet.next_wait() is None  # nothing quiet: it only waits for the hub
    hub.report(xid("GPU-0", 31, at=95.0, clears_by=ClearsBy.QUIET))
    assert wake.is_set()  # a quiet period opened: the part plans again
    wake.clear()
    hub.report(xid("GPU-0", 31, at=100.0, clears_by=ClearsBy.QUIET))
    assert not wake.is_set()  # a repeat only pushes the end later: its wait ends, then it looks
    now[0] = 110.0
    assert quiet.next_wait() == 20
    assert hub.expire(now[0]) == []
    now[0] = 130.0
    [back] = hub.expire(now[0])
    assert (back.device_id, back.evidence) == ("GPU-0", Evidence.QUIET)
    assert quiet.next_wait() is None


def test_a_quarantine_that_cannot_be_saved_is_kept_and_saved_once_the_disk_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocked = tmp_path / "state"
    blocked.write_text("a file where the directory should be")  # every write fails (ENOTDIR)
    turns: list[bool] = []
    writer = QuarantineWriter(
        QuarantineStore(blocked / "health"),
        threading.Event(),
        on_unsaved=lambda: turns.append(writer.unsaved),
    )
    hub = HealthHub(DeviceState(INVENTORY), HealthSettings(), boot_id="boot-1", writer=writer)
    for code in (79, 48, 95):
        hub.report(xid("GPU-0", code))
        writer.flush()
    assert (writer.failures, writer.unsaved) == (3, True)
    assert capsys.readouterr().out.count("quarantine not saved") == 1  # said once, not per try
    assert turns == [True]  # heard once too

    blocked.unlink()  # the disk works again: the next try saves what was kept, unchanged since
    writer.flush()

    assert (writer.unsaved, writer.writes) == (False, 1)
    assert turns == [True, False]
    loaded = QuarantineStore(blocked / "health").load()
    assert loaded is not None
    assert set(loaded.conditions) == {"GPU-0"}
    assert "quarantine saved again" in capsys.readouterr().out


def test_readyz_and_the_node_condition_say_what_the_disk_does_not_hold_until_it_does(
    tmp_path: Path,
) -> None:
    from tests.test_health_agent import gpu_ids
    from tests.test_plugin import running_node

    note = "; state directory refuses writes: the quarantine kept in memory only"
    with running_node(tmp_path, "dgx-h100") as node, capture_logs() as logs:
        wait_until(lambda: node.agent.ready() == (True, "ok"), 30, what="the agent ready")
        node.agent.start_publisher(None)  # log only: each condition it would write is logged

        def condition() -> str:
            written = [e for e in logs if e["event"].startswith("node condition (log only")]
            return str(written[-1]["message"]) if written else ""

        wait_until(lambda: condition().startswith("all 8"), 10, what="the first condition")
        writer = node.agent.health.writer
        assert writer is not None
        saved = writer.store.path
        blocked = tmp_path / "blocked"
        blocked.write_text("")
        writer.store.path = blocked / "quarantine.json"  # the disk refuses from now on
        node.agent.hub.report(xid(gpu_ids(node)[0], 79))
        wait_until(lambda: writer.unsaved, 10, what="a failed save")

        ready, detail = node.agent.ready()
        assert ready
        assert detail == "ok, but the disk refuses writes: the quarantine kept in memory only"
        wait_until(lambda: note in condition(), 10, what="the full disk in the condition")
        assert condition().startswith("1 of 8 accelerators unhealthy")

        writer.store.path = saved  # the disk takes writes again: the next try saves it
        writer.flush()  # (the writer's own try comes after RETRY_SECONDS)
        assert not writer.unsaved
        assert node.agent.ready() == (True, "ok")
        wait_until(lambda: note not in condition(), 10, what="the condition without the note")
        assert condition().startswith("1 of 8 accelerators unhealthy")


class RecordedWaits(threading.Event):
    """A wake-up that records how long the part asked to sleep, and stops it after `rounds`."""

    def __init__(self, stop: threading.Event, rounds: int) -> None:
        super().__init__()
        self.stop, self.rounds = stop, rounds
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        if len(self.timeouts) >= self.rounds:
            self.stop.set()
        return True


def test_reset_evidence_sleeps_until_woken_unless_a_device_waits_for_a_reset(
    tmp_path: Path,
) -> None:
    """Nothing waits for a reset: the part asks for no timeout (it wakes only on the hub's
    news); a quarantined GPU that a reset clears is read again every interval (a reset by hand
    sends no event)."""
    hub = HealthHub(DeviceState(INVENTORY), HealthSettings(), boot_id="boot-1")
    stop = threading.Event()
    wake = RecordedWaits(stop, rounds=2)
    part = ResetEvidence(hub, HostRoot.at(str(tmp_path)), wake, interval=lambda: 7.0)
    hub.report(xid("GPU-1", 79, clears_by=ClearsBy.RESET))
    part.run(stop, lambda: None)
    assert wake.timeouts == [7.0, 7.0]
    hub.reset_done({"GPU-1"})
    stop.clear()
    wake = RecordedWaits(stop, rounds=1)
    part = ResetEvidence(hub, HostRoot.at(str(tmp_path)), wake, interval=lambda: 7.0)
    part.run(stop, lambda: None)
    assert wake.timeouts == [None]
