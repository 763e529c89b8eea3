"""The agent's pod-exit watcher against a real API server: pods bound to a KWOK node exit, the
exits land in the durable outbox with the agent's own (RBAC-limited) credential, and the sender
delivers them to a real fault intake once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_test_helpers import KwokCluster, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_intake import AGENT_SA, pod_bound_token, restarter_for, wait_until
from test_node_labels import install_manifest, sa_client

from edl_agent.faults.ids import container_exit_id
from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.faults.outbox import Outbox
from edl_agent.faults.pod_exits import PodExitWatcher
from edl_agent.faults.sender import Sender, SenderSettings
from edl_agent.kube import KubeApi
from tests.parts import running
from tests.parts import stop as stop_parts


@pytest.fixture
def agent_api(k8s: KwokCluster) -> Iterator[tuple[str, str, KubeApi]]:
    """A node, and the agent's API client with the manifest's RBAC and a pod-bound token."""
    undo = install_manifest(k8s)
    node = k8s.create_gpu_node().metadata.name
    token = pod_bound_token(k8s, node, AGENT_SA)
    api = sa_client(k8s.api, token)

    def may_list_pods() -> bool:
        try:
            client.CoreV1Api(api).list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", limit=1
            )
        except ApiException:
            return False
        return True

    wait_for("RBAC to allow listing pods", may_list_pods, bool, timeout=30)
    kube = KubeApi(api)
    yield node, token, kube
    kube.close()
    for action in undo:
        action()


def test_a_pod_exit_is_reported_once(
    k8s: KwokCluster, agent_api: tuple[str, str, KubeApi], tmp_path: Path
) -> None:
    node, token, api = agent_api
    other_node = k8s.create_gpu_node().metadata.name
    pod = k8s.create_pod(node=node)
    elsewhere = k8s.create_pod(node=other_node)
    outbox = Outbox(tmp_path / "state" / "outbox")
    watcher = PodExitWatcher(api, node, outbox.enqueue)
    watching = running(watcher)
    try:
        assert watcher.wait_listed(20)
        k8s.exit_pod(elsewhere.metadata.name, 1)  # another node's pod: not ours to report
        k8s.exit_pod(pod.metadata.name, 137)
        wait_until(what="the exit in the outbox", done=lambda: len(outbox) > 0)
    finally:
        stop_parts(watching)
    assert watcher.failures == 0
    [fault] = outbox.pending()
    uid = pod.metadata.uid
    assert fault.kind is FaultKind.CONTAINER_EXIT
    assert fault.id == container_exit_id(uid, "worker", 0)
    assert fault.node == node
    assert fault.pods == (PodRef(k8s.namespace, pod.metadata.name, uid),)
    assert (fault.container, fault.exit_code) == ("worker", 137)

    # An agent restart lists the pods again: the same exit, the same id, still one entry.
    again = PodExitWatcher(api, node, outbox.enqueue)
    watching = running(again)
    assert again.wait_listed(20)
    stop_parts(watching)
    assert [f.id for f in outbox.pending()] == [fault.id]

    restarter = restarter_for(k8s)
    restarter.server.start()
    token_file = tmp_path / "token"
    token_file.write_text(token)
    settings = SenderSettings(restarter.address, token_file, backoff_initial=0.05)
    sender = Sender(outbox, settings)
    sending = running(sender)
    try:
        wait_until(what="the outbox to empty", done=lambda: len(outbox) == 0)
        # Seen again after it was acknowledged (a third agent start): a duplicate, not a new fault.
        third = PodExitWatcher(api, node, outbox.enqueue)
        watching = running(third)
        assert third.wait_listed(20)
        stop_parts(watching)
        wait_until(what="the duplicate's answer", done=lambda: sender.counts().duplicates == 1)
        assert len(outbox) == 0
    finally:
        stop_parts(sending)
        outbox.close()
        restarter.server.stop(0)
    assert restarter.ids() == {fault.id: 1}
    assert sender.counts().accepted == 1
