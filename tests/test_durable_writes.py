"""State files written whole or not at all, and never through a link planted beside them: the
quarantine and the prepared DRA claims are written by root into the agent's state directory, so
a name that points elsewhere must not turn a write into an overwrite of another file."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from edl_agent.dra.checkpoint import PreparedClaim, PreparedClaims, PreparedDevice
from edl_agent.faults.model import Fault, FaultKind
from edl_agent.faults.outbox import Outbox
from edl_agent.health.quarantine_store import Quarantine, QuarantineStore
from edl_agent.labels.features import write_features_file
from edl_agent.runtime.durable import write_atomically

VICTIM_TEXT = "not the agent's to write\n"


def plant_link(state_file: Path, victim: Path) -> Path:
    """A symlink where the writer's temporary file used to be: `<state file>.tmp`."""
    victim.write_text(VICTIM_TEXT)
    link = state_file.with_name(state_file.name + ".tmp")
    link.symlink_to(victim)
    return link


def mode_of_a_new_file(directory: Path) -> int:
    """What a file made with open() in `directory` gets: 0666 less this process's umask."""
    probe = directory / "probe"
    probe.write_text("")
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    return mode


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replaced"])
def test_a_link_at_the_temporary_name_is_not_followed(tmp_path: Path, existing: bool) -> None:
    state = tmp_path / "state" / "health" / "quarantine.json"
    state.parent.mkdir(parents=True)
    if existing:
        state.write_text("{}\n")
    victim = tmp_path / "victim"
    plant_link(state, victim)

    write_atomically(state, '{"format": 1}\n')

    assert victim.read_text() == VICTIM_TEXT
    assert not state.is_symlink()
    assert stat.S_ISREG(state.lstat().st_mode)
    assert state.read_text() == '{"format": 1}\n'
    assert stat.S_IMODE(state.stat().st_mode) == mode_of_a_new_file(state.parent)
    assert sorted(p.name for p in state.parent.iterdir()) == ["quarantine.json"]


def test_a_link_to_a_directory_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    state = tmp_path / "prepared.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state.with_name("prepared.json.tmp").symlink_to(elsewhere)

    write_atomically(state, "{}\n")

    assert state.read_text() == "{}\n"
    assert list(elsewhere.iterdir()) == []


def test_a_failed_write_leaves_what_was_there_and_no_temporary(tmp_path: Path) -> None:
    state = tmp_path / "prepared.json"
    state.mkdir()
    (state / "inside").write_text("kept\n")  # no file renames over a directory
    with pytest.raises(IsADirectoryError):
        write_atomically(state, "{}\n")
    assert (state / "inside").read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared.json"]


def test_the_quarantine_is_saved_past_a_planted_link(tmp_path: Path) -> None:
    store = QuarantineStore(tmp_path / "health", wall=lambda: 1000.0, monotonic=lambda: 10.0)
    store.path.parent.mkdir()
    victim = tmp_path / "victim"
    plant_link(store.path, victim)

    assert store.save(Quarantine(boot_id="boot-1"))

    assert victim.read_text() == VICTIM_TEXT
    assert stat.S_ISREG(store.path.lstat().st_mode)
    assert json.loads(store.path.read_text())["boot_id"] == "boot-1"
    again = QuarantineStore(tmp_path / "health").load()
    assert again is not None
    assert again.boot_id == "boot-1"


def test_prepared_claims_are_saved_past_a_planted_link(tmp_path: Path) -> None:
    claims = PreparedClaims(tmp_path)
    claims.path.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    plant_link(claims.path, victim)
    device = PreparedDevice(requests=("gpu",), pool="node-a", device="gpu-0", cdi_ids=())
    claim = PreparedClaim(
        uid="uid-1", namespace="ns", name="claim", driver="gpu.edl.io", devices=(device,)
    )

    claims.put(claim)

    assert victim.read_text() == VICTIM_TEXT
    assert stat.S_ISREG(claims.path.lstat().st_mode)
    assert PreparedClaims(tmp_path).get("gpu.edl.io", "uid-1") == claim


def test_an_outbox_entry_is_written_past_a_planted_link(tmp_path: Path) -> None:
    directory = tmp_path / "outbox"
    outbox = Outbox(directory)
    try:
        victim = tmp_path / "victim"
        plant_link(directory / f"{1:020d}.json", victim)
        outbox.enqueue(
            Fault(
                id="device/n1/GPU-1/XID79",
                kind=FaultKind.DEVICE_UNHEALTHY,
                node="n1",
                observed_at=datetime(2026, 11, 28, tzinfo=UTC),
            )
        )
    finally:
        outbox.close()
    assert victim.read_text() == VICTIM_TEXT
    [entry] = list(directory.glob("*.json"))
    assert entry.name == f"{1:020d}.json"  # where the link was planted
    assert stat.S_ISREG(entry.lstat().st_mode)
    assert "device/n1/GPU-1/XID79" in entry.read_text()


def test_the_feature_file_is_written_past_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "features.d" / "edl-agent"
    target.parent.mkdir()
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    target.with_name(".edl-agent.tmp").symlink_to(victim)
    assert write_features_file(target, {"edl.io/accelerator.count": "8"})
    assert victim.read_text() == VICTIM_TEXT
    assert target.read_text() == "edl.io/accelerator.count=8\n"
