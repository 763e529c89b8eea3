"""What an idle agent does in a minute, by cause: which threads wake up and how often, the CPU
they spend, the processes it starts, the requests it makes to the API server, and the waits
that end by a timeout rather than by news.

    .venv/bin/python bench/idle_minute.py [--quick] [--window 60] [--no-strace]

One test control plane (etcd + kube-apiserver + KWOK, scripts/testcluster.py) with the API
server's audit log on, one KWOK Node, deploy/daemonset/agent-rbac.yaml installed, and a token
bound to a pod on that node as kubelet projects it, so that the agent runs as on a real node:
`edl-agent run --simulate dgx-h100 --kubeconfig ... --node-name ...` (the runtime environment of
bench/runtime_venv.py, as its image runs it) beside the kubelet stand-in of
tests/kubelet_standin.py. Once nvidia.com/gpu is registered, the Node carries the agent's
labels, /readyz answers 200, the stand-in holds a ListAndWatch stream as kubelet does and a
settling pause has passed (10 s, 3 s with --quick), the agent is observed for a window (60 s,
10 s with --quick), then for a second window as long with strace attached (unless
--no-strace). Nothing scrapes /metrics or probes it, and no pod on the node changes.

How each figure is taken (each scaled to a minute of its window):

- wakeups (first window): voluntary + involuntary context switches of every thread of the agent
  and its children, from /proc/PID/task/TID/status read every 0.5 s (a thread that ends counts
  up to its last reading; one that starts counts from zero); cpu: the threads' run time from
  /proc/PID/task/TID/schedstat over the same readings. Python threads keep the names the agent
  gives them (the supervisor's `part-<name>`): a few lines run before `edl-agent run` name each
  new thread in the kernel (prctl PR_SET_NAME, 15 bytes) and write its full name to a file;
  threads started in C (gRPC's) keep their own names.
- API requests (first window): the API server's audit log (one event per request, at
  RequestReceived, only for the agent's service account), by verb and resource. A watch counts
  when it is opened; one held through the window counts nothing.
- processes and threads started, programs executed, connections (second window): `strace -f`
  attached to the agent (execve, clone, clone3, fork, vfork, connect).
- waits (second window, the same strace): the calls that wait (futex waits, epoll_wait, poll,
  select and their variants, clock_nanosleep, nanosleep) that return within the window, each
  counted as timed out (a timeout elapsed, or a sleep) or woken (an event, a futex wake), by
  thread. A blocking read or recv (inotify, a socket without a timeout) is not among them. The
  waits under way when strace attaches come back as restart_syscall, which does not say what it
  resumes: they are counted apart (idle_waits_resumed_after_attaching, at most one a thread).
  A traced thread stops at its system calls, and an agent under strace wakes about three times
  as often (even under `strace --seccomp-bpf` tracing clone alone): so the wakeups and CPU come
  from the first, untraced window, and the traced window reports counts only.

Prints `name value unit` lines, progress on stderr; figures are never judged. Exit status 3 when
the control plane's binaries are missing, 1 when the agent does not come up or exits. Without
strace (or when it may not attach) the second window is left out, and said so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubernetes import client, config, utils

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "tests" / "cluster", REPO / "scripts", REPO / "bench", REPO):
    sys.path.insert(0, str(_path))

import k8sbinaries  # noqa: E402
import testcluster  # noqa: E402
from k8s_test_helpers import KwokCluster, bound_tokens  # noqa: E402
from runtime_venv import runtime_python  # noqa: E402

from tests.kubelet_standin import KubeletStandIn  # noqa: E402

PROFILE = "dgx-h100"
RESOURCE = "nvidia.com/gpu"
LABEL = "nvidia.com/gpu.product"
NAMESPACE = "edl-system"  # the manifest's, so its RBAC and admission policies apply unchanged
SERVICE_ACCOUNT = "edl-agent"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
MANIFEST = REPO / "deploy" / "daemonset" / "agent-rbac.yaml"
STRACE = "strace"
START_TIMEOUT_S = 60.0
SAMPLE_S = 0.5
TOP = 8  # threads named in the figures; the log lists them all
LIFECYCLE_CALLS = ("execve", "clone", "clone3", "fork", "vfork", "connect")
WAIT_CALLS = (
    "futex", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select",
    "pselect6", "clock_nanosleep", "nanosleep", "restart_syscall",
)  # fmt: skip
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["ResponseStarted", "ResponseComplete", "Panic"],
    "rules": [{"level": "Metadata", "users": [AGENT_USER]}, {"level": "None"}],
}

# Run in the agent's interpreter before `edl-agent run`: each Python thread gets its name in the
# kernel (15 bytes) and its full name in a file, and the agent dies with this script, even when
# this script is killed.
NAMING = """
import ctypes, os, runpy, signal, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
names = os.environ.pop("EDL_IDLE_THREAD_NAMES")
def name(thread):
    libc.prctl(15, thread.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    with open(names, "a") as out:
        out.write(f"{threading.get_native_id()}\\t{thread.name}\\n")
native_id = threading.Thread._set_native_id
def named(self):
    native_id(self)
    name(self)
threading.Thread._set_native_id = named
name(threading.main_thread())
sys.argv[0] = "edl-agent"
runpy.run_module("edl_agent.cli", run_name="__main__", alter_sys=True)
"""


def log(message: str) -> None:
    print(f"[idle-minute] {message}", file=sys.stderr, flush=True)


class RunFailed(Exception):
    """The agent did not come up or did not last; the message carries its log's tail."""


# --- the agent's threads ------------------------------------------------------------------


@dataclass
class Reading:
    pid: int
    comm: str
    switches: tuple[int, int]  # voluntary, involuntary
    run_ns: int


def read_threads(pids: list[int]) -> dict[int, Reading]:
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            for task in tasks:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    status = dict(
                        line.split(":\t", 1)
                        for line in (task / "status").read_text().splitlines()
                        if ":\t" in line
                    )
                    run_ns = int((task / "schedstat").read_text().split()[0])
                    found[int(task.name)] = Reading(
                        pid,
                        status["Name"].strip(),
                        (
                            int(status["voluntary_ctxt_switches"]),
                            int(status["nonvoluntary_ctxt_switches"]),
                        ),
                        run_ns,
                    )
    return found


def process_tree(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    return []


@dataclass
class ThreadWindow:
    """The agent's threads over the window: first and last reading of each."""

    first: dict[int, Reading] = field(default_factory=dict)
    last: dict[int, Reading] = field(default_factory=dict)
    born: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)
    processes: set[int] = field(default_factory=set)


def observe_threads(agent: int, seconds: float) -> tuple[ThreadWindow, float]:
    """Read the threads of the agent's tree every SAMPLE_S for `seconds`; the window as read."""
    window = ThreadWindow()
    started = time.monotonic()
    window.first = read_threads(process_tree(agent))
    window.last = dict(window.first)
    deadline = started + seconds
    while True:
        now = time.monotonic()
        time.sleep(min(SAMPLE_S, max(deadline - now, 0.0)))
        pids = process_tree(agent)
        window.processes.update(pids)
        reading = read_threads(pids)
        window.born.update(tid for tid in reading if tid not in window.last)
        window.ended.update(tid for tid in window.last if tid not in reading)
        window.last.update(reading)
        if time.monotonic() >= deadline:
            return window, time.monotonic() - started


def thread_names(path: Path) -> dict[int, str]:
    names = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            tid, _, name = line.partition("\t")
            with contextlib.suppress(ValueError):
                names[int(tid)] = name
    return names


def thread_label(tid: int, reading: Reading, agent: int, names: dict[int, str]) -> str:
    name = names.get(tid, reading.comm)
    if reading.pid != agent:
        with contextlib.suppress(OSError):
            name = f"{Path(f'/proc/{reading.pid}/comm').read_text().strip()}:{name}"
    return name


@dataclass
class ByName:
    threads: int = 0
    voluntary: int = 0
    involuntary: int = 0
    run_ns: int = 0

    @property
    def wakeups(self) -> int:
        return self.voluntary + self.involuntary


def by_name(window: ThreadWindow, agent: int, names: dict[int, str]) -> dict[str, ByName]:
    grouped: dict[str, ByName] = defaultdict(ByName)
    for tid, last in window.last.items():
        first = window.first.get(tid)
        base = first if first is not None and tid not in window.born else None
        entry = grouped[thread_label(tid, last, agent, names)]
        entry.threads += 1
        entry.voluntary += last.switches[0] - (base.switches[0] if base else 0)
        entry.involuntary += last.switches[1] - (base.switches[1] if base else 0)
        entry.run_ns += last.run_ns - (base.run_ns if base else 0)
    return dict(grouped)


# --- strace --------------------------------------------------------------------------------


@dataclass
class Call:
    pid: int
    at: float  # epoch seconds at entry
    name: str
    text: str  # arguments and result as strace wrote them
    result: str  # the return value, its errno name for an error, "?" when unknown
    returned: float  # epoch seconds at return (entry when strace could not time it)

    @property
    def failed(self) -> bool:
        return not self.result.lstrip("-").isdigit() and not self.result.startswith("0x")


STRACE_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$")
ENTRY = re.compile(r"^(\w+)\((.*)$")
RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
RESULT = re.compile(r"\)\s+=\s+(\S+)(?:\s+(E[A-Z]+))?[^=]*$")
SPENT = re.compile(r"<(\d+\.\d+)>\s*$")


def strace_calls(path: Path) -> list[Call]:
    """Completed calls of an `strace -f -ttt -o` file (entries split by other threads joined)."""
    calls = []
    pending: dict[int, tuple[float, str, str]] = {}
    with contextlib.suppress(OSError), path.open(errors="replace") as lines:
        for line in lines:
            parsed = STRACE_LINE.match(line.rstrip("\n"))
            if parsed is None:
                continue
            pid, at, rest = int(parsed[1]), float(parsed[2]), parsed[3]
            resumed = RESUMED.match(rest)
            if resumed is not None:
                if pid not in pending:
                    continue
                at, name, head = pending.pop(pid)
                text = head + resumed[2]
            else:
                entry = ENTRY.match(rest)
                if entry is None:  # a signal, an exit
                    continue
                name, text = entry[1], entry[2]
                if text.endswith("<unfinished ...>"):
                    pending[pid] = (at, name, text.removesuffix("<unfinished ...>"))
                    continue
            found = RESULT.search(text)
            result = "?" if found is None else (found[2] or found[1])
            spent = SPENT.search(text)
            returned = at + float(spent[1]) if spent else at
            calls.append(Call(pid, at, name, text, result, returned))
    return calls


def attach_strace(pid: int, path: Path, calls: tuple[str, ...]) -> subprocess.Popen[bytes]:
    argv = [
        STRACE, "-f", "-qq", "-ttt", "-T", "-s", "64", "-e", f"trace={','.join(calls)}",
        "-e", "signal=none", "-o", str(path), "-p", str(pid),
    ]  # fmt: skip
    with path.with_suffix(".err").open("w") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)


def attached(pid: int, tracer: int) -> bool:
    """Every thread of `pid` traced by `tracer`."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        for task in tasks:
            status = (task / "status").read_text()
            if f"\nTracerPid:\t{tracer}\n" not in status:
                return False
    except OSError:
        return False
    return bool(tasks)


@dataclass
class Lifecycle:
    processes: int = 0
    threads: int = 0
    execs: Counter[str] = field(default_factory=Counter)
    api_connections: int = 0
    other_connections: Counter[str] = field(default_factory=Counter)


def lifecycle(calls: list[Call], start: float, end: float, api_port: int) -> Lifecycle:
    seen = Lifecycle()
    for call in calls:
        if not start <= call.at < end:
            continue
        # A non-blocking connect answers EINPROGRESS: an attempt counts, whatever its answer.
        if call.failed and call.name != "connect":
            continue
        if call.name in ("clone", "clone3"):
            if "CLONE_THREAD" in call.text:
                seen.threads += 1
            else:
                seen.processes += 1
        elif call.name in ("fork", "vfork"):
            seen.processes += 1
        elif call.name == "execve":
            program = re.match(r'\s*"([^"]*)"', call.text)
            seen.execs[Path(program[1]).name if program else "?"] += 1
        elif call.name == "connect":
            if f"sin_port=htons({api_port})" in call.text:
                seen.api_connections += 1
            else:
                family = re.search(r"sa_family=(\w+)", call.text)
                seen.other_connections[family[1] if family else "?"] += 1
    return seen


@dataclass
class Waits:
    timed_out: Counter[str] = field(default_factory=Counter)  # by syscall
    woken: Counter[str] = field(default_factory=Counter)
    timed_out_by_thread: Counter[int] = field(default_factory=Counter)
    woken_by_thread: Counter[int] = field(default_factory=Counter)
    # Waits under way when strace attached, which the kernel resumed with restart_syscall:
    # strace cannot tell which call that was, so they are neither timed out nor woken.
    resumed: int = 0


def waits(calls: list[Call], start: float, end: float) -> Waits:
    seen = Waits()
    for call in calls:
        if not start <= call.returned < end or call.result == "?":
            continue
        name = call.name
        if name == "restart_syscall":
            seen.resumed += 1
            continue
        if name == "futex":
            if "FUTEX_WAIT" not in call.text:
                continue  # a wake or a requeue: someone else's wait ends
            if call.result == "EAGAIN":
                continue  # the value had changed: it never slept
            timed_out = call.result == "ETIMEDOUT"
        elif name in ("clock_nanosleep", "nanosleep"):
            timed_out = True
        else:
            timed_out = call.result == "0"
        kind = "futex_wait" if name == "futex" else name
        if timed_out:
            seen.timed_out[kind] += 1
            seen.timed_out_by_thread[call.pid] += 1
        else:
            seen.woken[kind] += 1
            seen.woken_by_thread[call.pid] += 1
    return seen


# --- the audit log -------------------------------------------------------------------------


def audit_requests(path: Path, start: float, end: float, user: str = AGENT_USER) -> Counter[str]:
    """`user`'s requests received within [start, end) (epoch seconds), by verb and resource
    (and subresource)."""
    found: Counter[str] = Counter()
    with contextlib.suppress(OSError), path.open() as lines:
        for line in lines:
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                if event.get("user", {}).get("username") != user:
                    continue
                at = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"])
                if not start <= at.timestamp() < end:
                    continue
                ref = event.get("objectRef") or {}
                what = [event["verb"], ref.get("resource") or event["requestURI"].split("?")[0]]
                if ref.get("subresource"):
                    what.append(ref["subresource"])
                found[" ".join(what)] += 1
    return found


def with_audit(policy: Path, audit_log: Path, rules: dict[str, Any] = AUDIT_POLICY) -> None:
    """The API server of the next testcluster.start() writes its audit log (`rules`: the
    audit policy, by default the agent's requests)."""
    policy.write_text(yaml.safe_dump(rules))
    flags = [f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}"]
    argv = testcluster._apiserver_argv

    def audited(*args: Any, **kwargs: Any) -> list[str]:
        return [*argv(*args, **kwargs), *flags]

    testcluster._apiserver_argv = audited


# --- the node ------------------------------------------------------------------------------


@dataclass
class Setup:
    plane: testcluster.ControlPlane
    kwok: KwokCluster
    node: str
    kubeconfig: Path
    api_port: int
    audit_log: Path
    scratch: Path
    kubelet: KubeletStandIn


def install_rbac(api: client.ApiClient) -> None:
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
    )
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    utils.create_from_yaml(api, yaml_objects=docs)


def agent_kubeconfig(path: Path, plane: testcluster.ControlPlane, token: str) -> Path:
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {"server": plane.server, "certificate-authority": str(plane.ca_file)},
            }
        ],
        "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "test", "user": SERVICE_ACCOUNT}}],
        "current-context": "agent",
    }
    path.write_text(yaml.safe_dump(document))
    path.chmod(0o600)
    return path


@dataclass
class Agent:
    process: subprocess.Popen[bytes]
    logfile: Path
    names: Path
    metrics_port: int
    started: float
    began: float  # epoch seconds, for the audit log
    tree: dict[int, float] = field(default_factory=dict)  # its processes' start times

    @property
    def pid(self) -> int:
        return self.process.pid

    def remember(self, pids: list[int] | set[int]) -> None:
        """Processes of the agent's tree, to end whatever of it outlives the agent."""
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.tree.setdefault(pid, psutil.Process(pid).create_time())

    def failure(self, why: str) -> RunFailed:
        status = self.process.poll()
        state = "still running" if status is None else f"exit status {status}"
        lines = self.logfile.read_text(errors="replace").splitlines()
        tail = "\n".join(f"    {line}" for line in lines[-20:])
        return RunFailed(f"edl-agent: {why} ({state}); last lines of its log:\n{tail}")


def start_agent(setup: Setup) -> Agent:
    work = setup.scratch / "a"
    work.mkdir()
    port = testcluster.free_port()
    names = work / "threads.tsv"
    logfile = work / "agent.log"
    argv = [
        str(runtime_python(log)), "-c", NAMING, "run", "--simulate", PROFILE,
        "--kubelet-dir", str(setup.kubelet.directory), "--metrics-addr", f"127.0.0.1:{port}",
        "--kubeconfig", str(setup.kubeconfig), "--node-name", setup.node,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        # The simulated node's tree; a short path, for its unix sockets' sake (108 bytes).
        "TMPDIR": str(work),
        "EDL_IDLE_THREAD_NAMES": str(names),
    }
    # No preexec_fn: a fork() beside this process's gRPC threads (the stand-in's) can abort the
    # child before it execs; NAMING makes the agent die with this process instead.
    with logfile.open("w") as out:
        began, started = time.time(), time.monotonic()
        process = subprocess.Popen(argv, env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT)
    agent = Agent(process, logfile, names, port, started, began)
    agent.remember([agent.pid])
    return agent


def ready(agent: Agent) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", agent.metrics_port, timeout=2)
    try:
        connection.request("GET", "/readyz")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def wait_up(setup: Setup, agent: Agent, registrations: int) -> None:
    """Registered with the stand-in, labels on the Node, /readyz 200."""
    deadline = agent.started + START_TIMEOUT_S
    while True:
        try:
            setup.kubelet.wait_registered({RESOURCE}, after=registrations, timeout=0.2)
            break
        except AssertionError as exc:
            if agent.process.poll() is not None:
                raise agent.failure(f"exited before {RESOURCE} was registered") from None
            if time.monotonic() > deadline:
                raise agent.failure(str(exc)) from None
    registered = time.monotonic()
    while LABEL not in (setup.kwok.core.read_node(setup.node).metadata.labels or {}):
        if agent.process.poll() is not None or time.monotonic() > deadline:
            raise agent.failure(f"{LABEL} not on the Node within {START_TIMEOUT_S:.0f}s")
        time.sleep(0.2)
    labelled = time.monotonic()
    while not ready(agent):
        if agent.process.poll() is not None or time.monotonic() > deadline:
            raise agent.failure(f"/readyz not 200 within {START_TIMEOUT_S:.0f}s")
        time.sleep(0.2)
    log(
        f"agent {agent.pid}: registered {registered - agent.started:.2f}s, labels "
        f"{labelled - agent.started:.2f}s, ready {time.monotonic() - agent.started:.2f}s"
    )


def stop_agent(agent: Agent) -> None:
    """SIGTERM to the agent, then SIGKILL to whatever of its tree outlives it."""
    agent.remember(process_tree(agent.pid))
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent.pid, signal.SIGTERM)
    try:
        agent.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGKILL)
        try:
            agent.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()
    for pid, created in agent.tree.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() == created:
                log(f"ending {pid} ({process.name()}), left behind by the agent")
                process.kill()


# --- the windows ---------------------------------------------------------------------------


def per_minute(count: float, seconds: float) -> float:
    return count * 60.0 / seconds


def figure_name(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unnamed"


def settle_and_hold(setup: Setup, agent: Agent, settle_s: float) -> Any:
    """The agent up, a ListAndWatch stream held (as kubelet holds one per resource), settled."""
    registrations = len(setup.kubelet.registrations)
    wait_up(setup, agent, registrations)
    stream = setup.kubelet.watch(RESOURCE)
    stream.next(timeout=10)
    log(f"settling for {settle_s:.0f}s")
    time.sleep(settle_s)
    return stream


def activity_window(setup: Setup, agent: Agent, seconds: float) -> None:
    log(f"observing the agent for {seconds:.0f}s")
    start = time.time()
    window, elapsed = observe_threads(agent.pid, seconds)
    end = start + elapsed
    if agent.process.poll() is not None:
        raise agent.failure("exited during the window")
    agent.remember(window.processes)
    time.sleep(1.0)  # the audit log's last events
    names = thread_names(agent.names)
    grouped = by_name(window, agent.pid, names)
    report_threads(grouped, window, elapsed)
    # The start-up's requests show that the audit log sees the agent, whatever the window holds.
    starting = audit_requests(setup.audit_log, agent.began, start)
    log(f"API requests from the start to the window: {sum(starting.values())}" + "".join(
        f"\n    {count:>5}  {what}" for what, count in starting.most_common()
    ))  # fmt: skip
    print(f"idle_api_requests_before_window {sum(starting.values())} requests")
    requests = audit_requests(setup.audit_log, start, end)
    report_requests(requests, elapsed)
    print(f"idle_window {elapsed:.1f} s")


def report_threads(grouped: dict[str, ByName], window: ThreadWindow, seconds: float) -> None:
    ranked = sorted(grouped.items(), key=lambda item: (-item[1].wakeups, item[0]))
    log(f"{'thread':<32} {'n':>3} {'wakeups/min':>12} {'vol':>8} {'invol':>7} {'cpu ms/min':>11}")
    for name, entry in ranked:
        log(
            f"{name[:32]:<32} {entry.threads:>3} {per_minute(entry.wakeups, seconds):>12.1f} "
            f"{per_minute(entry.voluntary, seconds):>8.1f} "
            f"{per_minute(entry.involuntary, seconds):>7.1f} "
            f"{per_minute(entry.run_ns / 1e6, seconds):>11.2f}"
        )
    voluntary = sum(e.voluntary for e in grouped.values())
    involuntary = sum(e.involuntary for e in grouped.values())
    run_ns = sum(e.run_ns for e in grouped.values())
    print(f"idle_wakeups {per_minute(voluntary + involuntary, seconds):.1f} per_min")
    print(f"idle_wakeups_voluntary {per_minute(voluntary, seconds):.1f} per_min")
    print(f"idle_wakeups_involuntary {per_minute(involuntary, seconds):.1f} per_min")
    print(f"idle_cpu {per_minute(run_ns / 1e6, seconds):.1f} ms_per_min")
    print(f"idle_cpu_percent {100 * run_ns / 1e9 / seconds:.3f} percent_of_a_core")
    print(f"idle_threads {len(window.last) - len(window.ended)} threads")
    print(f"idle_processes {len(window.processes)} processes")
    print(f"idle_threads_seen_starting {per_minute(len(window.born), seconds):.1f} per_min")
    for name, entry in [item for item in ranked if item[1].wakeups or item[1].run_ns][:TOP]:
        key = figure_name(name)
        print(f"idle_wakeups_thread_{key} {per_minute(entry.wakeups, seconds):.1f} per_min")
        print(f"idle_cpu_thread_{key} {per_minute(entry.run_ns / 1e6, seconds):.2f} ms_per_min")


def report_requests(requests: Counter[str], seconds: float) -> None:
    total = sum(requests.values())
    log(f"API requests in the window: {total}" + "".join(
        f"\n    {count:>5}  {what}" for what, count in requests.most_common()
    ))  # fmt: skip
    print(f"idle_api_requests {per_minute(total, seconds):.1f} per_min")
    for what, count in requests.most_common():
        print(f"idle_api_{figure_name(what)} {per_minute(count, seconds):.1f} per_min")


def report_lifecycle(seen: Lifecycle, seconds: float) -> None:
    execs = sum(seen.execs.values())
    log(
        f"strace: {seen.processes} processes, {execs} programs "
        f"({', '.join(f'{n} {c}x' for n, c in seen.execs.most_common()) or 'none'}), "
        f"{seen.threads} threads started, {seen.api_connections} connections to the API server, "
        f"other connections: {dict(seen.other_connections) or 'none'}"
    )
    print(f"idle_processes_started {per_minute(seen.processes, seconds):.1f} per_min")
    print(f"idle_programs_executed {per_minute(execs, seconds):.1f} per_min")
    print(f"idle_threads_started {per_minute(seen.threads, seconds):.1f} per_min")
    print(f"idle_api_connections {per_minute(seen.api_connections, seconds):.1f} per_min")
    other = sum(seen.other_connections.values())
    print(f"idle_other_connections {per_minute(other, seconds):.1f} per_min")


def traced_window(setup: Setup, agent: Agent, seconds: float) -> None:
    trace = setup.scratch / "strace.log"
    tracer = attach_strace(agent.pid, trace, (*LIFECYCLE_CALLS, *WAIT_CALLS))
    try:
        deadline = time.monotonic() + 10
        while not attached(agent.pid, tracer.pid):
            if tracer.poll() is not None or time.monotonic() > deadline:
                why = trace.with_suffix(".err").read_text(errors="replace").strip()
                log(f"strace could not attach, no traced window: {why or 'no reason given'}")
                return
            time.sleep(0.05)
        log(f"strace attached; the second window, {seconds:.0f}s")
        start = time.time()
        time.sleep(seconds)
        end = time.time()
        pids = process_tree(agent.pid)
        agent.remember(pids)
        names = thread_names(agent.names)
        labels = {
            tid: thread_label(tid, reading, agent.pid, names)
            for tid, reading in read_threads(pids).items()
        }
    finally:
        if tracer.poll() is None:
            tracer.send_signal(signal.SIGINT)  # strace detaches and exits
        try:
            tracer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait()
    if agent.process.poll() is not None:
        raise agent.failure("exited during the traced window")
    calls = strace_calls(trace)
    elapsed = end - start
    report_lifecycle(lifecycle(calls, start, end, setup.api_port), elapsed)
    report_waits(waits(calls, start, end), labels, elapsed)
    print(f"idle_traced_window {elapsed:.1f} s")


def report_waits(seen: Waits, labels: dict[int, str], elapsed: float) -> None:
    timed_out, woken = sum(seen.timed_out.values()), sum(seen.woken.values())
    print(f"idle_waits {per_minute(timed_out + woken, elapsed):.1f} per_min")
    print(f"idle_waits_timed_out {per_minute(timed_out, elapsed):.1f} per_min")
    print(f"idle_waits_woken {per_minute(woken, elapsed):.1f} per_min")
    print(f"idle_waits_resumed_after_attaching {seen.resumed} waits")
    for kind in sorted(set(seen.timed_out) | set(seen.woken)):
        key = figure_name(kind)
        print(f"idle_waits_{key}_timed_out {per_minute(seen.timed_out[kind], elapsed):.1f} per_min")
        print(f"idle_waits_{key}_woken {per_minute(seen.woken[kind], elapsed):.1f} per_min")
    by_thread: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for tid in set(seen.timed_out_by_thread) | set(seen.woken_by_thread):
        name = labels.get(tid, f"ended thread {tid}")
        by_thread[name][0] += seen.timed_out_by_thread[tid]
        by_thread[name][1] += seen.woken_by_thread[tid]
    ranked = sorted(by_thread.items(), key=lambda item: (-item[1][0], -item[1][1], item[0]))
    log(f"{'thread':<32} {'timed out/min':>14} {'woken/min':>10}")
    for name, (out, woke) in ranked:
        log(f"{name[:32]:<32} {per_minute(out, elapsed):>14.1f} {per_minute(woke, elapsed):>10.1f}")
    for name, (out, _) in ranked[:TOP]:
        if out:
            key = figure_name(name)
            print(f"idle_timeouts_thread_{key} {per_minute(out, elapsed):.1f} per_min")


# --- main ----------------------------------------------------------------------------------


def run(args: argparse.Namespace, strace: bool, scratch: Path) -> None:
    audit_log = scratch / "audit.log"
    with_audit(scratch / "audit-policy.yaml", audit_log)
    log("starting the test control plane (etcd, kube-apiserver with its audit log, KWOK)")
    plane = testcluster.start(scratch / "plane", attached=True)
    api: client.ApiClient | None = None
    kubelet: KubeletStandIn | None = None
    agent: Agent | None = None
    try:
        log(f"control plane ready in {plane.startup_seconds:.1f}s")
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        install_rbac(api)
        kwok = KwokCluster(api, NAMESPACE)
        node = kwok.create_gpu_node().metadata.name
        (token,) = bound_tokens(kwok.core, NAMESPACE, node, SERVICE_ACCOUNT, [[]])
        kubeconfig = agent_kubeconfig(scratch / "agent.kubeconfig", plane, token)
        kubelet_dir = scratch / "kubelet" / "device-plugins"
        kubelet_dir.mkdir(parents=True)
        kubelet = KubeletStandIn(kubelet_dir)
        kubelet.start()
        port = int(plane.server.rsplit(":", 1)[1])
        setup = Setup(plane, kwok, node, kubeconfig, port, audit_log, scratch, kubelet)
        log(f"node {node}: the agent's RBAC and a pod-bound token for {AGENT_USER}")

        agent = start_agent(setup)
        stream = settle_and_hold(setup, agent, args.settle)
        try:
            activity_window(setup, agent, args.window)
            if strace:
                traced_window(setup, agent, args.window)
        finally:
            stream.cancel()
    finally:
        if agent is not None:
            stop_agent(agent)
        if kubelet is not None:
            kubelet.stop()
        if api is not None:
            api.close()
        plane.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s windows, 3 s settling")
    parser.add_argument("--window", type=float, help="seconds observed (default 60)")
    parser.add_argument("--settle", type=float, help="seconds after start-up (default 10)")
    parser.add_argument(
        "--no-strace", dest="strace", action="store_false",
        help="leave out the second window, the one under strace",
    )  # fmt: skip
    args = parser.parse_args()
    args.window = args.window or (10.0 if args.quick else 60.0)
    args.settle = args.settle if args.settle is not None else (3.0 if args.quick else 10.0)
    absent = k8sbinaries.missing(k8sbinaries.CONTROL_PLANE)
    if absent:
        log(f"the test control plane lacks {', '.join(absent)}: run scripts/k8s-binaries")
        return 3
    strace = args.strace and shutil.which(STRACE) is not None
    if args.strace and not strace:
        log(
            f"{STRACE} not found: processes started, programs executed, connections and waits "
            "are not measured (apt-get install strace)"
        )
    with tempfile.TemporaryDirectory(prefix="edl-idle-") as tmp:
        try:
            run(args, strace, Path(tmp))
        except RunFailed as exc:
            log(str(exc))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
