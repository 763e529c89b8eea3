"""`edl-agent run`: the node agent. Kubelet's device-plugin API is served and registered before
the rest (the Kubernetes client, metrics, fault reporting, DRA) is even imported."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from edl_agent.cli.parser import SETTINGS_EPILOG
from edl_agent.cli.settings import node_settings
from edl_agent.cli.table import render_table
from edl_agent.config import Settings
from edl_agent.errors import UsageError

if TYPE_CHECKING:
    from edl_agent.agent import Agent
    from edl_agent.runtime.deadline import StopDeadline


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], node: argparse.ArgumentParser
) -> None:
    run = commands.add_parser(
        "run",
        parents=[node],
        help="run the node agent: serve kubelet's device-plugin API for every resource",
        description="Discover the node, then serve the kubelet device-plugin API (v1beta1) for "
        "every advertised resource, one unix socket per resource in --kubelet-dir, and register "
        "each with kubelet.sock there. Kubelet restarts are followed (sockets re-served and "
        "registered again within a second); devices whose /dev nodes vanish turn Unhealthy; "
        "the inventory is re-discovered periodically. Non-zero container exits of this node's "
        "pods and devices turning Unhealthy under pods are reported to --restarter-address "
        "through a durable outbox in --state-dir. SIGTERM or Ctrl-C stops the servers, "
        "removes our sockets and exits 0. With --simulate and no kubelet dir configured, the "
        "simulated node's own var/lib/kubelet/device-plugins is used.",
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--kubelet-dir",
        metavar="DIR",
        help="kubelet's device-plugin directory (default /var/lib/kubelet/device-plugins)",
    )
    run.add_argument(
        "--metrics-addr", metavar="HOST:PORT", help="address for /metrics (default :9400)"
    )
    run.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the agent's state; faults wait in DIR/outbox until the restarter acknowledges them "
        "(default /var/lib/edl-agent; with --simulate, inside the simulated node)",
    )
    run.add_argument(
        "--restarter-address",
        metavar="HOST:PORT",
        help="the restarter's fault intake; container exits on this node and unhealthy devices "
        "held by pods are reported there (default: none, faults are only logged)",
    )
    run.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="credentials for writing labels, the node condition and events, and for watching "
        "this node's pods (node.kubeconfig). Without it: $KUBECONFIG, else the pod's service "
        "account in a cluster, else nothing is written, only logged. With --simulate only this "
        "flag or node.kubeconfig counts, never $KUBECONFIG or a service account, so that a "
        "simulated node cannot label a real cluster's node by accident",
    )
    run.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    from edl_agent.node_lock import AnotherAgent, one_agent_per_node
    from edl_agent.preflight import check_run_paths
    from edl_agent.runtime.signals import stop_on_signals

    with node_settings(args) as settings, contextlib.ExitStack() as held:
        check_run_paths(settings)
        _check_credentials(settings, simulated=args.simulate is not None)
        try:  # before anything is served: a second agent touches nothing of the first's
            held.enter_context(one_agent_per_node(Path(settings.plugin.kubelet_dir)))
        except AnotherAgent as exc:
            raise UsageError(str(exc)) from None
        # Imported once the settings are known to be usable: these take most of the start-up.
        from edl_agent.agent import Agent

        agent = Agent.discover(settings)
        scratch = settings.host_root if args.simulate is not None else None
        deadline = held.enter_context(_stop_deadline(scratch))

        def stop() -> None:
            agent.stop.set()
            deadline.arm()

        with stop_on_signals(stop):
            # Kubelet first: the devices are schedulable before the Kubernetes client, the
            # metrics and the fault reporting are even loaded. A later start-up error takes them
            # away again.
            agent.serve_kubelet()
            try:
                print(render_table(agent.state.snapshot().inventory), flush=True)
                _start_the_rest(agent, settings, simulated=args.simulate is not None)
            except BaseException:
                agent.close()
                raise
            agent.run()
    return 0


@contextlib.contextmanager
def _stop_deadline(scratch: str | None = None) -> Iterator[StopDeadline]:
    """Once a signal asks the agent to stop, it ends within STOP_DEADLINE_SECONDS: a wait that
    cannot be cut short (an API server that stopped answering) does not hold it past that.
    `scratch` (the temporary tree of `--simulate`) is removed first: the forced exit skips the
    clean-up that would have removed it."""
    from edl_agent.runtime.deadline import StopDeadline

    def expired(running: list[str]) -> None:
        structlog.get_logger().warning(
            "stopping took too long: exiting now", seconds=deadline.seconds, running=running
        )
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    deadline = StopDeadline(on_expiry=expired)
    try:
        yield deadline
    finally:
        deadline.disarm()


def _check_credentials(settings: Settings, *, simulated: bool) -> None:
    """A kubeconfig that cannot work is refused before anything starts (UsageError)."""
    from edl_agent.kube import KUBECONFIG_ENV, KubeConfigError, check_credentials

    # A simulated node uses only a kubeconfig it is given: never $KUBECONFIG or a pod's
    # service account, which belong to whatever real cluster this shell or pod is in.
    if simulated and not settings.node.kubeconfig and os.environ.get(KUBECONFIG_ENV):
        structlog.get_logger().info(
            "$KUBECONFIG ignored for a simulated node; pass --kubeconfig to use it"
        )
    try:
        check_credentials(settings.node.kubeconfig, ambient=not simulated)
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None


def _start_the_rest(agent: Agent, settings: Settings, *, simulated: bool) -> None:
    """Fault reporting, metrics, the node publisher and DRA; UsageError for unusable settings."""
    from edl_agent.faults.outbox import OutboxError
    from edl_agent.kube import KubeConfigError
    from edl_agent.kube_rest import connect

    node = settings.node
    timeout = (node.api_connect_timeout_seconds, node.api_read_timeout_seconds)
    try:
        api = connect(node.kubeconfig, ambient=not simulated, timeout=timeout)
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None
    try:  # kubelet's other API first: claims can be prepared once slices and plugin are there
        agent.start_dra(api)
    except OSError as exc:
        msg = f"dra: {exc}"
        raise UsageError(msg) from None
    try:
        agent.start_faults(api)
    except (OutboxError, ValueError) as exc:
        msg = f"faults: {exc}"
        raise UsageError(msg) from None
    try:
        agent.start_metrics()
    except OSError as exc:
        msg = f"metrics_addr {settings.metrics_addr}: {exc.strerror or exc}"
        raise UsageError(msg) from None
    agent.start_publisher(api)
