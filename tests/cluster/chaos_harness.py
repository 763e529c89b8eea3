"""The moving parts of the restarter chaos test (test_restarter_chaos.py), each one thread:

  PodLedger        a list+watch of the test's pods that remembers every pod ever seen (uid,
                   name, restart count, node, exit, when first seen), across watch breaks and
                   API server restarts (resumes from its resourceVersion; re-lists after a 410)
  RestarterFleet   restarter processes (`edl-agent restarter`, leader election on a Lease),
                   kept at their number like a Deployment would; SIGKILLs the leader on request
  AgentStandIn     what node agents do on the wire: report faults to the leader's fault intake
                   (`edl.fault.v1.FaultIntake/Report`) with a token bound to a pod on the
                   fault's node, again and again until the intake acknowledges them

Only the test's own processes are ever signalled, by the pid it started.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import testcluster
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc

BASE_NAME = "edl.io/base-name"
RESTART_COUNT = "edl.io/restart-count"
GONE = 410
# The verdicts after which an agent forgets a fault; anything else, or no Ack, it sends again.
FINAL = (fault_pb2.VERDICT_ACCEPTED, fault_pb2.VERDICT_DUPLICATE, fault_pb2.VERDICT_REFUSED)


def quiet_client(api: client.ApiClient) -> client.ApiClient:
    """A client of its own that fails at once while the API server is down (the harness
    retries by itself) rather than logging three urllib3 retries per call."""
    config = copy.copy(api.configuration)
    config.retries = False
    config.connection_pool_maxsize = 16
    return client.ApiClient(config)


def wall() -> float:
    """Wall-clock seconds: the restarter dates faults and backoffs on the same clock."""
    return time.time()


# --- every pod ever seen ---------------------------------------------------------------------


@dataclass
class PodSeen:
    uid: str
    name: str
    base: str
    count: int
    first_seen: float  # wall time this ledger first saw it: no earlier than its creation
    node: str = ""
    phase: str = ""
    exit_code: int | None = None
    finished_at: str = ""
    deleting: bool = False
    gone: bool = False
    avoid: tuple[str, ...] = ()  # nodes its required node affinity excludes


class PodLedger:
    """Every pod matching `selector` in `namespace` that the API ever showed this ledger."""

    def __init__(self, api: client.ApiClient, namespace: str, selector: str) -> None:
        self._api = quiet_client(api)
        self._core: Any = client.CoreV1Api(self._api)
        self._namespace = namespace
        self._selector = selector
        self._lock = threading.Lock()
        self._pods: dict[str, PodSeen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-ledger", daemon=True)
        self.relists = 0  # lists after the first: a gap where a short-lived pod could be missed
        self.watch_breaks = 0
        self.synced = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=90)  # the watch ends within its 5 s timeout
        self._api.close()  # type: ignore[no-untyped-call]

    def pods(self) -> list[PodSeen]:
        with self._lock:
            return [PodSeen(**vars(p)) for p in self._pods.values()]

    def by_base(self) -> dict[str, list[PodSeen]]:
        found: dict[str, list[PodSeen]] = {}
        for pod in self.pods():
            found.setdefault(pod.base, []).append(pod)
        for pods in found.values():
            pods.sort(key=lambda p: (p.count, p.first_seen))
        return found

    def get(self, uid: str) -> PodSeen | None:
        with self._lock:
            pod = self._pods.get(uid)
            return None if pod is None else PodSeen(**vars(pod))

    def _run(self) -> None:
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
            except _Gone:
                version = None
                self.relists += 1
            except Exception:  # the API server restarting, a connection reset: watch again
                self.watch_breaks += 1
                self._stop.wait(0.2)

    def _list(self) -> str:
        response = self._core.list_namespaced_pod(
            self._namespace, label_selector=self._selector, _preload_content=False
        )
        data = json.loads(response.data)
        listed = {item["metadata"]["uid"] for item in data.get("items") or []}
        with self._lock:
            for uid, pod in self._pods.items():
                if uid not in listed:
                    pod.gone = True  # deleted while the watch was down
        for item in data.get("items") or []:
            self._seen("ADDED", item)
        self.synced.set()
        return str(data["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        response = self._core.list_namespaced_pod(
            self._namespace,
            label_selector=self._selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=5,  # short: stop() waits for the watch to end
            _preload_content=False,
            _request_timeout=(5, 60),
        )
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    break
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == GONE:
                        raise _Gone
                    raise RuntimeError(f"watch error: {obj}")
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if event.get("type") != "BOOKMARK":
                    self._seen(str(event.get("type")), obj)
        finally:
            response.close()
            response.release_conn()
        return version

    def _seen(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        uid = str(meta.get("uid", ""))
        with self._lock:
            pod = self._pods.get(uid)
            if pod is None:
                pod = self._pods[uid] = PodSeen(
                    uid=uid,
                    name=str(meta.get("name", "")),
                    base=str(annotations.get(BASE_NAME) or meta.get("name", "")),
                    count=int(annotations.get(RESTART_COUNT) or 0),
                    first_seen=wall(),
                    avoid=_avoided(spec),
                )
            pod.node = str(spec.get("nodeName") or "")
            pod.phase = str(status.get("phase") or "")
            pod.deleting = bool(meta.get("deletionTimestamp"))
            pod.gone = pod.gone or kind == "DELETED"
            for container in status.get("containerStatuses") or []:
                terminated = (container.get("state") or {}).get("terminated")
                if terminated and pod.exit_code is None:
                    pod.exit_code = int(terminated.get("exitCode") or 0)
                    pod.finished_at = str(terminated.get("finishedAt") or "")


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def _avoided(spec: dict[str, Any]) -> tuple[str, ...]:
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    return tuple(
        value
        for term in affinity.get("nodeSelectorTerms") or []
        for requirement in term.get("matchFields") or []
        if requirement.get("key") == "metadata.name" and requirement.get("operator") == "NotIn"
        for value in requirement.get("values") or []
    )


# --- restarter processes ---------------------------------------------------------------------


@dataclass
class Replica:
    identity: str
    process: subprocess.Popen[bytes]
    metrics_port: int
    intake_port: int
    log: Path
    started: float
    killed: bool = False

    def readyz(self) -> tuple[int, str] | None:
        """/readyz's status and text; None while nothing answers in whole (a replica being
        killed may close the connection mid-answer: `http.client.IncompleteRead` and its kin
        are no `OSError`, and they mean "not leading" as much as a refused connection)."""
        url = f"http://127.0.0.1:{self.metrics_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, exc.read().decode()
            except (OSError, http.client.HTTPException):
                return None
        except (OSError, http.client.HTTPException):
            return None

    def leading(self) -> bool:
        """Whether it says it leads: anything but `standby` once it answers (it may still be
        listing, or recovering what its predecessor left half done)."""
        answer = self.readyz()
        return answer is not None and not answer[1].startswith("standby")


@dataclass
class Kill:
    identity: str
    at: float  # wall time
    state: str  # what its /readyz said just before
    uptime: float


@dataclass
class Exit:
    identity: str
    code: int
    at: float


@dataclass
class RestarterFleet:
    """`size` restarter processes with leader election, respawned when one exits (as its
    Deployment would), each with its own intake and metrics port and its own log."""

    kubeconfig: Path
    namespace: str
    directory: Path
    size: int = 2
    flags: tuple[str, ...] = ()
    kills: list[Kill] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    _replicas: list[Replica] = field(default_factory=list)
    _retired: list[Replica] = field(default_factory=list)
    _kill_at: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _spawned: int = 0
    problem: str | None = None

    def start(self) -> None:
        # The processes are spawned by this thread, tied to it by PR_SET_PDEATHSIG: if the test
        # process dies, they die too.
        self._thread = threading.Thread(target=self._run, name="restarter-fleet", daemon=True)
        self._thread.start()

    def stop(self) -> list[int]:
        """Stop the thread and every process (SIGTERM, then SIGKILL); the codes they exited
        with."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            return [r.process.returncode for r in self._retired if not r.killed]

    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas)

    def all_logs(self) -> list[Path]:
        with self._lock:
            return [r.log for r in (*self._retired, *self._replicas)]

    def kill_leader_in(self, seconds: float) -> None:
        with self._lock:
            self._kill_at.append(time.monotonic() + seconds)

    def kills_pending(self) -> int:
        with self._lock:
            return len(self._kill_at)

    def leader(self) -> Replica | None:
        for replica in self.replicas():
            if replica.process.poll() is None and replica.leading():
                return replica
        return None

    def intake_ports(self) -> list[int]:
        """Intake ports of the live replicas; the one that says it leads first."""
        live = [r for r in self.replicas() if r.process.poll() is None]
        live.sort(key=lambda r: not r.leading())
        return [r.intake_port for r in live]

    # --- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._reap()
                while len(self.replicas()) < self.size:
                    self._spawn()
                self._kill_when_due()
                self._stop.wait(0.1)
        except Exception as exc:  # reported by the test; the processes still get stopped
            self.problem = f"the fleet thread failed: {exc!r}"
        finally:
            self._stop_all()

    def _spawn(self) -> None:
        self._spawned += 1
        identity = f"chaos-{self._spawned}"
        metrics_port, intake_port = testcluster.free_port(), testcluster.free_port()
        log = self.directory / f"{identity}.log"
        argv = [
            sys.executable,
            "-m",
            "edl_agent.cli",
            "restarter",
            "--kubeconfig",
            str(self.kubeconfig),
            "--namespace",
            self.namespace,
            "--lease-namespace",
            self.namespace,
            "--identity",
            identity,
            "--listen",
            f"127.0.0.1:{intake_port}",
            "--metrics-addr",
            f"127.0.0.1:{metrics_port}",
            "--log-format",
            "json",
            *self.flags,
        ]
        # Nothing of the test's environment may configure the restarter behind its flags.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("EDL_") and k not in ("KUBECONFIG", "POD_NAME", "POD_NAMESPACE")
        }
        with log.open("ab") as out:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=testcluster._die_with_parent(),  # noqa: PLW1509 - only prctl
            )
        replica = Replica(identity, process, metrics_port, intake_port, log, time.monotonic())
        with self._lock:
            self._replicas.append(replica)

    def _reap(self) -> None:
        for replica in self.replicas():
            code = replica.process.poll()
            if code is None:
                continue
            with self._lock:
                self._replicas.remove(replica)
                self._retired.append(replica)
            if not replica.killed:
                self.exits.append(Exit(replica.identity, code, wall()))

    def _kill_when_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [t for t in self._kill_at if t <= now]
        if not due:
            return
        leader = self.leader()
        if leader is None:
            return  # between leaders: kill the next one once it leads
        answer = leader.readyz()
        leader.killed = True
        os.kill(leader.process.pid, signal.SIGKILL)
        leader.process.wait()
        self.kills.append(
            Kill(
                leader.identity,
                wall(),
                answer[1] if answer else "(no answer)",
                now - leader.started,
            )
        )
        with self._lock:
            self._kill_at.remove(min(due))

    def _stop_all(self) -> None:
        for replica in self.replicas():
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas():
            try:
                replica.process.wait(15)
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()
        with self._lock:
            self._retired.extend(self._replicas)
            self._replicas.clear()


def log_lines(paths: Iterable[Path], *needles: str, limit: int = 40) -> str:
    """The restarter log lines (JSON, shortened) that mention every one of `needles`."""
    found: list[str] = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found.extend(
            f"  {path.stem}: {line[:400]}"
            for line in text.splitlines()
            if all(needle in line for needle in needles)
        )
    return "\n".join(found[-limit:]) or "  (no log line mentions it)"


def log_tail(paths: Iterable[Path], lines: int = 15) -> str:
    parts = []
    for path in paths:
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        parts.append(f"--- {path.name} (last {lines} lines)")
        parts.extend(line[:400] for line in text[-lines:])
    return "\n".join(parts)


# --- the agents --------------------------------------------------------------------------------


@dataclass
class Delivery:
    fault_id: str
    verdict: str = ""  # ACCEPTED, DUPLICATE, REFUSED:<reason>, or "" while undelivered
    attempts: int = 0
    delivered_at: float = 0.0


class AgentStandIn:
    """Agents' fault reports, at least once: each fault is sent (alone, to the replica that
    says it leads, else to any live one), with the token bound to its node, until the intake
    answers ACCEPTED, DUPLICATE or REFUSED; a call that fails, an Ack that says "retry later"
    (VERDICT_UNSPECIFIED) or none at all, and it is sent again."""

    def __init__(
        self,
        tokens: dict[str, str],
        ports: Callable[[], list[int]],
        *,
        give_up_after: float = 240.0,
        workers: int = 16,
    ) -> None:
        self._tokens = tokens
        self._ports = ports
        self._give_up_after = give_up_after
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="agent")
        self._stop = threading.Event()
        self.failed_calls = 0
        self.deferred = 0

    def report(
        self, fault: fault_pb2.Fault, *, before: Callable[[], None] | None = None
    ) -> Future[Delivery]:
        """Deliver `fault` in the background (after `before()`, which may fill it in)."""
        return self._pool.submit(self._deliver, fault, before)

    def close(self) -> None:
        """Stop sending: every report returns its Delivery (verdict "" if never answered)."""
        self._stop.set()
        self._pool.shutdown(wait=True)

    def _deliver(self, fault: fault_pb2.Fault, before: Callable[[], None] | None) -> Delivery:
        if before is not None and not self._stop.is_set():
            before()
        delivery = Delivery(fault.id)
        metadata = [("authorization", f"Bearer {self._tokens[fault.node]}")]
        request = fault_pb2.ReportRequest(faults=[fault])
        request.sent_at.GetCurrentTime()
        deadline = time.monotonic() + self._give_up_after
        while time.monotonic() < deadline and not self._stop.is_set():
            for port in self._ports():
                delivery.attempts += 1
                try:
                    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                        stub = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
                        response = stub.Report(request, metadata=metadata, timeout=5)
                except grpc.RpcError:
                    self.failed_calls += 1
                    continue
                ack = next((a for a in response.acks if a.fault_id == fault.id), None)
                if ack is None or ack.verdict not in FINAL:
                    # No answer for it, or "retry later" (VERDICT_UNSPECIFIED): keep it.
                    self.deferred += 1
                    break
                delivery.verdict = fault_pb2.Verdict.Name(ack.verdict).removeprefix("VERDICT_")
                if ack.verdict == fault_pb2.VERDICT_REFUSED:
                    delivery.verdict += f":{ack.reason}"
                delivery.delivered_at = wall()
                return delivery
            self._stop.wait(0.2)
        return delivery


def retry(what: str, call: Callable[[], Any], timeout: float = 90.0) -> Any:
    """`call()`, again while the API server does not answer (it may be restarting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ApiException as exc:
            if exc.status is not None and exc.status < 500 and exc.status != 429:
                raise
            problem: Exception = exc
        except Exception as exc:  # a connection refused while it restarts
            problem = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"harness: {what} kept failing for {timeout:.0f}s: {problem}")
        time.sleep(0.2)


def ignore_missing(call: Callable[[], Any]) -> None:
    """`call()`, where the object being gone (or already bound: a conflict) is no error."""
    try:
        call()
    except ApiException as exc:
        if exc.status not in (404, 409):
            raise
