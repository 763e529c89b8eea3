"""What the test trainers share (tests/training/trainer_io.py): the newest checkpoint, and a
checkpoint published whole even when two trainers save the same step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.trainer_io import newest, publish


def test_the_newest_checkpoint_is_the_highest_whole_step(tmp_path: Path) -> None:
    assert newest(tmp_path) == (0, None)
    for name in ("step-50", "step-150", "step-100", ".partial-200-7", "step-x", "notes"):
        (tmp_path / name).mkdir()
    assert newest(tmp_path) == (150, tmp_path / "step-150")


def test_a_checkpoint_appears_only_once_written(tmp_path: Path) -> None:
    seen_during_write: list[bool] = []

    def write(partial: Path) -> None:
        seen_during_write.append((tmp_path / "step-10").exists())
        (partial / "model").write_text("weights")

    publish(tmp_path, 10, write)
    assert seen_during_write == [False]
    assert (tmp_path / "step-10" / "model").read_text() == "weights"
    assert newest(tmp_path) == (10, tmp_path / "step-10")


def test_a_step_saved_already_is_not_written_again(tmp_path: Path) -> None:
    (tmp_path / "step-10").mkdir()
    publish(tmp_path, 10, lambda _partial: pytest.fail("wrote a step that was saved already"))


def test_two_trainers_saving_the_same_step_both_succeed(tmp_path: Path) -> None:
    """The other copy lands while this one writes (a trainer leaving on SIGTERM and rank 0 at
    the same step): no error, and the step is there whole."""

    def write(partial: Path) -> None:
        (partial / "model").write_text("mine")
        other = tmp_path / "step-10"
        other.mkdir()
        (other / "model").write_text("theirs")

    publish(tmp_path, 10, write)
    assert (tmp_path / "step-10" / "model").read_text() == "theirs"


def test_a_failed_rename_with_no_other_copy_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(self: Path, target: Path) -> Path:
        raise OSError(f"renaming {self} to {target}: no space left")

    monkeypatch.setattr(Path, "rename", refused)
    with pytest.raises(OSError, match="no space left"):
        publish(tmp_path, 10, lambda partial: (partial / "model").write_text("mine"))
