"""The controller wired to a real API server: the adapters that build Kubernetes API clients
(the pod and node watcher, the policy watch, the actuator, the Event writer) around the
`controller.Controller`, which knows only its ports."""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from kubernetes import client

from edl_agent.faults.model import Fault
from edl_agent.restarter.adapters.actuator import GROUP, PLURAL, VERSION, Actuator
from edl_agent.restarter.adapters.events import EventWriter
from edl_agent.restarter.adapters.list_watch import ListWatch
from edl_agent.restarter.adapters.watchers import ClusterWatcher
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.runtime.supervisor import Part


class PolicyWatch:
    """List+watch of FaultTolerancePolicy objects (in `namespaces`, or all), into the
    controller's policy cache (`PolicyCache.listed`, `PolicyCache.event`)."""

    def __init__(
        self,
        api: client.ApiClient,
        namespaces: Iterable[str],
        *,
        on_list: Callable[[str | None, list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
    ) -> None:
        objects: Any = client.CustomObjectsApi(api)
        self._watches = []
        scopes: list[str | None] = [*namespaces] or [None]
        for namespace in scopes:

            def call(ns: str | None = namespace, **kwargs: Any) -> Any:
                if ns is None:
                    return objects.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)
                return objects.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, **kwargs)

            self._watches.append(
                ListWatch(
                    f"policies/{namespace or '*'}",
                    call,
                    on_list=functools.partial(on_list, namespace),
                    on_event=on_event,
                )
            )

    def parts(self) -> list[Part]:
        """One supervised part per watch, ready once listed."""
        return list(self._watches)

    def stop(self) -> None:
        for watch in self._watches:
            watch.stop()

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.synced.wait(max(0.0, deadline - time.monotonic())) for w in self._watches)


def connect(
    api: client.ApiClient,
    *,
    namespaces: Iterable[str] = (),
    node_grace: float = 40.0,
    drop_labels: Iterable[str] | None = None,
    metrics: RestarterMetrics | None = None,
    events: EventWriter | None = None,
    settings: ControllerSettings | None = None,
    **options: Any,
) -> Controller:
    """A Controller on the API server `api`: pods and nodes (in `namespaces`, or all) watched
    for faults, policies watched, pods replaced by the `Actuator` (keeping labels but
    `drop_labels`). `settings`: the controller's tunables; `options` go to `Controller` (storm,
    storm_object, clock, ...)."""
    settings = settings or ControllerSettings()
    namespaces = list(namespaces)
    metrics = metrics or RestarterMetrics()
    controllers: list[Controller] = []

    def submit(fault: Fault) -> None:  # the controller is made after its watcher
        controllers[0].submit(fault)

    def nodes_changed() -> None:
        controllers[0].nodes_changed()

    watcher = ClusterWatcher(
        api,
        on_fault=submit,
        namespaces=namespaces,
        node_grace=node_grace,
        on_nodes=nodes_changed,
    )
    actuator = Actuator(
        api,
        before_delete=watcher.ignore_uid,
        drop_labels=drop_labels,
        on_write=lambda what: metrics.api_writes.labels(what).inc(),
    )
    controller = Controller(
        port=actuator,
        pods=watcher,
        sources=[watcher],
        metrics=metrics,
        events=events or EventWriter(api, instance=socket.gethostname()),
        settings=settings,
        **options,
    )
    controllers.append(controller)
    controller.add_source(
        PolicyWatch(
            api,
            namespaces,
            on_list=controller.policies.listed,
            on_event=controller.policies.event,
        )
    )
    return controller
