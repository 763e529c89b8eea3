"""Steps inside a part's round that must not end the round: the plugin round's sync, the
presence check. A part that dies is the supervisor's business; a step that fails is this one's,
so that the rest of its round (and the next round) still runs.

A failure is counted (`failures`, for `edl_agent_step_failures_total{step}`) and logged when the
step starts failing (with its traceback) or fails differently, not at every round while it
lasts; its end is logged too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import structlog


class Steps:
    def __init__(self) -> None:
        self.failures: Counter[str] = Counter()
        self._failing: dict[str, str] = {}  # step → its error, while it fails
        self._log = structlog.get_logger()

    def run(self, step: str, action: Callable[[], None]) -> None:
        """Run `action`, one step called `step`; a failure is counted and logged, not raised."""
        try:
            action()
        except Exception as exc:
            self.failures[step] += 1
            error = f"{type(exc).__name__}: {exc}"
            previous = self._failing.get(step)
            self._failing[step] = error
            if previous is None:
                self._log.exception("agent step failed", step=step)
            elif previous != error:
                self._log.error("agent step still fails", step=step, error=error)
            return
        if self._failing.pop(step, None) is not None:
            self._log.info("agent step works again", step=step, failures=self.failures[step])

    def failing(self, step: str) -> bool:
        """Whether `step`'s last run failed."""
        return step in self._failing
