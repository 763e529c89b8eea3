"""The kubelet directory watch on real inotify: what wakes the agent, and that it cleans up."""

from __future__ import annotations

import threading
from pathlib import Path

from edl_agent.runtime.dirwatch import DirectoryWatch


class Wakes:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    def wait(self, timeout: float = 5) -> bool:
        woke = self.event.wait(timeout)
        self.event.clear()
        return woke


def _fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_creating_deleting_and_renaming_entries_wake_it(tmp_path: Path) -> None:
    wakes = Wakes()
    watch = DirectoryWatch(tmp_path, wakes)
    assert watch.start()
    try:
        assert not wakes.wait(0.3), "nothing changed yet"
        (tmp_path / "kubelet.sock").write_text("")
        assert wakes.wait()
        (tmp_path / "kubelet.sock").rename(tmp_path / "moved")
        assert wakes.wait()
        (tmp_path / "moved").unlink()
        assert wakes.wait()
        (tmp_path / "moved-in").write_text("")
        assert wakes.wait()
        with (tmp_path / "moved-in").open("a") as handle:
            handle.write("written, not created")
        assert not wakes.wait(0.3), "writing to an entry is no change of the directory"
    finally:
        watch.stop()


def test_a_directory_made_again_is_watched_again(tmp_path: Path) -> None:
    directory = tmp_path / "device-plugins"
    wakes = Wakes()
    watch = DirectoryWatch(directory, wakes)
    assert watch.start()  # the directory does not exist yet
    try:
        directory.mkdir()
        assert wakes.wait(), "a directory that appears is news"
        (directory / "a.sock").write_text("")
        assert wakes.wait()
        (directory / "a.sock").unlink()
        assert wakes.wait()
        directory.rmdir()
        assert wakes.wait()
        directory.mkdir()
        assert wakes.wait(), "made again"
        (directory / "b.sock").write_text("")
        assert wakes.wait(), "its entries are watched again"
    finally:
        watch.stop()


def test_stop_ends_the_thread_and_closes_its_descriptors(tmp_path: Path) -> None:
    before_threads, before_fds = threading.active_count(), _fds()
    watch = DirectoryWatch(tmp_path, Wakes())
    assert watch.start()
    assert watch.active
    assert threading.active_count() == before_threads + 1
    watch.stop()
    assert not watch.active
    assert threading.active_count() == before_threads
    assert _fds() == before_fds
    watch.stop()  # twice is harmless


def test_a_failing_callback_does_not_end_the_watch(tmp_path: Path) -> None:
    wakes = Wakes()
    failed = threading.Event()

    def flaky() -> None:
        if not failed.is_set():
            failed.set()
            msg = "the first call fails"
            raise RuntimeError(msg)
        wakes()

    watch = DirectoryWatch(tmp_path, flaky)
    assert watch.start()
    try:
        (tmp_path / "one").write_text("")
        assert failed.wait(5)
        (tmp_path / "two").write_text("")
        assert wakes.wait()
    finally:
        watch.stop()
