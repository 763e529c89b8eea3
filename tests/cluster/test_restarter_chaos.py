"""Chaos on the real API server with KWOK: hundreds of faults of every kind while the restarter
leader is SIGKILLed at random moments and the API server restarts once. Every fault that
should restart restarts its slot exactly once: no slot replaced twice for one fault, none
forgotten, the policies' restart counts equal to the faults, backoffs honoured after failover.

The harness (chaos_harness.py) plays the rest of the cluster: KWOK nodes and bare pods, one
per *slot* (a slot is a pod and its replacements, `edl.io/base-name`); the scheduler (it binds
replacements to Ready nodes that their affinity allows); node agents (they report through the
fault intake with tokens bound to their node, resending until acknowledged); a Deployment of
two restarter processes (respawned when one exits). It works in rounds: each round faults the
newest pod of most slots at once, and waits for every replacement to exist and run before the
next round faults it again, so each slot's expected restart count is known exactly:

  exit          KWOK ends the container with a restarting code (the restarter's watch sees it)
  exit+agent    the same, and the agent on the node reports that exit too (the same fault id)
  device        only the agent reports it: DeviceUnhealthy naming the pod on its node; a third
                of them oversized (1,600 device ids of 1 KB, a 100 KB detail: cut at the
                intake), a third dated by a clock an hour fast (taken as observed on receipt)
  force-delete  the pod is deleted with grace 0 while running
  not-ready     its node turns NotReady (KWOK) for longer than the restarter's node grace
  ignored-exit  an exit no rule restarts: must never be replaced

Six rounds at least (more until 300 faults were sent), each with one SIGKILL of the leader at
a random moment in its first four seconds; one of the first rounds also restarts the API
server while its faults are in flight (testcluster.restart_apiserver). That round makes no
force deletions: a pod deleted while no replica leads is seen by the next leader only in the
pod watch's history since its predecessor's checkpoint, and an API server that restarts keeps
no such history (the README's restarter section states this limit).

The verdict, per slot: its generations (every pod the ledger saw, by `edl.io/restart-count`)
are exactly its restarting faults. Fewer is *lost*; more, a count made twice (two pods of one
name) or a replacement seen before its fault is *doubled*. Each job's counts in its policy's
status must equal its faults, and no replacement of the slow policy may be seen before its
fault's time plus its backoff. The test prints `chaos: faults sent N, acted on A, lost L,
doubled D | ...` (with -s, or on failure) and fails on L or D, listing each such slot with its
faults, what became of them and the restarter's log lines about it. Trouble of the harness's
own (too few kills, no API server restart) fails apart, as "harness trouble".

    .venv/bin/pytest tests/cluster/test_restarter_chaos.py -s     # 2 to 4 minutes on 2 cores

Random choices come from one seed (printed; EDL_CHAOS_SEED sets it); timing still varies.
"""

from __future__ import annotations

import functools
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import testcluster
import yaml
from chaos_harness import (
    AgentStandIn,
    Delivery,
    PodLedger,
    PodSeen,
    RestarterFleet,
    ignore_missing,
    log_lines,
    quiet_client,
    retry,
    wall,
)
from k8s_test_helpers import (
    NODE_NOT_READY_LABEL,
    POD_FAIL_EXIT_CODE,
    POD_FAIL_LABEL,
    KwokCluster,
    bound_tokens,
    node_ready,
    wait_for,
)
from kubernetes import client

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.ids import container_exit_id

CRD = Path(__file__).resolve().parents[2] / "deploy" / "daemonset" / "crd-faulttolerancepolicy.yaml"
GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
APP, GROUP_LABEL = "chaos", "edl.test/group"
JOB, TYPE, INDEX = "edl.test/job", "edl.test/replica-type", "edl.test/replica-index"
AGENT_SA, AUDIENCE = "edl-agent", "edl-restarter"
LEASE = "edl-restarter"  # the restarter's default --lease-name

SEED = int(os.environ.get("EDL_CHAOS_SEED", "20261124"))
NODES = 24
POLICIES = ("a", "b", "c", "d")  # one per group of jobs: decisions of different policies overlap
SLOW = "d"  # its policy has a backoff: a slot's second restart waits 2 s, later ones 4 s
BACKOFF = {"initialSeconds": 2, "maxSeconds": 4}
JOBS_PER_POLICY, SLOTS_PER_JOB = 4, 4
MIN_FAULTS, MIN_ROUNDS, MAX_ROUNDS = 300, 6, 10
MIN_KILLS = 5
RESTART_CODES = (137, *range(1, 11))
IGNORED_CODE = 42
KINDS = ("exit", "exit+agent", "device", "force-delete", None)
WEIGHTS = (0.3, 0.2, 0.2, 0.2, 0.1)
# Device faults come plain, oversized (1,600 device ids of 1 KB) or from a clock an hour fast.
DEVICE_VARIANTS = ("plain", "oversized", "ahead")
CLOCK_AHEAD = 3600.0
# A fault on a replacement waits until the replacement has existed this long: KWOK dates exits
# to the second, and an exit dated before the restart that made its pod is stale by design.
MIN_POD_AGE = 2.0
NODE_GRACE = 2.0
NODE_COOLDOWN = 8.0  # a node back from NotReady takes new pods only after this (watch lag)
ROUND_TIMEOUT = 20.0  # a slot late here gets FINAL_TIMEOUT more at the end, and no more faults
FINAL_TIMEOUT = 30.0
SETTLE = 5.0  # after the last replacement: time for a second one to show
RESTARTER_FLAGS = (
    "--agent-service-account",
    f"{{namespace}}/{AGENT_SA}",
    "--audience",
    AUDIENCE,
    "--node-grace-seconds",
    str(NODE_GRACE),
    "--storm-max-share",
    "1",
    "--lease-duration-seconds",
    "4",
    "--renew-deadline-seconds",
    "3",
    "--retry-period-seconds",
    "0.5",
)


@dataclass
class Slot:
    base: str
    policy: str
    job: str
    index: int
    expected: int = 0  # restarting faults sent to it so far
    frozen: str = ""  # why it gets no more faults


@dataclass
class Sent:
    slot: str
    kind: str
    round: int
    generation: int  # the restart count it must lead to; 0 for an ignored exit
    at: float  # wall time it was made
    lower: float  # no later than the fault's time as the restarter dates it
    pod: str
    node: str
    delivery: Future[Delivery] | None = None
    variant: str = ""  # a device fault's: plain, oversized or ahead


@dataclass
class Chaos:
    k8s: KwokCluster
    core: Any  # CoreV1Api on a client that fails at once while the API server is down
    objects: Any
    ledger: PodLedger
    fleet: RestarterFleet
    agents: AgentStandIn
    rng: random.Random
    slots: dict[str, Slot]
    nodes: list[str]
    t0: float = field(default_factory=wall)
    sent: list[Sent] = field(default_factory=list)
    not_ready: dict[str, list[str]] = field(default_factory=dict)  # node → its slots
    restored: dict[str, float] = field(default_factory=dict)  # node → when it may take pods
    api_down: list[tuple[float, float]] = field(default_factory=list)  # (wall at, seconds)
    api_round: int = -1  # the round that restarts the API server (no force deletions)
    notes: list[str] = field(default_factory=list)

    def rel(self, at: float) -> str:
        return f"+{at - self.t0:.1f}s"

    # --- the cluster's state as the ledger saw it -------------------------------------------

    @staticmethod
    def newest(pods: list[PodSeen]) -> PodSeen | None:
        return max(pods, key=lambda p: (p.count, p.first_seen), default=None)

    def settled(self, slot: Slot, pods: list[PodSeen]) -> bool:
        """Its newest pod is the generation expected, bound and Running."""
        pod = self.newest(pods)
        return (
            pod is not None
            and pod.count == slot.expected
            and not pod.gone
            and not pod.deleting
            and pod.phase == "Running"
        )

    def node_usable(self, node: str) -> bool:
        return node not in self.not_ready and self.restored.get(node, 0.0) <= time.monotonic()

    # --- the scheduler's part ---------------------------------------------------------------

    def bind_replacements(self, by_base: dict[str, list[PodSeen]]) -> None:
        load = Counter(
            pod.node for pods in by_base.values() for pod in pods if pod.node and not pod.gone
        )
        for base, pods in by_base.items():
            for pod in pods:
                if pod.node or pod.gone or pod.deleting or base not in self.slots:
                    continue
                choices = [n for n in self.nodes if self.node_usable(n) and n not in pod.avoid]
                if not choices:
                    continue
                least = min(load[n] for n in choices)
                node = self.rng.choice([n for n in choices if load[n] == least])
                load[node] += 1
                # A replacement copies its pod's labels and annotations, KWOK's order to fail
                # included: taken off before it runs, or it would fail at once, again and again.
                strip = {
                    "metadata": {
                        "labels": {POD_FAIL_LABEL: None},
                        "annotations": {POD_FAIL_EXIT_CODE: None},
                    }
                }
                retry(
                    f"clearing KWOK's failure order on {pod.name}",
                    lambda p=pod.name, s=strip: ignore_missing(
                        lambda: self.core.patch_namespaced_pod(p, self.k8s.namespace, s)
                    ),
                )
                binding = client.V1Binding(
                    metadata=client.V1ObjectMeta(name=pod.name),
                    target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
                )
                retry(
                    f"binding {pod.name}",
                    lambda b=binding: ignore_missing(
                        lambda: self.core.create_namespaced_binding(
                            self.k8s.namespace, b, _preload_content=False
                        )
                    ),
                )

    # --- one round ----------------------------------------------------------------------------

    def eligible(self) -> dict[str, PodSeen]:
        """Slots to fault now, with their newest pod (Running, old enough)."""
        by_base = self.ledger.by_base()
        found = {}
        for name, slot in self.slots.items():
            pod = self.newest(by_base.get(name, []))
            if slot.frozen or pod is None:
                continue
            if pod.count > slot.expected:
                slot.frozen = f"generation {pod.count} beyond the {slot.expected} expected"
                continue
            if self.settled(slot, by_base[name]) and pod.node and self.node_usable(pod.node):
                found[name] = pod
        return found

    def plan(self, number: int) -> list[tuple[str, str, PodSeen]]:
        """(slot, kind, pod) for this round."""
        deadline = time.monotonic() + MIN_POD_AGE + 1
        while True:  # let the youngest replacements age (see MIN_POD_AGE)
            ready = self.eligible()
            young = [p for p in ready.values() if wall() - p.first_seen < MIN_POD_AGE]
            if not young or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        young_names = {p.name for p in young}
        ready = {name: pod for name, pod in ready.items() if pod.name not in young_names}
        faults: list[tuple[str, str, PodSeen]] = []
        # NotReady: nodes whose every slot pod may be faulted now.
        on_node: dict[str, list[str]] = {}
        blocked: set[str] = set()
        by_base = self.ledger.by_base()
        for name in self.slots:
            pod = self.newest(by_base.get(name, []))
            if pod is None or not pod.node or pod.gone or pod.phase != "Running":
                continue
            if name in ready:
                on_node.setdefault(pod.node, []).append(name)
            else:
                blocked.add(pod.node)
        candidates = sorted(n for n in on_node if n not in blocked and self.node_usable(n))
        for node in self.rng.sample(candidates, min(len(candidates), self.rng.choice((1, 2)))):
            self.not_ready[node] = on_node[node]
            faults.extend((name, "not-ready", ready.pop(name)) for name in on_node[node])
        names = sorted(ready)
        self.rng.shuffle(names)
        if 1 <= number <= 4 and names:  # one exit per round that no rule restarts
            name = names.pop()
            faults.append((name, "ignored-exit", ready[name]))
        for name in names:
            kind = self.rng.choices(KINDS, WEIGHTS)[0]
            if kind == "force-delete" and number == self.api_round:
                kind = "exit"  # see the module's docstring: the one case the README excludes
            if kind is not None:
                faults.append((name, kind, ready[name]))
        return faults

    def inject(self, number: int, faults: list[tuple[str, str, PodSeen]]) -> None:
        ns, core = self.k8s.namespace, self.core
        calls: list[Callable[[], object]] = []
        for name, kind, pod in faults:
            slot = self.slots[name]
            now = wall()
            sent = Sent(name, kind, number, 0, now, now, pod.name, pod.node)
            if kind == "ignored-exit":
                slot.frozen = "its pod exited with a code no rule restarts"
            else:
                slot.expected += 1
                sent.generation = slot.expected
            if kind in ("exit", "exit+agent", "ignored-exit"):
                code = IGNORED_CODE if kind == "ignored-exit" else self.rng.choice(RESTART_CODES)
                sent.lower = math.floor(now)  # KWOK dates the exit to the second
                patch = {
                    "metadata": {
                        "labels": {POD_FAIL_LABEL: "true"},
                        "annotations": {POD_FAIL_EXIT_CODE: str(code)},
                    }
                }
                calls.append(functools.partial(core.patch_namespaced_pod, pod.name, ns, patch))
                if kind == "exit+agent":
                    sent.delivery = self.report_exit(pod, code)
            elif kind == "force-delete":
                delete = functools.partial(
                    core.delete_namespaced_pod, pod.name, ns, grace_period_seconds=0
                )
                calls.append(functools.partial(ignore_missing, delete))
            elif kind == "device":
                sent.variant = self.rng.choice(DEVICE_VARIANTS)
                fault = device_fault(ns, pod, number, now, sent.variant)
                sent.delivery = self.agents.report(fault)
            self.sent.append(sent)
        label = {"metadata": {"labels": {NODE_NOT_READY_LABEL: "true"}}}
        calls.extend(
            functools.partial(core.patch_node, node, label)
            for node in self.not_ready
            if node in {pod.node for _, kind, pod in faults if kind == "not-ready"}
        )
        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(retry, "making a fault", call) for call in calls]:
                future.result()

    def report_exit(self, pod: PodSeen, code: int) -> Future[Delivery]:
        """The agent on the pod's node reports the exit once it sees it (as kubelet shows it)."""
        fault = fault_pb2.Fault(
            id=container_exit_id(pod.uid, "worker", 0),
            kind=fault_pb2.FAULT_KIND_CONTAINER_EXIT,
            node=pod.node,
            pods=[fault_pb2.PodRef(namespace=self.k8s.namespace, name=pod.name, uid=pod.uid)],
            container="worker",
            exit_code=code,
            reason="Error",
            source="agent",
        )

        def when_seen() -> None:
            deadline = time.monotonic() + 20
            seen = self.ledger.get(pod.uid)
            while (seen is None or seen.exit_code is None) and time.monotonic() < deadline:
                time.sleep(0.1)
                seen = self.ledger.get(pod.uid)
            finished = seen.finished_at if seen is not None else ""
            if finished:
                fault.observed_at.FromDatetime(datetime.fromisoformat(finished))
            else:
                fault.observed_at.GetCurrentTime()

        return self.agents.report(fault, before=when_seen)

    def wait_round(self, number: int, faulted: set[str], timeout: float) -> None:
        """Until every slot in `faulted` runs its expected generation: binding replacements,
        and bringing a NotReady node back once all its pods are replaced (never before: that
        would take back a fault the restarter may still be about to act on). A slot still
        behind at the deadline is frozen: no more faults; the final wait gives it more time."""
        deadline = time.monotonic() + timeout
        while True:
            by_base = self.ledger.by_base()
            self.bind_replacements(by_base)
            for node, names in list(self.not_ready.items()):
                if all(
                    (p := self.newest(by_base.get(n, []))) is not None
                    and p.count == self.slots[n].expected
                    for n in names
                ):
                    self.restore(node)
            late = [n for n in sorted(faulted) if not self.settled(self.slots[n], by_base[n])]
            if not late:
                return
            if time.monotonic() > deadline:
                for name in late:
                    pod = self.newest(by_base[name])
                    seen = "none" if pod is None else f"{pod.count} ({pod.phase or 'unbound'})"
                    self.slots[name].frozen = (
                        f"round {number}: generation {self.slots[name].expected} not running "
                        f"after {timeout:.0f}s (newest: {seen})"
                    )
                self.notes.append(f"round {number}: {len(late)} slots late: {', '.join(late)}")
                return
            time.sleep(0.2)

    def restore(self, node: str) -> None:
        core = self.core
        retry(
            f"making {node} Ready again",
            lambda: core.patch_node(node, {"metadata": {"labels": {NODE_NOT_READY_LABEL: None}}}),
        )
        wait_for(
            f"{node} Ready again",
            lambda: retry(f"reading {node}", lambda: core.read_node(node)),
            lambda n: node_ready(n) is True,
            timeout=60,
        )
        del self.not_ready[node]
        self.restored[node] = time.monotonic() + NODE_COOLDOWN


def device_fault(
    namespace: str, pod: PodSeen, number: int, now: float, variant: str = "plain"
) -> fault_pb2.Fault:
    """The agent's DeviceUnhealthy about `pod`. `oversized`: it names 1,600 device ids of 1 KB
    and a 100 KB detail (each must be cut at the intake, not fill the policy's status);
    `ahead`: dated by a clock an hour fast (it must count as observed when received, and its
    slot's next faults must not look older than the restart)."""
    device = f"GPU-{pod.name}"
    fault = fault_pb2.Fault(
        id=f"device/{pod.node}/{device}/XID79/{number}-{pod.uid}",
        kind=fault_pb2.FAULT_KIND_DEVICE_UNHEALTHY,
        node=pod.node,
        pods=[fault_pb2.PodRef(namespace=namespace, name=pod.name, uid=pod.uid)],
        reason="XID79",
        device_ids=[device],
        detail="GPU has fallen off the bus",
        source="agent",
    )
    if variant == "oversized":
        fault.device_ids.extend(f"{device}-{i}-" + "u" * 1000 for i in range(1600))
        fault.detail = "x" * 100_000
    ahead = CLOCK_AHEAD if variant == "ahead" else 0.0
    fault.observed_at.FromDatetime(datetime.fromtimestamp(now + ahead, UTC))
    return fault


def backoff_delay(generation: int) -> float:
    """How long the slow policy holds the restart that makes `generation` (see policy.py:
    the n-th consecutive restart waits initialSeconds * 2^(n-2), at most maxSeconds)."""
    if generation < 2:
        return 0.0
    return float(min(BACKOFF["initialSeconds"] << (generation - 2), BACKOFF["maxSeconds"]))


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_crd(k8s_api_client: client.ApiClient) -> None:
    extensions = client.ApiextensionsV1Api(k8s_api_client)
    body = yaml.safe_load(CRD.read_text())
    extensions.patch_custom_resource_definition(
        body["metadata"]["name"],
        body,
        field_manager="edl-tests",
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    wait_for(
        "the FaultTolerancePolicy CRD Established",
        lambda: extensions.read_custom_resource_definition(body["metadata"]["name"]),
        lambda crd: any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        ),
        timeout=30,
    )


@pytest.fixture
def tidy(k8s: KwokCluster) -> Iterator[None]:
    """Remove the policies and the Lease afterwards: no namespace controller runs, so nothing
    else would remove them from etcd with the namespace."""
    yield
    objects = client.CustomObjectsApi(k8s.api)
    for policy in POLICIES:
        ignore_missing(
            functools.partial(
                objects.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                k8s.namespace,
                PLURAL,
                f"chaos-{policy}",
            )
        )
    ignore_missing(
        functools.partial(k8s.coordination.delete_namespaced_lease, LEASE, k8s.namespace)
    )


@pytest.fixture
def ledger(k8s: KwokCluster) -> Iterator[PodLedger]:
    running = PodLedger(k8s.api, k8s.namespace, f"app={APP}")
    running.start()
    yield running
    running.stop()


@pytest.fixture
def fleet(
    k8s: KwokCluster, k8s_control_plane: testcluster.ControlPlane, tmp_path: Path
) -> Iterator[RestarterFleet]:
    flags = tuple(f.format(namespace=k8s.namespace) for f in RESTARTER_FLAGS)
    running = RestarterFleet(k8s_control_plane.kubeconfig, k8s.namespace, tmp_path, flags=flags)
    yield running
    running.stop()
    assert not [r for r in running.replicas() if r.process.poll() is None]


# --- the test ---------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("policy_crd", "tidy")
def test_chaos_every_fault_restarts_its_slot_exactly_once(
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    ledger: PodLedger,
    fleet: RestarterFleet,
) -> None:
    began = time.monotonic()
    ns, core = k8s.namespace, k8s.core
    objects = client.CustomObjectsApi(k8s.api)
    rng = random.Random(SEED)  # noqa: S311 - chaos, not cryptography: a seed replays it

    # The cluster: nodes, an agent's token bound to each node, policies, one pod per slot.
    nodes = [
        k8s.create_gpu_node(f"chaos-{i:02d}-{k8s.namespace[-4:]}", wait_ready=False).metadata.name
        for i in range(NODES)
    ]
    k8s.create_service_account(AGENT_SA)
    with ThreadPoolExecutor(8) as pool:
        tokens = dict(
            zip(
                nodes,
                pool.map(
                    lambda n: bound_tokens(core, ns, n, AGENT_SA, [[AUDIENCE]])[0],
                    nodes,
                ),
                strict=True,
            )
        )
    for policy in POLICIES:
        objects.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, policy_body(policy))
    slots: dict[str, Slot] = {}
    for policy in POLICIES:
        for j in range(JOBS_PER_POLICY):
            for index in range(SLOTS_PER_JOB):
                job = f"{policy}{j}"
                slots[f"{job}-worker-{index}"] = Slot(f"{job}-worker-{index}", policy, job, index)
    with ThreadPoolExecutor(8) as pool:
        for future in [
            pool.submit(create_slot_pod, k8s, slot, nodes[i % NODES])
            for i, slot in enumerate(slots.values())
        ]:
            future.result()
    wait_for(
        f"all {NODES} nodes Ready",
        lambda: core.list_node(label_selector="type=kwok").items,
        lambda items: sum(1 for n in items if n.metadata.name in nodes and node_ready(n)) == NODES,
        timeout=60,
    )
    wait_for(
        f"all {len(slots)} slot pods Running",
        ledger.pods,
        lambda pods: sum(1 for p in pods if p.phase == "Running") == len(slots),
        timeout=90,
    )

    fleet.start()
    agents = AgentStandIn(tokens, fleet.intake_ports)
    quiet = quiet_client(k8s.api)
    chaos = Chaos(k8s, client.CoreV1Api(quiet), objects, ledger, fleet, agents, rng, slots, nodes)
    try:
        wait_for(
            "a restarter leading and acting",
            lambda: [r.readyz() for r in fleet.replicas()],
            lambda answers: any(
                a is not None and a[0] == 200 and "acting" in a[1] for a in answers
            ),
            timeout=60,
        )
        setup = time.monotonic() - began
        chaos.t0 = wall()
        api_round = chaos.api_round = rng.choice((1, 2, 3))
        number = 0
        while number < MIN_ROUNDS or (len(chaos.sent) < MIN_FAULTS and number < MAX_ROUNDS):
            faults = chaos.plan(number)
            if not faults:
                chaos.notes.append(f"round {number}: no slot left to fault")
                break
            if number < MIN_ROUNDS:
                fleet.kill_leader_in(rng.uniform(0.0, 4.0))
            chaos.inject(number, faults)
            if number == api_round:
                time.sleep(rng.uniform(0.3, 1.5))  # faults in flight, a leader mid-work
                at = wall()
                down = testcluster.restart_apiserver(k8s_control_plane, stop_timeout=5)
                chaos.api_down.append((at, down))
            chaos.wait_round(
                number, {n for n, k, _ in faults if k != "ignored-exit"}, ROUND_TIMEOUT
            )
            number += 1
        wait_for("the last leader kills", fleet.kills_pending, lambda n: n == 0, timeout=60)
        # The slots a round gave up on get a last, generous chance.
        late = {s.base for s in slots.values() if s.frozen.startswith("round")}
        if late:
            chaos.wait_round(number, late, FINAL_TIMEOUT)
        time.sleep(SETTLE)
    finally:
        agents.close()  # a report still unacknowledged now stays so
        exit_codes = fleet.stop()
        quiet.close()
    deliveries = [s.delivery.result() for s in chaos.sent if s.delivery is not None]
    duration = time.monotonic() - began
    time.sleep(1)  # the ledger's last events
    report = judge(chaos, deliveries, setup=setup, duration=duration, exit_codes=exit_codes)
    print(f"\n{report.tally}")
    for note in report.details:
        print(note)
    assert not report.harness, "harness trouble (not the restarter's):\n" + "\n".join(
        report.harness
    )
    failure = report.tally + "\n" + "\n".join(report.problems)
    assert report.lost == 0, failure
    assert report.doubled == 0, failure
    assert not report.problems, failure


def policy_body(policy: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": f"chaos-{policy}"},
        "spec": {
            "selector": {"matchLabels": {"app": APP, GROUP_LABEL: policy}},
            "jobLabel": JOB,
            "replicaTypeLabel": TYPE,
            "replicaIndexLabel": INDEX,
            "restartLimit": 1000,
            "backoff": BACKOFF if policy == SLOW else {"initialSeconds": 0, "maxSeconds": 0},
            "faultTolerantPolicy": [
                {"restartPolicy": "ExitCode", "exitCodes": "1-10,137", "restartScope": "Pod"},
                {"restartPolicy": "OnNodeFail", "restartScope": "Pod"},
            ],
        },
    }


def create_slot_pod(k8s: KwokCluster, slot: Slot, node: str) -> None:
    labels = {
        "app": APP,
        GROUP_LABEL: slot.policy,
        JOB: slot.job,
        TYPE: "worker",
        INDEX: str(slot.index),
    }
    k8s.create_pod(slot.base, node=node, gpus=1, labels=labels, wait_running=False)


# --- the verdict ------------------------------------------------------------------------------


@dataclass
class Report:
    tally: str = ""
    acted: int = 0
    lost: int = 0
    doubled: int = 0
    lost_by_kind: Counter[str] = field(default_factory=Counter)
    backoffs_checked: int = 0
    backoff_violations: int = 0
    problems: list[str] = field(default_factory=list)  # the restarter's
    harness: list[str] = field(default_factory=list)  # the harness's own
    details: list[str] = field(default_factory=list)


def judge(
    chaos: Chaos,
    deliveries: list[Delivery],
    *,
    setup: float,
    duration: float,
    exit_codes: list[int],
) -> Report:
    report = Report()
    by_base = chaos.ledger.by_base()
    logs = chaos.fleet.all_logs()
    judge_slots(chaos, by_base, logs, report)
    judge_backoffs(chaos, by_base, report)
    judge_status(chaos, report)
    tracebacks = log_lines(logs, "Traceback")
    if "no log line" not in tracebacks:
        report.problems.append(f"tracebacks in the restarter logs:\n{tracebacks}")
    judge_harness(chaos, report)
    report.tally = tally(chaos, deliveries, report, setup=setup, duration=duration)
    report.details = [
        *(f"  note: {note}" for note in chaos.notes),
        *(
            f"  kill: {k.identity} at {chaos.rel(k.at)} ({k.state.strip()!r}, up {k.uptime:.1f}s)"
            for k in chaos.fleet.kills
        ),
        *(f"  exit: {e.identity} status {e.code} at {chaos.rel(e.at)}" for e in chaos.fleet.exits),
        *(f"  API server down at {chaos.rel(at)} for {d:.1f}s" for at, d in chaos.api_down),
        f"  exit codes of the restarters not SIGKILLed (SIGTERM at the end): {exit_codes}",
    ]
    return report


def judge_slots(
    chaos: Chaos, by_base: dict[str, list[PodSeen]], logs: list[Path], report: Report
) -> None:
    """Per slot: one generation per restarting fault, each made after its fault, no count
    made twice or skipped."""
    sent_by_slot: dict[str, list[Sent]] = {}
    for one in chaos.sent:
        sent_by_slot.setdefault(one.slot, []).append(one)
    for name, slot in sorted(chaos.slots.items()):
        pods = by_base.get(name, [])
        sent = sent_by_slot.get(name, [])
        generation = max((p.count for p in pods), default=0)
        counts = Counter(p.count for p in pods)
        twins = sorted(c for c, n in counts.items() if n > 1)
        skipped = sorted(set(range(generation + 1)) - set(counts))
        first = {p.count: p for p in reversed(pods)}  # each count's first pod
        early = [
            f"{first[s.generation].name} seen {chaos.rel(first[s.generation].first_seen)}, "
            f"before its fault ({s.kind} at {chaos.rel(s.at)})"
            for s in sent
            if s.generation and s.generation in first and first[s.generation].first_seen < s.at
        ]
        lost = max(0, slot.expected - generation)
        doubled = max(0, generation - slot.expected) + sum(counts[c] - 1 for c in twins)
        doubled = max(doubled, len(early))
        report.acted += min(generation, slot.expected)
        report.lost += lost
        report.doubled += doubled
        report.lost_by_kind.update(s.kind for s in sent if s.generation > generation)
        if not (lost or doubled or skipped):
            continue
        report.problems.append(
            f"slot {name} (policy chaos-{slot.policy}): expected generation "
            f"{slot.expected}, newest seen {generation}"
            + (f"; restart counts made twice: {twins}" if twins else "")
            + (f"; counts never seen: {skipped}" if skipped else "")
            + (f"; made before their fault: {early}" if early else "")
            + f"\n  faults: {describe_faults(chaos, sent, pods)}"
            + f"\n  restarter log lines about it:\n{log_lines(logs, name, limit=16)}"
        )


def judge_backoffs(chaos: Chaos, by_base: dict[str, list[PodSeen]], report: Report) -> None:
    """A replacement in the slow policy never exists before its backoff ends. `first_seen` is
    no earlier than the creation and `lower` no later than the fault's time: sound, never a
    false alarm (a lagging watch may hide a violation, never invent one)."""
    violations = []
    for sent in chaos.sent:
        if chaos.slots[sent.slot].policy != SLOW or sent.generation < 2:
            continue
        made = [p for p in by_base.get(sent.slot, []) if p.count == sent.generation]
        delay = backoff_delay(sent.generation)
        report.backoffs_checked += bool(made)
        if made and made[0].first_seen < sent.lower + delay:
            violations.append(
                f"{made[0].name} ({sent.kind}) seen {chaos.rel(made[0].first_seen)}, "
                f"before its backoff ended (fault no earlier than {chaos.rel(sent.lower)}, "
                f"+{delay:.0f}s)"
            )
    report.backoff_violations = len(violations)
    if violations:
        report.problems.append("backoff not honoured: " + "; ".join(violations))


def judge_status(chaos: Chaos, report: Report) -> None:
    """Each job's restart counts in its policy's status equal its slots' restarting faults.
    (pendingRestarts may lag: the restarter drops finished ones with its next write.)"""
    for policy in POLICIES:
        body = retry(
            "reading a policy",
            lambda p=policy: chaos.objects.get_namespaced_custom_object(
                GROUP, VERSION, chaos.k8s.namespace, PLURAL, f"chaos-{p}"
            ),
        )
        status = body.get("status") or {}
        jobs = {j.get("name"): j for j in status.get("jobs") or []}
        for job in sorted({s.job for s in chaos.slots.values() if s.policy == policy}):
            want = sum(s.expected for s in chaos.slots.values() if s.job == job)
            entry = jobs.get(job) or {}
            types = {r.get("name"): r for r in entry.get("replicaTypes") or []}
            got = (entry.get("restarts", 0), (types.get("worker") or {}).get("restarts", 0))
            if got != (want, want):
                report.problems.append(
                    f"policy chaos-{policy} job {job}: status counts restarts {got[0]} "
                    f"(worker {got[1]}), the faults call for {want}"
                )
        want_all = sum(s.expected for s in chaos.slots.values() if s.policy == policy)
        if status.get("restarts", 0) != want_all:
            report.problems.append(
                f"policy chaos-{policy}: status.restarts {status.get('restarts', 0)}, "
                f"the faults call for {want_all}"
            )


def judge_harness(chaos: Chaos, report: Report) -> None:
    """What the harness promised: the kills, the API server restart, enough faults."""
    if len(chaos.fleet.kills) < MIN_KILLS:
        report.harness.append(f"only {len(chaos.fleet.kills)} leader kills (want {MIN_KILLS})")
    if not chaos.api_down:
        report.harness.append("the API server was not restarted")
    if chaos.fleet.problem:
        report.harness.append(chaos.fleet.problem)
    restarting = sum(1 for s in chaos.sent if s.generation)
    if restarting < MIN_FAULTS and not report.lost:  # lost restarts leave slots out of rounds
        report.harness.append(f"only {restarting} restarting faults sent (want {MIN_FAULTS})")


def tally(
    chaos: Chaos, deliveries: list[Delivery], report: Report, *, setup: float, duration: float
) -> str:
    kinds = Counter(s.kind for s in chaos.sent)
    variants = Counter(s.variant for s in chaos.sent if s.kind == "device")
    restarting = sum(1 for s in chaos.sent if s.generation)
    verdicts = Counter(d.verdict.split(":")[0] or "none" for d in deliveries)
    lost_kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.lost_by_kind.items())) or "none"
    exits = sorted(e.code for e in chaos.fleet.exits)
    downs = ", ".join(f"{d:.1f}s" for _, d in chaos.api_down)
    return (
        f"chaos: faults sent {len(chaos.sent)}, acted on {report.acted}, lost {report.lost}, "
        f"doubled {report.doubled}"
        f" | {restarting} to restart: exit {kinds['exit']}, exit+agent {kinds['exit+agent']}, "
        f"device (agent only) {kinds['device']} ({variants['oversized']} oversized, "
        f"{variants['ahead']} an hour ahead), force-delete {kinds['force-delete']}, "
        f"not-ready {kinds['not-ready']} (on {len(chaos.restored)} nodes); "
        f"{kinds['ignored-exit']} not to restart | lost by kind: {lost_kinds}"
        f" | leader SIGKILLs {len(chaos.fleet.kills)}, other restarter exits "
        f"{len(exits)} {exits}, API server restarts {len(chaos.api_down)} (down {downs})"
        f" | agent verdicts {dict(verdicts)}, failed calls {chaos.agents.failed_calls}, "
        f"retry-later answers {chaos.agents.deferred}"
        f" | backoffs checked {report.backoffs_checked}, violated {report.backoff_violations}"
        f" | ledger re-lists {chaos.ledger.relists}"
        f" | {duration:.0f}s ({setup:.0f}s setup), seed {SEED}"
    )


def describe_faults(chaos: Chaos, sent: list[Sent], pods: list[PodSeen]) -> str:
    made = {p.count: p for p in reversed(pods)}
    parts = []
    for s in sent:
        pod = made.get(s.generation) if s.generation else None
        if not s.generation:
            outcome = "not to restart"
        elif pod is None:
            outcome = "MISSING"
        else:
            outcome = f"gen {s.generation} seen {chaos.rel(pod.first_seen)}"
        if s.delivery is not None and s.delivery.done():
            outcome += f" (agent: {s.delivery.result().verdict or 'never acknowledged'})"
        parts.append(
            f"round {s.round} {s.kind} on {s.pod}@{s.node} at {chaos.rel(s.at)} → {outcome}"
        )
    return "; ".join(parts) or "none"
