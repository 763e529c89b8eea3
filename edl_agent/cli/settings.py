"""The settings a command runs with: --config, the environment and flags merged, paths made
absolute, and for --simulate (or a tree `simulate build` made) a simulated node to read."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog

from edl_agent import log
from edl_agent.config import DraSettings, Settings, load_settings
from edl_agent.preflight import check_host_root
from edl_agent.settings_loader import assignment, set_path
from edl_agent.sim import commands as sim_commands_module

KUBELET_DIR = "/var/lib/kubelet/device-plugins"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
STATE_DIR = "/var/lib/edl-agent"


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
