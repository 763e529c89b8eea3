"""SIGTERM and SIGINT turned into a stop, with a handler that can neither block nor re-enter.

Python runs a signal handler on the main thread between two bytecodes, also while that thread
holds a lock. A handler that sets a `threading.Event` takes the event's lock: a second signal
arriving while the first handler is inside `Event.set` runs the handler again on the same
thread, which then waits for the lock it holds — for ever. And when the kernel hands the signal
to another thread while the main thread blocks in a lock, the Python handler does not run at
all until the main thread wakes — which may be never. So the signal reaches a pipe at C level
(`signal.set_wakeup_fd`: the interpreter's own handler writes the signal number, in whichever
thread took it), the Python handler does nothing that can block, and a thread of its own reads
the pipe and sets the stop once. Any number of signals, in any rhythm, stop the process once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Bytes on the pipe besides the signal numbers the wakeup fd writes (all below 65).
STOP_BYTE = 0x21  # "!": a direct call of the handler
END_BYTE = 0x2E  # ".": the block ends
Handler = Callable[[int, FrameType | None], object] | int | None


@contextlib.contextmanager
def stop_on_signals(
    stop: Callable[[], object], signals: Sequence[signal.Signals] = STOP_SIGNALS
) -> Iterator[Callable[[int, FrameType | None], None]]:
    """While the block runs, each of `signals` calls `stop()` (once, on a thread of its own).
    Yields the installed handler; the previous handlers are back afterwards. Main thread only,
    as `signal.signal` requires."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(read_end, True)

    def handler(_signum: int, _frame: FrameType | None) -> None:
        # The wakeup fd already carries a real signal; this covers a direct call.
        with contextlib.suppress(OSError):  # a full pipe already says "stop"
            os.write(write_end, bytes([STOP_BYTE]))

    wanted = {int(signum) for signum in signals} | {STOP_BYTE}

    def relay() -> None:
        stopped = False
        while True:
            try:
                got = os.read(read_end, 64)
            except OSError:
                return
            if wanted.intersection(got) and not stopped:
                stopped = True
                stop()
            if not got or END_BYTE in got:
                return

    thread = threading.Thread(target=relay, name="stop-signals", daemon=True)
    thread.start()
    previous: dict[signal.Signals, Handler] = {}
    old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    try:
        for signum in signals:
            previous[signum] = signal.signal(signum, handler)
        yield handler
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        signal.set_wakeup_fd(old_fd)
        with contextlib.suppress(OSError):
            os.set_blocking(write_end, True)
            os.write(write_end, bytes([END_BYTE]))  # the relay's own stop
        thread.join(timeout=5.0)
        os.close(write_end)
        os.close(read_end)
