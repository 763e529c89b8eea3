"""The node's rounds are quiet when nothing happens: device-node presence is checked when a
device directory changes (inotify), not on a short timer; the plugin round waits 5 s while all
is registered and kubelet's directory is watched, 0.25 s only while a registration is due."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from edl_agent.health.presence_watch import PresenceRound
from edl_agent.plugin.round import PluginRound
from tests.waiting import wait_until


def test_a_vanished_device_node_is_seen_at_once_with_no_timer(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    node = dev / "nvidia0"
    node.write_text("")
    gone = threading.Event()

    def check() -> None:
        if not node.exists():
            gone.set()

    presence = PresenceRound(
        check=check,
        directories=lambda: [dev],
        wake=threading.Event(),
        poll_seconds=lambda: 3600.0,  # a timer would come far too late for this test
        backstop_seconds=3600.0,
    )
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=presence.run, args=(stop, ready.set))
    thread.start()
    try:
        assert ready.wait(10)
        assert presence.watched
        assert presence.next_wait() == 3600.0
        node.unlink()
        assert gone.wait(10)
    finally:
        stop.set()
        presence.wake.set()
        thread.join(10)
    assert not thread.is_alive()
    assert not presence.watched  # its watches were stopped with it


class Plugins:
    """What the plugin round asks of the plugin manager."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registering = False
        self.synced = 0

    def sync(self) -> None:
        self.synced += 1


def test_the_plugin_round_sleeps_until_woken_unless_a_registration_is_due(tmp_path: Path) -> None:
    plugins = Plugins(tmp_path)
    guarded: Callable[[str, Callable[[], None]], None] = lambda _, action: action()  # noqa: E731
    assert PluginRound(plugins, threading.Event(), guarded=guarded).watched_tick_seconds == 5.0  # type: ignore[arg-type]
    wake = threading.Event()
    served = PluginRound(plugins, wake, guarded=guarded, watched_tick_seconds=3600.0)  # type: ignore[arg-type]
    stop = threading.Event()
    thread = threading.Thread(target=served.run, args=(stop, lambda: None))
    thread.start()
    try:
        assert served.served.wait(10)
        assert served.watched
        assert served.next_wait() is None
        plugins.registering = True
        assert served.next_wait() == 0.25
        plugins.registering = False
        synced = plugins.synced
        (tmp_path / "kubelet.sock").write_text("")  # kubelet restarted: a round at once
        wait_until(lambda: plugins.synced > synced, timeout=10)
    finally:
        stop.set()
        wake.set()
        thread.join(10)
    assert not thread.is_alive()


def test_a_failed_plugin_round_is_tried_again_after_the_watched_tick(tmp_path: Path) -> None:
    plugins = Plugins(tmp_path)
    failing: list[str] = []

    def guarded(step: str, action: Callable[[], None]) -> None:
        try:
            action()
        except RuntimeError:
            failing.append(step)

    def broken() -> None:
        msg = "kubelet's directory cannot be made"
        raise RuntimeError(msg)

    rounds = PluginRound(plugins, threading.Event(), guarded=guarded, watched_tick_seconds=7.0)  # type: ignore[arg-type]
    rounds.watched = True
    plugins.sync = broken  # type: ignore[method-assign]
    rounds.sync()
    assert failing == ["plugins"]
    assert rounds.next_wait() == 7.0
    del plugins.sync
    rounds.sync()
    assert rounds.next_wait() is None
