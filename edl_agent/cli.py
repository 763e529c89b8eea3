"""`edl-agent` command line: discover accelerators, and build simulated nodes to run on."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from edl_agent import __version__, log
from edl_agent.config import DraSettings, Settings, load_settings
from edl_agent.devices.model import Inventory
from edl_agent.errors import Unavailable, UsageError, did_you_mean
from edl_agent.hosts import command as hosts_command
from edl_agent.preflight import check_host_root
from edl_agent.restarter import cli as restarter_cli
from edl_agent.settings_loader import (
    PRECEDENCE,
    ConfigError,
    assignment,
    describe_settings,
    set_path,
)
from edl_agent.sim import commands as sim_commands_module

if TYPE_CHECKING:
    from edl_agent.agent import Agent
    from edl_agent.runtime.deadline import StopDeadline

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a tool whose reader went away
EXIT_UNAVAILABLE = 1
KUBELET_DIR = "/var/lib/kubelet/device-plugins"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
STATE_DIR = "/var/lib/edl-agent"

DESCRIPTION = """\
edl-agent discovers the accelerators of a Kubernetes node (NVIDIA GPUs with MIG, Kunlunxin XPUs,
Hygon DCUs, Huawei Ascend NPUs and shared slices of them) and tells kubelet, the node and the
restarter about them. Every command reads the node under --host-root (default /), or under a
simulated node built from a profile with --simulate PROFILE (see `edl-agent simulate list`).
"""

SETTINGS_EPILOG = (
    textwrap.fill(
        "settings: every key (`edl-agent config --keys` lists them, with their defaults and "
        "meanings) can come from --config FILE (YAML), from an EDL_* environment variable "
        "(EDL_LOG_LEVEL=debug, EDL_NVIDIA__MIG_STRATEGY=mixed) or from --set KEY=VALUE; "
        f"{PRECEDENCE}, and the file over a simulated profile's defaults. `edl-agent config` "
        "prints the effective settings.",
        width=96,
        break_on_hyphens=False,
    )
    + "\n"
)

# `discover --format json`: tests/test_cli_help.py checks it against real output.
DISCOVER_JSON_SHAPE = (
    '{"node", "devices": [...], "resources": [{"name", "devices": [ids]}], '
    '"vendors": [{"vendor", "count", "driver", "error"}]}'
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (UsageError, ConfigError) as exc:  # a ProfileError is a UsageError
        print(error_line(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except Unavailable as exc:
        print(error_line(str(exc)), file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader has gone (`edl-agent config --keys | head`): end as a tool killed by
        # SIGPIPE does, without the traceback Python would print flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def error_line(message: str) -> str:
    """Bad input is reported as exactly one line, whatever the message holds."""
    return f"edl-agent: error: {' '.join(message.split())}"


class Parser(argparse.ArgumentParser):
    """argparse, with its mistakes reported like every other bad input: one line, exit 2, and
    the closest flag or command for a mistyped one (argparse's own `suggest_on_error` is 3.14+)."""

    # The namespace attribute where the (sub)parser that met an unknown flag leaves its hint.
    HINT = "_edl_flag_hint"
    # The arguments this parser was last given, for `error`: argparse does not pass them.
    _given: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost parser runs first and knows the flags of its command: its hint stays.
        if extras and not getattr(parsed, self.HINT, ""):
            known = [o for action in self._actions for o in action.option_strings]
            flags = (e.partition("=")[0] for e in extras if e.startswith("--"))
            hints = (did_you_mean(flag, known) for flag in flags)
            setattr(parsed, self.HINT, next((h for h in hints if h), ""))
        return parsed, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        hint = getattr(parsed, self.HINT, "")
        if hasattr(parsed, self.HINT):
            delattr(parsed, self.HINT)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def error(self, message: str) -> NoReturn:
        choice = re.match(r"argument .*: invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if choice:
            flag = self._unknown_flag_before(choice.group(1))
            if flag:
                # `restarter --lisen :1`: the value of a mistyped flag, read as a command.
                known = [o for action in self._actions for o in action.option_strings]
                message = f"unrecognized arguments: {flag}{did_you_mean(flag, known)}"
            else:
                known = [c.strip(" '") for c in choice.group(2).split(",")]
                message += did_you_mean(choice.group(1), known)
        self.exit(EXIT_USAGE, error_line(f"{message} (see {self.prog} --help)") + "\n")

    def _unknown_flag_before(self, value: str) -> str:
        """The flag this parser does not know that stands right before `value` in its
        arguments, or `` when there is none."""
        for flag, following in itertools.pairwise(self._given):
            unknown = flag.startswith("-") and flag not in self._option_string_actions
            if following == value and unknown and "=" not in flag:
                return flag
        return ""


def build_parser() -> argparse.ArgumentParser:
    # Typed as the base class: subcommand parsers are made with the same class at run time.
    parser: argparse.ArgumentParser = Parser(
        prog="edl-agent",
        description=DESCRIPTION,
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edl-agent {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    node = _node_options()
    discover = commands.add_parser(
        "discover",
        parents=[node],
        help="list the node's accelerators and the resources kubelet would see",
        description="Discover every accelerator under the host root and print the inventory: "
        "one row per device and the resources that would be advertised to kubelet (slices "
        "included). A vendor whose library or tool fails is reported as an error and the "
        "others are still listed.",
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    discover.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help=f"table for people (default), json for programs: {DISCOVER_JSON_SHAPE}",
    )
    discover.add_argument(
        "--topology",
        action="store_true",
        help="print how the physical accelerators connect instead, as `nvidia-smi topo -m` "
        "does: a matrix of direct links (NV# NVLinks, HCCS, HCCS_SW, SIO, UB, XGMI) or else PCIe "
        "paths (PIX, PXB, PHB, NODE, SYS), with each device's CPU and NUMA affinity. NVIDIA: NVML "
        "(NVLink counts, common ancestor, affinity). Ascend: npu-smi info -t topo (HCCS, HCCS_SW "
        "through a switch, SIO between the dies of an A3 NPU, UB; not counted). "
        "Hygon: xGMI links in the KFD topology (not counted). Kunlunxin: no XPU Links are read. "
        "Everything else, and every pair of different vendors, from sysfs (PCI tree, NUMA "
        "nodes). With --format json: "
        '{"node", "devices", "pairs", "matrix", "vendors": [{"vendor", "known", "error"}], '
        '"legend"}',
    )
    discover.set_defaults(handler=_discover)

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
    run.set_defaults(handler=_run)

    restarter_cli.add_parser(commands)
    hosts_command.add_parser(commands)

    config = commands.add_parser(
        "config",
        parents=[node],
        help="print the effective settings, or every key with its default",
        description="Print the settings after merging the config file, EDL_* environment and "
        "flags (and the profile's defaults with --simulate), as the agent would use them: "
        "node_name resolved as the agent resolves it (the setting, else $NODE_NAME, else the "
        "host root's /etc/hostname, else this machine's hostname), paths made absolute.",
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_argument("--keys", action="store_true", help="list every key, default and meaning")
    config.add_argument(
        "--format",
        choices=("yaml", "json"),
        default="yaml",
        help="yaml (default; a valid --config file) or json",
    )
    config.set_defaults(handler=_config)

    sim_commands = commands.add_parser(
        "simulate",
        help="build, record and list simulated nodes",
        description=sim_commands_module.DESCRIPTION,
    ).add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)
    sim_commands_module.add_parsers(
        sim_commands, node_options=_node_options(), record=_simulate_record
    )
    return parser


def _node_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument(
        "--host-root", metavar="DIR", help="read the node under DIR (default /, or host_root)"
    )
    where.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="build a simulated node for PROFILE (or from a recording directory) in a "
        "temporary directory and read it",
    )
    common.add_argument("--config", metavar="FILE", help="YAML settings file")
    common.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="assignments",
        help="set any setting, e.g. --set nvidia.mig_strategy=mixed (repeatable)",
    )
    common.add_argument("--node-name", help="Kubernetes node name (default $NODE_NAME or hostname)")
    common.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    common.add_argument("--log-format", choices=("auto", "json", "console"))
    return common


def absolute_paths(settings: Settings) -> Settings:
    """Every path setting made absolute (against the working directory): a relative one would
    mean something else to each part that joins or binds it, and gRPC takes `unix://kubelet/x`
    for a host name."""

    def absolute(path: str) -> str:
        return path if not path or Path(path).is_absolute() else str(Path(path).resolve())

    return dataclasses.replace(
        settings,
        host_root=absolute(settings.host_root),
        pod_resources_socket=absolute(settings.pod_resources_socket),
        plugin=dataclasses.replace(
            settings.plugin, kubelet_dir=absolute(settings.plugin.kubelet_dir)
        ),
        faults=dataclasses.replace(
            settings.faults,
            state_dir=absolute(settings.faults.state_dir),
            token_file=absolute(settings.faults.token_file),
            ca_file=absolute(settings.faults.ca_file),
        ),
        node=dataclasses.replace(
            settings.node,
            kubeconfig=absolute(settings.node.kubeconfig),
            features_file=absolute(settings.node.features_file),
        ),
        dra=dataclasses.replace(
            settings.dra,
            plugins_registry_dir=absolute(settings.dra.plugins_registry_dir),
            cdi_dir=absolute(settings.dra.cdi_dir),
        ),
    )


def settings_from_args(
    args: argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    host_root: str | None = None,
) -> Settings:
    """Settings from --config, the environment and flags; `host_root` (a simulated tree) wins."""
    overrides: dict[str, Any] = {}
    for text in args.assignments:
        path, value = assignment(text, Settings)
        set_path(overrides, path, value)
    for flag in ("host_root", "node_name", "log_level", "log_format", "metrics_addr"):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    if getattr(args, "kubelet_dir", None) is not None:
        set_path(overrides, ["plugin", "kubelet_dir"], args.kubelet_dir)
    for flag in ("state_dir", "restarter_address"):
        value = getattr(args, flag, None)
        if value is not None:
            set_path(overrides, ["faults", flag], value)
    if getattr(args, "kubeconfig", None) is not None:
        set_path(overrides, ["node", "kubeconfig"], args.kubeconfig)
    if host_root is not None:
        overrides["host_root"] = host_root
    settings = load_settings(
        file=args.config,
        environ=os.environ if environ is None else environ,
        overrides=overrides,
        defaults=defaults,
    )
    log.configure(settings.log_level, settings.log_format)
    return absolute_paths(settings)


@contextlib.contextmanager
def node_settings(args: argparse.Namespace) -> Iterator[Settings]:
    """Settings for a command that reads a node, with a simulated tree when --simulate is given."""
    if args.simulate is None:
        settings = settings_from_args(args)
        check_host_root(settings.host_root)
        name = sim_commands_module.simulated_profile(Path(settings.host_root))
        if name is not None:  # a tree `simulate build` made: nothing of the host is touched
            from edl_agent.sim.profile import load_profile, profile_names

            config = load_profile(name).config if name in profile_names() else {}
            defaults = _simulated_defaults(settings.host_root, config)  # absolute already
            settings = settings_from_args(args, defaults=defaults)
        yield settings
        return
    from edl_agent.sim.profile import load_profile
    from edl_agent.sim.replay import is_recording

    recording = Path(args.simulate)
    name = recording.name if is_recording(recording) else load_profile(args.simulate).name
    with tempfile.TemporaryDirectory(prefix=f"edl-sim-{name}-") as tmp:
        config = {} if is_recording(recording) else load_profile(name).config
        settings = settings_from_args(
            args, defaults=_simulated_defaults(tmp, config), host_root=tmp
        )
        structlog.get_logger().info("building simulated node", profile=name, root=tmp)
        if is_recording(recording):
            sim_commands_module.replay_tree(recording, Path(tmp))
        else:
            sim_commands_module.build_tree(name, Path(tmp), args.node_name)
        yield settings


def _simulated_defaults(root: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """A simulated host's settings: its profile's, and kubelet's directories, the pod-resources
    socket and the agent's state inside the tree, unless configured."""
    defaults: dict[str, Any] = {**config}
    defaults["plugin"] = {"kubelet_dir": f"{root}{KUBELET_DIR}", **defaults.get("plugin", {})}
    defaults.setdefault("pod_resources_socket", f"{root}{POD_RESOURCES_SOCKET}")
    defaults["faults"] = {"state_dir": f"{root}{STATE_DIR}", **defaults.get("faults", {})}
    defaults["dra"] = {
        "plugins_registry_dir": f"{root}{DraSettings.plugins_registry_dir}",
        "cdi_dir": f"{root}{DraSettings.cdi_dir}",
        **defaults.get("dra", {}),
    }
    return defaults


def _discover(args: argparse.Namespace) -> int:
    from edl_agent.devices.discovery import discover_node

    with node_settings(args) as settings:
        inventory = discover_node(settings)
        if args.topology:
            from edl_agent.devices.hostroot import HostRoot
            from edl_agent.devices.topology import render_matrix
            from edl_agent.devices.topology_read import read_topology

            topology = read_topology(HostRoot.at(settings.host_root), inventory)
            if args.format == "json":
                print(json.dumps(topology.to_json(), indent=2))
            else:
                print(render_matrix(topology))
            return 0
    if args.format == "json":
        print(json.dumps(inventory.to_json(), indent=2))
    else:
        print(render_table(inventory))
    return 0


def _run(args: argparse.Namespace) -> int:
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

        agent = Agent(settings)
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


def _config(args: argparse.Namespace) -> int:
    if args.keys:
        for key, default, meaning in describe_settings(Settings):
            print(f"{key:32} {default:24} {meaning}")
        return 0
    with node_settings(args) as settings:
        print(render_config(resolved(settings), fmt=args.format), end="")
    return 0


def resolved(settings: Settings) -> Settings:
    """The settings as the agent uses them: the node's name resolved as discovery does."""
    from edl_agent.devices.discovery import node_name
    from edl_agent.devices.hostroot import HostRoot

    name = node_name(settings, HostRoot.at(settings.host_root), os.environ)
    return dataclasses.replace(settings, node_name=name)


def render_config(settings: Settings, *, fmt: str) -> str:
    """`settings` as YAML (block style, in the schema's order) or as JSON."""
    plain = json.loads(json.dumps(dataclasses.asdict(settings)))  # tuples and enums made plain
    if fmt == "json":
        return json.dumps(plain, indent=2) + "\n"
    import yaml

    text: str = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, width=1000)
    return text


def _simulate_record(args: argparse.Namespace) -> int:
    from edl_agent.devices.discovery import discover_node
    from edl_agent.devices.hostroot import HostRoot
    from edl_agent.sim.record import RecordError, record

    directory: Path = args.directory
    sim_commands_module.require_empty(directory)
    with node_settings(args) as settings:
        root = HostRoot.at(settings.host_root)
        try:
            summary = record(
                root, directory, discover_json=lambda: discover_node(settings).to_json()
            )
        except RecordError as exc:
            raise UsageError(str(exc)) from None
    print(
        f"recorded {summary.gpus} GPUs and {summary.mig_devices} MIG devices into {directory} "
        f"({summary.failed_queries} NVML queries refused, listed in recording.json)"
    )
    print(f"replay it with: edl-agent discover --simulate {directory}")
    return 0


def render_table(inventory: Inventory) -> str:
    header = ("VENDOR", "KIND", "INDEX", "ID", "PRODUCT", "MEMORY", "NUMA", "PCI", "HEALTH")
    index_of = {d.id: d.index for d in inventory.devices}
    rows = [
        (
            d.vendor.value,
            d.kind,
            str(d.index) if d.parent is None else f"{index_of.get(d.parent, '?')}:{d.index}",
            d.id,
            d.product,
            f"{d.memory_mib} MiB",
            "-" if d.numa_node is None else str(d.numa_node),
            d.pci_bus_id or "-",
            d.health.value,
        )
        for d in inventory.devices
    ]
    lines = [f"node {inventory.node}: {device_counts(inventory)}"]
    if rows:
        lines += _columns([header, *rows])
    else:
        from edl_agent.labels.condition import no_accelerators

        lines.append(no_accelerators(inventory).message)
    for vendor, error in sorted(inventory.errors.items()):
        lines.append(f"error {vendor}: {error}")
    lines.append("")
    lines += _columns(
        [("RESOURCE", "COUNT"), *((r.name, str(len(r.units))) for r in inventory.resources)]
    )
    return "\n".join(lines)


# How the table counts each kind of device (a MIG device is a slice of a GPU, not another GPU).
KIND_NAMES = {"gpu": "GPU", "mig": "MIG device", "npu": "NPU", "xpu": "XPU", "dcu": "DCU"}


def device_counts(inventory: Inventory) -> str:
    """`8 GPUs, 24 MIG devices`: each kind counted apart, in the order they are listed."""
    counts: dict[str, int] = {}
    for device in inventory.devices:
        counts[device.kind] = counts.get(device.kind, 0) + 1
    if not counts:
        return "0 accelerators"
    return ", ".join(
        f"{n} {KIND_NAMES.get(kind, kind)}{'' if n == 1 else 's'}" for kind, n in counts.items()
    )


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


if __name__ == "__main__":
    sys.exit(main())
