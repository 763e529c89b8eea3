"""The durable outbox: what survives a re-open, in which order, corrupt entries, the bound."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.outbox import ATTACH_RETRY_SECONDS, Outbox, OutboxError

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def fault(n: int, node: str = "gpu-node-1") -> Fault:
    return Fault(
        id=f"fault-{n}",
        kind=FaultKind.CONTAINER_EXIT,
        node=node,
        observed_at=T0 + timedelta(seconds=n),
        pods=(PodRef("ml", f"worker-{n}", f"uid-{n}"),),
        container="worker",
        exit_code=n,
        reason="Error",
    )


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".json"))


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Outbox]:
    outbox = Outbox(tmp_path / "outbox")
    yield outbox
    outbox.close()


def reopen(outbox: Outbox, **kw: int) -> Outbox:
    outbox.close()
    return Outbox(outbox.directory, **kw)


def test_faults_survive_a_reopen_in_order(box: Outbox) -> None:
    faults = [fault(n) for n in (3, 1, 2)]
    for f in faults:
        assert box.enqueue(f)
    again = reopen(box)
    try:
        assert again.pending() == faults
        assert again.pending(limit=2) == faults[:2]
        again.enqueue(fault(9))
        assert again.pending()[-1] == fault(9)  # numbering continues after what was there
    finally:
        again.close()


def test_one_entry_per_id(box: Outbox) -> None:
    assert box.enqueue(fault(1))
    assert not box.enqueue(fault(1))
    assert len(box) == 1
    assert len(entries(box.directory)) == 1
    assert box.counts().enqueued == 1


def test_ack_removes_for_good(box: Outbox) -> None:
    for n in range(3):
        box.enqueue(fault(n))
    assert box.ack(["fault-1", "fault-unknown"]) == 1
    assert [f.id for f in box.pending()] == ["fault-0", "fault-2"]
    again = reopen(box)
    try:
        assert [f.id for f in again.pending()] == ["fault-0", "fault-2"]
        assert again.ack(["fault-0", "fault-2"]) == 2
        assert entries(again.directory) == []
    finally:
        again.close()


def test_an_acked_id_may_be_enqueued_again(box: Outbox) -> None:
    box.enqueue(fault(1))
    box.ack(["fault-1"])
    assert box.enqueue(fault(1))


def test_entries_are_readable_json(box: Outbox) -> None:
    box.enqueue(fault(7))
    (name,) = entries(box.directory)
    text = (box.directory / name).read_text()
    assert '"id": "fault-7"' in text
    assert '"kind": "FAULT_KIND_CONTAINER_EXIT"' in text
    assert '"observed_at": "2026-05-01T12:00:07Z"' in text


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"id": "x"}',  # no kind, node or time
        b'{"id": "x", "kind": "NOPE", "node": "n", "observed_at": "2026-05-01T12:00:00Z"}',
        b"[1, 2]",
        b"\xff\xfe\x00",
        b"",
        b" " * (1 << 20) + b"{}",
    ],
)
def test_corrupt_entries_are_set_aside(box: Outbox, content: bytes) -> None:
    for n in (1, 2, 3):
        box.enqueue(fault(n))
    (box.directory / "00000000000000000002.json").write_bytes(content)  # fault-2's entry
    with capture_logs() as logs:
        again = reopen(box)
    try:
        assert [f.id for f in again.pending()] == ["fault-1", "fault-3"]
        assert again.counts().corrupt == 1
        aside = list((again.directory / "corrupt").iterdir())
        assert [p.name.split(".json.")[0] for p in aside] == ["00000000000000000002"]
        assert aside[0].read_bytes() == content
        assert any(e["event"] == "outbox: set a corrupt entry aside" for e in logs)
    finally:
        again.close()


def test_unfinished_writes_and_strangers(box: Outbox) -> None:
    box.enqueue(fault(1))
    (box.directory / "00000000000000000002.json.tmp").write_text("half a fau")
    (box.directory / "README").write_text("not ours")
    again = reopen(box)
    try:
        assert [f.id for f in again.pending()] == ["fault-1"]
        assert not (again.directory / "00000000000000000002.json.tmp").exists()
        assert (again.directory / "README").exists()
        assert again.counts().corrupt == 0
    finally:
        again.close()


def test_a_second_entry_for_one_id_is_removed(box: Outbox) -> None:
    box.enqueue(fault(1))
    (first,) = entries(box.directory)
    (box.directory / "00000000000000000005.json").write_bytes((box.directory / first).read_bytes())
    again = reopen(box)
    try:
        assert len(again) == 1
        assert entries(again.directory) == [first]
    finally:
        again.close()


def test_full_outbox_drops_the_oldest(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, max_entries=3)
    try:
        with capture_logs() as logs:
            for n in range(5):
                outbox.enqueue(fault(n))
        assert [f.id for f in outbox.pending()] == ["fault-2", "fault-3", "fault-4"]
        assert outbox.counts().dropped == 2
        assert len(entries(tmp_path)) == 3
        dropped = [
            e["fault_id"] for e in logs if e["event"] == "outbox full: dropped the oldest fault"
        ]
        assert dropped == ["fault-0", "fault-1"]
    finally:
        outbox.close()
    smaller = Outbox(tmp_path, max_entries=2)  # a lower bound applies to what is on disk too
    try:
        assert [f.id for f in smaller.pending()] == ["fault-3", "fault-4"]
        assert smaller.counts().dropped == 1
    finally:
        smaller.close()


def test_one_owner_per_directory(box: Outbox) -> None:
    with pytest.raises(OutboxError, match="another process holds"):
        Outbox(box.directory)
    box.close()
    Outbox(box.directory).close()


def test_a_closed_outbox_takes_nothing(box: Outbox) -> None:
    box.close()
    with pytest.raises(OutboxError, match="closed"):
        box.enqueue(fault(1))


def test_a_directory_the_disk_refuses_at_start_is_taken_once_it_can_be(tmp_path: Path) -> None:
    blocked = tmp_path / "state"
    blocked.write_text("")  # mkdir fails (ENOTDIR), as on a full or read-only disk
    now = [0.0]
    with capture_logs() as logs:
        outbox = Outbox(blocked / "outbox", clock=lambda: now[0])  # no error: in memory
        for n in (1, 2, 3):
            assert outbox.enqueue(fault(n))
        assert [f.id for f in outbox.pending()] == ["fault-1", "fault-2", "fault-3"]
    try:
        assert not outbox.on_disk
        assert outbox.counts().in_memory == 3
        assert [entry["log_level"] for entry in logs] == ["error"]  # once, not per fault
        blocked.unlink()  # the disk works again
        outbox.pending()
        assert not outbox.on_disk  # not tried again before ATTACH_RETRY_SECONDS
        now[0] = ATTACH_RETRY_SECONDS
        outbox.ack(["fault-2"])

        assert [f.id for f in outbox.pending()] == ["fault-1", "fault-3"]

        assert outbox.on_disk
        assert outbox.counts().in_memory == 0
        assert len(entries(outbox.directory)) == 2
    finally:
        outbox.close()
    again = Outbox(blocked / "outbox")  # what it kept survives a restart now
    try:
        assert [f.id for f in again.pending()] == ["fault-1", "fault-3"]
    finally:
        again.close()


def test_a_refused_write_keeps_the_fault_in_memory(
    box: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with capture_logs() as logs:
        assert box.enqueue(fault(1))
    monkeypatch.undo()
    assert [f.id for f in box.pending()] == ["fault-1"]
    assert box.counts().write_errors == 1
    assert entries(box.directory) == []
    assert not [p for p in box.directory.iterdir() if p.name.endswith(".tmp")]
    assert logs[0]["log_level"] == "error"
    assert box.ack(["fault-1"]) == 1


def test_a_fault_kept_in_memory_is_written_once_the_disk_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    outbox = Outbox(tmp_path / "outbox", clock=lambda: now[0])
    try:

        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", full)
        assert outbox.enqueue(fault(1))
        monkeypatch.undo()
        assert outbox.counts().in_memory == 1
        outbox.pending()
        assert entries(outbox.directory) == []  # not before ATTACH_RETRY_SECONDS
        now[0] = ATTACH_RETRY_SECONDS

        assert [f.id for f in outbox.pending()] == ["fault-1"]

        assert len(entries(outbox.directory)) == 1
        assert outbox.counts().in_memory == 0
    finally:
        outbox.close()


def test_memory_listeners_hear_when_faults_start_and_stop_being_kept_in_memory_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    outbox = Outbox(tmp_path / "outbox", clock=lambda: now[0])
    turns: list[int] = []
    outbox.add_memory_listener(lambda: turns.append(outbox.counts().in_memory))
    try:

        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        outbox.enqueue(fault(1))  # written: nothing to hear
        monkeypatch.setattr(os, "fsync", full)
        outbox.enqueue(fault(2))
        outbox.enqueue(fault(3))
        assert turns == [1]  # once as it starts, not per fault
        outbox.ack(["fault-2"])
        assert turns == [1]  # fault-3 still only in memory
        monkeypatch.undo()
        now[0] = ATTACH_RETRY_SECONDS
        outbox.pending()  # the disk takes fault-3
        assert turns == [1, 0]
        monkeypatch.setattr(os, "fsync", full)
        outbox.enqueue(fault(4))
        outbox.ack(["fault-4"])  # acknowledged before the disk took it
        assert turns == [1, 0, 1, 0]
    finally:
        outbox.close()


def test_listeners_hear_of_new_faults_only(box: Outbox) -> None:
    heard: list[int] = []
    box.add_listener(lambda: heard.append(len(box)))
    box.enqueue(fault(1))
    box.enqueue(fault(1))
    box.enqueue(fault(2))
    assert heard == [1, 2]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(0, 9)),
        st.tuples(st.just("ack"), st.integers(0, 9)),
        st.tuples(st.just("reopen"), st.just(0)),
    ),
    max_size=30,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(OPS)
def test_matches_a_list_through_any_history(tmp_path: Path, ops: list[tuple[str, int]]) -> None:
    directory = tmp_path / f"h{len(list(tmp_path.iterdir()))}"
    outbox = Outbox(directory, max_entries=5)
    model: list[str] = []
    try:
        for op, n in ops:
            if op == "enqueue":
                assert outbox.enqueue(fault(n)) == (f"fault-{n}" not in model)
                if f"fault-{n}" not in model:
                    model = [*model, f"fault-{n}"][-5:]
            elif op == "ack":
                assert outbox.ack([f"fault-{n}"]) == (f"fault-{n}" in model)
                model = [i for i in model if i != f"fault-{n}"]
            else:
                outbox = reopen(outbox, max_entries=5)
            assert [f.id for f in outbox.pending()] == model
    finally:
        outbox.close()
