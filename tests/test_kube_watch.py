"""WatchLoop.stop() at any moment: also between watches, when the last one's connection is
back in urllib3's pool and urllib3 refuses to shut it down."""

from __future__ import annotations

from edl_agent.kube_watch import WatchLoop


class Released:
    """What urllib3 (>= 2.3) answers once a response's connection went back to the pool."""

    def __init__(self) -> None:
        self.calls = 0

    def shutdown(self) -> None:
        self.calls += 1
        msg = "Cannot shutdown as connection has already been released to the pool"
        raise RuntimeError(msg)


def test_stop_after_the_watch_ended_does_not_raise() -> None:
    loop = WatchLoop(log_context={"watch": "test"})
    released = Released()
    loop._opened(released)
    loop.stop()
    assert released.calls == 1
