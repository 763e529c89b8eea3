"""`edl-agent hosts`: print the job's workers fit to train on, one `host[:slots]` per line, as
Horovod's `--host-discovery-script` reads them (see `decide` for what is left out and why)."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from edl_agent.errors import Unavailable, UsageError
from edl_agent.kube_errors import ApiError

if TYPE_CHECKING:
    from edl_agent.hosts.decide import HostRules, Snapshot

# Where a pod finds its own namespace (beside the service account's token).
SERVICE_NAMESPACE_FILENAME = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# (connect, read) seconds of each request: a launcher runs the discovery every second and waits
# for it; a server that does not answer in time is a failure, not a hang.
TIMEOUT = (5.0, 10.0)
# --timeout: the whole run's bound. A server that trickles its answer keeps each read within the
# read timeout and the run going for ever; the launcher waits for the script every time.
DEFAULT_DEADLINE_SECONDS = 30.0
BAD_REQUEST = 400
FORBIDDEN = 403

DESCRIPTION = """\
Print the worker pods of a job that are fit to train on, one `host:slots` line each, for an
elastic launcher's host discovery (horovodrun --host-discovery-script). A pod is left out while
it is not Running and Ready, is being deleted or replaced (deletionTimestamp, DisruptionTarget,
a restarter replacement naming it), holds a device kubelet reports Unhealthy
(allocatedResourcesStatus), or its node is gone, NotReady, tainted unreachable or
out-of-service, or AcceleratorHealthy=False while kubelet reports no device health for the pod.

host: the pod's IPv4 address; with --dns `<hostname>.<subdomain>` for pods that have both.
slots: --slots N, else --slots-from label:KEY or annotation:KEY, else the accelerators the pod
holds (limits of accelerator resources, devices of its ResourceClaims); a pod with no count is
printed without `:slots`, so the launcher's default applies. Nothing fit: empty output, exit 0.
Exit 1 with one line on stderr when the API server cannot be reached, refuses, or has not
answered in full within --timeout (nothing is known), exit 2 for bad input.
"""

EPILOG = """\
permissions: list pods (and resourceclaims, for slots from DRA claims) in the namespace; get
nodes (cluster-wide, a ClusterRole) unless --skip-nodes. Credentials: --kubeconfig, else
$KUBECONFIG, else the pod's service account.
example: horovodrun -np 8 --min-np 4 --host-discovery-script /etc/edl/discover_hosts.sh train.py
with discover_hosts.sh running `exec edl-agent hosts --selector job-name=resnet`.
"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "hosts",
        help="print a job's workers fit to train on, as host:slots lines (host discovery)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-l",
        "--selector",
        required=True,
        type=_selector,
        help="label selector of the job's worker pods, e.g. job-name=resnet,replica-type=worker",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        help="the job's namespace (default: the pod's own, from its service account; else "
        "`default`)",
    )
    parser.add_argument("--kubeconfig", metavar="FILE", help="credentials (see below)")
    parser.add_argument(
        "--dns",
        action="store_true",
        help="print `<hostname>.<subdomain>` for pods that have both (a StatefulSet's, an indexed "
        "Job's with a headless Service) instead of their IP. A replacement then keeps the name "
        "of the pod it replaces: give horovodrun --blacklist-cooldown-range, or a failed name "
        "never comes back",
    )
    slots = parser.add_mutually_exclusive_group()
    slots.add_argument("--slots", type=_positive, metavar="N", help="N slots for every host")
    slots.add_argument(
        "--slots-from",
        type=_source,
        metavar="label:KEY|annotation:KEY",
        help="slots from this label or annotation of each pod (a positive integer; missing or "
        "not a number: the launcher's default)",
    )
    parser.add_argument(
        "--resource",
        action="append",
        default=[],
        metavar="NAME",
        help="an extended resource or DRA driver whose devices count as slots (repeatable; "
        "default: nvidia.com/gpu, nvidia.com/mig-*, huawei.com/Ascend*, kunlunxin.com/xpu, "
        "hygon.com/dcunum, ... and the edl.io and gpu.nvidia.com drivers)",
    )
    parser.add_argument(
        "--skip-nodes",
        action="store_true",
        help="do not read nodes (no ClusterRole needed): a dead node's pods are then left out "
        "only once the node controller marks them not Ready",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_DEADLINE_SECONDS,
        metavar="SECONDS",
        help=f"give up after this long in all, however slowly the API server answers (default "
        f"{DEFAULT_DEADLINE_SECONDS:g}): exit 1",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="also say on stderr which pods were left out and why",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from edl_agent import log
    from edl_agent.hosts.decide import HostRules, SlotRule, discover_hosts

    log.configure("warning")  # stdout is the launcher's: anything logged goes to stderr
    namespace = args.namespace or default_namespace(Path(SERVICE_NAMESPACE_FILENAME))
    rules = HostRules(
        dns=args.dns,
        slots=SlotRule(
            fixed=args.slots, source=args.slots_from, resources=frozenset(args.resource)
        ),
    )
    try:
        with _deadline(args.timeout):
            snapshot = _read(args, namespace, rules)
    except _Overdue:
        msg = f"no full answer from the API server within {args.timeout:g} s (--timeout)"
        raise Unavailable(msg) from None
    hosts = discover_hosts(snapshot, rules)
    for note in hosts.notes:
        print(f"edl-agent hosts: {note}", file=sys.stderr)
    if args.explain:
        for pod in hosts.left_out:
            print(f"edl-agent hosts: left out {pod.pod}: {pod.reason}", file=sys.stderr)
    if hosts.lines:
        print("\n".join(hosts.lines), flush=True)
    return 0


def _read(args: argparse.Namespace, namespace: str, rules: HostRules) -> Snapshot:
    from edl_agent.hosts.read import read_snapshot
    from edl_agent.kube import KubeConfigError
    from edl_agent.kube_rest import connect

    try:
        api = connect(args.kubeconfig or "", timeout=TIMEOUT, name="--kubeconfig")
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None
    if api is None:
        msg = "no credentials: pass --kubeconfig, set $KUBECONFIG or run in a pod"
        raise UsageError(msg)
    try:
        snapshot = read_snapshot(
            api,
            namespace=namespace,
            selector=args.selector,
            rules=rules,
            read_nodes=not args.skip_nodes,
        )
    except ApiError as exc:
        raise _failure(exc, namespace) from None
    finally:
        api.close()
    return snapshot


class _Overdue(BaseException):
    """--timeout has passed. Not an Exception: no client library's handler for a failed request
    may take it for one."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise `_Overdue` in the block once `seconds` have passed, wherever it waits (a read, a TLS
    handshake, a credential plugin): a signal reaches them all, in the main thread."""

    def overdue(_signum: int, _frame: FrameType | None) -> None:
        raise _Overdue

    previous = signal.signal(signal.SIGALRM, overdue)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def default_namespace(path: Path) -> str:
    """The pod's own namespace where the service account's file says it, else `default`."""
    try:
        return path.read_text(encoding="utf-8").strip() or "default"
    except (OSError, UnicodeDecodeError):
        return "default"


def _failure(exc: ApiError, namespace: str) -> Exception:
    if exc.status == BAD_REQUEST:  # the selector is the only input the server judges
        return UsageError(f"--selector: {exc}")
    if exc.status == FORBIDDEN:
        return Unavailable(
            f"{exc} (needs list pods in {namespace}, get nodes unless --skip-nodes, and list "
            "resourceclaims for slots from DRA claims)"
        )
    if exc.status is None:
        return Unavailable(f"cannot reach the API server: {exc}")
    return Unavailable(str(exc))


def _selector(text: str) -> str:
    if not text.strip():
        msg = "an empty selector would select every pod of the namespace"
        raise argparse.ArgumentTypeError(msg)
    return text.strip()


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        msg = f"{text!r} is not a positive number of seconds"
        raise argparse.ArgumentTypeError(msg)
    return seconds


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit() and int(text) > 0):
        msg = f"{text!r} is not a positive integer"
        raise argparse.ArgumentTypeError(msg)
    return int(text)


def _source(text: str) -> tuple[str, str]:
    kind, _, key = text.partition(":")
    if kind not in ("label", "annotation") or not key.strip():
        msg = f"{text!r}: expected label:KEY or annotation:KEY"
        raise argparse.ArgumentTypeError(msg)
    return kind, key.strip()
