"""Fault reports from the node agent: ids, container exits read from pod status, and device
faults from the health stream naming the pods that hold the device."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from edl_agent.agent import Agent
from edl_agent.cli.command import build_parser
from edl_agent.cli.settings import settings_from_args
from edl_agent.config import load_settings
from edl_agent.faults.ids import container_exit_id, device_unhealthy_id
from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.faults.outbox import Outbox
from edl_agent.faults.pod_exits import PodExitWatcher, container_exits
from edl_agent.settings_loader import ConfigError
from edl_agent.sim.inject import inject_xid
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests import waiting
from tests.podresources_standin import PodResourcesStandIn
from tests.test_health_agent import gpu_ids, health_of, watch_gpus
from tests.test_plugin import running_node

wait_until = functools.partial(waiting.wait_until, timeout=20.0)

FINISHED = "2026-05-01T12:00:00Z"


def test_container_exit_ids_are_pure_and_name_the_exit() -> None:
    assert container_exit_id("uid-1", "worker", 3) == "exit/uid-1/worker/3"
    assert container_exit_id("uid-1", "worker", 3) == container_exit_id("uid-1", "worker", 3)
    assert container_exit_id("uid-1", "worker", 3) != container_exit_id("uid-1", "worker", 4)
    assert container_exit_id("uid-1", "worker", 3) != container_exit_id("uid-2", "worker", 3)


def test_device_ids_are_stable_and_bounded() -> None:
    one = device_unhealthy_id("node-a", "GPU-3", "XID79", 12.5)
    assert one == device_unhealthy_id("node-a", "GPU-3", "XID79", 12.5)
    assert one != device_unhealthy_id("node-a", "GPU-3", "XID79", 99.0)
    assert len(device_unhealthy_id("n" * 253, "GPU-3", "XID79", 1.0)) <= 256


def status(name: str, restarts: int, **states: Any) -> dict[str, Any]:
    return {"name": name, "restartCount": restarts, **states}


def terminated(code: int, reason: str = "Error") -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": reason, "finishedAt": FINISHED}}


def test_container_exits_from_pod_status() -> None:
    pod = {
        "metadata": {"namespace": "ml", "name": "trainer", "uid": "u1"},
        "spec": {"nodeName": "node-a"},
        "status": {
            "initContainerStatuses": [status("init", 0, state=terminated(0, "Completed"))],
            "containerStatuses": [
                status("oom", 0, state=terminated(137, "OOMKilled")),
                # Restarted twice: the second exit is in lastState, numbered 1.
                status("flaky", 2, state={"running": {}}, lastState=terminated(1)),
                status("fine", 0, state={"running": {}}),
            ],
            # A `kubectl debug` shell that exited 137 is not the workload failing.
            "ephemeralContainerStatuses": [status("debugger", 0, state=terminated(137))],
        },
    }
    faults = container_exits(pod)
    assert [(f.id, f.container, f.exit_code, f.reason) for f in faults] == [
        ("exit/u1/oom/0", "oom", 137, "OOMKilled"),
        ("exit/u1/flaky/1", "flaky", 1, "Error"),
    ]
    assert {f.kind for f in faults} == {FaultKind.CONTAINER_EXIT}
    assert {f.pods for f in faults} == {(PodRef("ml", "trainer", "u1"),)}
    assert {f.observed_at for f in faults} == {datetime(2026, 5, 1, 12, tzinfo=UTC)}
    assert {f.node for f in faults} == {"node-a"}


class PodsApi:
    """The two calls PodExitWatcher makes, answered from a list and a stream of events."""

    def __init__(self, items: list[dict[str, Any]], events: list[tuple[str, dict[str, Any]]]):
        self.items = items
        self.events = events

    def list_pods(self, field_selector: str) -> dict[str, Any]:
        assert field_selector == "spec.nodeName=node-a"
        return {"metadata": {"resourceVersion": "1"}, "items": self.items}

    def watch_pods(self, field_selector: str, **_: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self.events


def node_pod(name: str, uid: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": name, "uid": uid, "resourceVersion": "2"},
        "spec": {"nodeName": "node-a"},
        "status": status,
    }


def test_the_pod_watcher_reports_each_exit_once_and_remembers_the_node_s_pods() -> None:
    """A re-list after a restart in place still shows the exit (`lastState`): reported once.
    The pods it last saw name a device fault's pods with their uids."""
    restarted = node_pod(
        "trainer", "u1", containerStatuses=[status("main", 1, lastState=terminated(137))]
    )
    gone = node_pod("old", "u0")
    replaced = node_pod("old", "u9")  # a new pod by that name, then the old one's deletion
    api = PodsApi([restarted, gone], [("ADDED", replaced), ("DELETED", gone)])
    reported: list[str] = []
    watcher = PodExitWatcher(api, "node-a", lambda fault: reported.append(fault.id))  # type: ignore[arg-type]
    watcher._list()
    watcher._list()
    watcher._watch("1")
    assert reported == [container_exit_id("u1", "main", 0)]
    assert watcher.pod("ml", "trainer") == restarted
    assert watcher.pod("ml", "old") == replaced  # the old one's deletion did not remove it
    assert watcher.pod("ml", "nobody") is None


def test_run_flags_and_the_simulated_state_dir() -> None:
    args = build_parser().parse_args(
        ["run", "--state-dir", "/srv/edl", "--restarter-address", "127.0.0.1:9443"]
    )
    settings = settings_from_args(args, environ={})
    assert settings.faults.state_dir == "/srv/edl"
    assert settings.faults.restarter_address == "127.0.0.1:9443"
    with pytest.raises(ConfigError, match="ca_file"):
        load_settings(overrides={"faults": {"restarter_address": "10.1.2.3:9443"}})
    insecure = {"restarter_address": "10.1.2.3:9443", "insecure": True}
    assert load_settings(overrides={"faults": insecure}).faults.insecure


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def pod_resources(tmp_path: Path) -> Iterator[PodResourcesStandIn]:
    standin = PodResourcesStandIn(tmp_path / "pod-resources" / "kubelet.sock")
    standin.start()
    yield standin
    standin.stop()


def agent_with_faults(tmp_path: Path, pod_resources: PodResourcesStandIn) -> Agent:
    """An agent on a simulated dgx-h100 (`tmp_path/node`) whose faults wait in its outbox
    (`tmp_path/state`): nothing listens at its restarter's address."""
    profile = load_profile("dgx-h100")
    build_tree(profile, tmp_path / "node")
    (tmp_path / "token").write_text("token")
    (tmp_path / "kubelet").mkdir()
    overrides: dict[str, Any] = {
        "host_root": str(tmp_path / "node"),
        "metrics_addr": "",
        "plugin": {"kubelet_dir": str(tmp_path / "kubelet")},
        "pod_resources_socket": str(pod_resources.socket),
        "faults": {
            "state_dir": str(tmp_path / "state"),
            "restarter_address": f"127.0.0.1:{unused_port()}",
            "token_file": str(tmp_path / "token"),
        },
    }
    return Agent.discover(load_settings(defaults=profile.config, overrides=overrides))


@contextlib.contextmanager
def running_with_faults(agent: Agent) -> Iterator[Outbox]:
    """`agent` running with its fault reports, its NVML watcher started; its outbox."""
    agent.start_faults(None)
    thread = threading.Thread(target=agent.run, name="agent")
    thread.start()
    try:
        assert agent.wait_ready(20)
        outbox = agent.faults.outbox
        assert outbox is not None
        wait_until(
            what="the NVML watcher",
            done=lambda: agent.health.nvml is not None and agent.health.nvml.ready,
        )
        yield outbox
    finally:
        agent.stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_an_xid_on_a_held_gpu_is_a_fault_naming_the_pod(
    tmp_path: Path, pod_resources: PodResourcesStandIn
) -> None:
    tree, state_dir = tmp_path / "node", tmp_path / "state"
    agent = agent_with_faults(tmp_path, pod_resources)
    gpus = {d.index: d for d in agent.state.snapshot().inventory.devices}
    pod_resources.assign({("ml", "trainer-x"): {"main": {"nvidia.com/gpu": [gpus[3].id]}}})
    with running_with_faults(agent) as outbox:
        inject_xid(tree, 5, 79)  # held by no pod: logged, nothing to restart
        inject_xid(tree, 3, 79)
        wait_until(what="GPU 3 unhealthy", done=lambda: gpus[3].id in agent.unhealthy())
        wait_until(what="the device fault", done=lambda: len(outbox) > 0)
        assert gpus[5].id in agent.unhealthy()
    assert agent.faults.outbox is None  # closed on stop, so a restarted agent can open it
    reopened = Outbox(state_dir / "outbox")  # the fault outlives the agent
    try:
        [fault] = reopened.pending()
    finally:
        reopened.close()
    assert fault.kind is FaultKind.DEVICE_UNHEALTHY
    assert fault.device_ids == (gpus[3].id,)
    assert fault.pods == (PodRef("ml", "trainer-x"),)
    assert fault.id.startswith("device/")
    assert fault.id.endswith("/ml/trainer-x")  # one fault per pod
    assert fault.reason == "XID79"
    assert fault.node == agent.state.snapshot().inventory.node
    assert "ml/trainer-x/main" in fault.detail


def test_a_device_fault_waits_for_kubelets_pod_resources_answer_instead_of_being_dropped(
    tmp_path: Path, pod_resources: PodResourcesStandIn
) -> None:
    """kubelet's pod-resources API failing when the XID comes is not "held by no pod": the fault
    is reported, naming the pod, once kubelet answers again."""
    profile = load_profile("dgx-h100")
    tree = tmp_path / "node"
    build_tree(profile, tree)
    (tmp_path / "token").write_text("token")
    settings = load_settings(
        defaults=profile.config,
        overrides={
            "host_root": str(tree),
            "metrics_addr": "",
            "plugin": {"kubelet_dir": str(tmp_path / "kubelet"), "health_poll_seconds": 0.1},
            "pod_resources_socket": str(pod_resources.socket),
            "faults": {
                "state_dir": str(tmp_path / "state"),
                "restarter_address": f"127.0.0.1:{unused_port()}",
                "token_file": str(tmp_path / "token"),
            },
        },
    )
    (tmp_path / "kubelet").mkdir()
    agent = Agent.discover(settings)
    gpus = {d.index: d for d in agent.state.snapshot().inventory.devices}
    pod_resources.assign({("ml", "trainer-y"): {"main": {"nvidia.com/gpu": [gpus[2].id]}}})
    pod_resources.fail_with(grpc.StatusCode.UNAVAILABLE)
    agent.start_faults(None)
    thread = threading.Thread(target=agent.run, name="agent")
    thread.start()
    try:
        assert agent.wait_ready(20)
        outbox = agent.faults.outbox
        assert outbox is not None
        wait_until(
            what="the NVML watcher",
            done=lambda: agent.health.nvml is not None and agent.health.nvml.ready,
        )
        inject_xid(tree, 2, 79)
        wait_until(what="GPU 2 unhealthy", done=lambda: gpus[2].id in agent.unhealthy())
        calls = pod_resources.calls
        wait_until(what="asked again", done=lambda: pod_resources.calls > calls)
        assert len(outbox) == 0
        pod_resources.fail_with(None)
        wait_until(what="the device fault", done=lambda: len(outbox) > 0)
        [fault] = outbox.pending()
        assert fault.pods == (PodRef("ml", "trainer-y"),)
        assert fault.device_ids == (gpus[2].id,)
    finally:
        agent.stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_xids_reach_list_and_watch_while_kubelets_pod_resources_api_hangs(
    tmp_path: Path, pod_resources: PodResourcesStandIn
) -> None:
    """Device faults ask kubelet who holds a device that turned Unhealthy; a kubelet whose List
    never answers holds up only that part. A burst of XIDs on every GPU, through the real NVML
    event path, turns each GPU Unhealthy in ListAndWatch while the first List still hangs (the
    client's timeout is longer than the whole test may wait)."""
    extra = {"pod_resources_socket": str(pod_resources.socket)}
    with running_node(
        tmp_path, "dgx-h100", extra=extra, faults=True, agent_args={"pod_resources_timeout": 60.0}
    ) as node:
        ids = gpu_ids(node)
        pod_resources.assign({("ml", "trainer-z"): {"main": {"nvidia.com/gpu": ids}}})
        watch = watch_gpus(node)
        nvml = node.agent.health.nvml
        wait_until(what="the NVML watcher", done=lambda: nvml is not None and nvml.ready)
        pod_resources.hang()
        try:
            inject_xid(node.tree, 0, 79)
            watch.until(lambda u: health_of(u)[ids[0]] == "Unhealthy")
            wait_until(
                what="the device-fault part asking kubelet", done=lambda: pod_resources.calls > 0
            )
            started = time.monotonic()
            for index in range(1, 8):
                inject_xid(node.tree, index, 79)
            update = watch.until(lambda u: set(health_of(u).values()) == {"Unhealthy"})
            took = time.monotonic() - started
            print(f"7 XIDs to Unhealthy with a hanging pod-resources API: {took:.3f} s")
            assert len(update.devices) == 8
            assert pod_resources.calls == 1  # still the first List, unanswered all along
        finally:
            pod_resources.answer_again()
            watch.cancel()
