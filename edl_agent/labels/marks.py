"""An operator's marks on the Node, acted on: devices cordoned by the node annotation are
advertised Unhealthy until uncordoned, and devices released (`edl.io/release-devices`) end every
quarantine of theirs, whatever it waited for. The node publisher reads the annotations and calls
these; the health hub does the rest."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from edl_agent.health.hub import HealthHub
from edl_agent.labels.cordon import Cordon
from edl_agent.labels.events import NORMAL, EventSpec


class OperatorMarks:
    def __init__(self, hub: HealthHub, announce: Callable[[EventSpec], None]) -> None:
        self._hub = hub
        self._announce = announce
        self._log = structlog.get_logger().bind(part="node-publisher")

    def cordon(self, cordon: Cordon) -> None:
        if self._hub.set_cordon(cordon.device_ids):
            self._log.info(
                "cordoned devices changed",
                cordoned=sorted(cordon.device_ids) or None,
                unknown=list(cordon.unknown) or None,
            )

    def release(self, released: Cordon) -> None:
        changes = self._hub.release(released.device_ids)
        if changes:
            names = ", ".join(c.device_id for c in changes)
            message = f"released by an operator: {names}"
            self._announce(EventSpec(NORMAL, "AcceleratorReleased", message))
        self._log.warning(
            "devices released by an operator",
            released=sorted(released.device_ids) or None,
            back_in_service=[c.device_id for c in changes] or None,
            unknown=list(released.unknown) or None,
        )
