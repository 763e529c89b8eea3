"""A tree `simulate build` made keeps what `run --host-root` writes inside it: the agent's state,
kubelet's directories and the pod-resources socket default to paths in the tree, never the
host's /var/lib; what is given explicitly still wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from edl_agent.sim.commands import SIMULATED_MARKER


def edl(*argv: str) -> subprocess.CompletedProcess[str]:
    # Not the tests' own state directory (conftest sets it for every agent they start).
    environ = {k: v for k, v in os.environ.items() if k != "EDL_FAULTS__STATE_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "edl_agent.cli", *argv],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def resolved(*argv: str) -> dict[str, object]:
    done = edl("config", "--format", "json", *argv)
    assert done.returncode == 0, done.stderr
    settings: dict[str, object] = json.loads(done.stdout)
    return settings


def test_a_built_tree_keeps_the_agents_state_inside_it(tmp_path: Path) -> None:
    tree = tmp_path / "node"
    built = edl("simulate", "build", "dgx-h100", str(tree))
    assert built.returncode == 0, built.stderr
    assert (tree / SIMULATED_MARKER).read_text().strip() == "dgx-h100"

    settings = resolved("--host-root", str(tree))

    root = str(tree.resolve())
    faults = settings["faults"]
    plugin = settings["plugin"]
    assert isinstance(faults, dict)
    assert isinstance(plugin, dict)
    assert faults["state_dir"] == f"{root}/var/lib/edl-agent"
    assert plugin["kubelet_dir"] == f"{root}/var/lib/kubelet/device-plugins"
    assert settings["pod_resources_socket"] == f"{root}/var/lib/kubelet/pod-resources/kubelet.sock"
    explicit = resolved("--host-root", str(tree), "--set", f"faults.state_dir={tmp_path / 'mine'}")
    assert isinstance(explicit["faults"], dict)
    assert explicit["faults"]["state_dir"] == str(tmp_path / "mine")


def test_a_real_host_root_keeps_the_hosts_paths(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()  # an unmarked root: the defaults are the host's own
    faults = resolved("--host-root", str(tmp_path))["faults"]
    assert isinstance(faults, dict)
    assert faults["state_dir"] == "/var/lib/edl-agent"


def test_relative_paths_are_made_absolute(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "edl_agent.cli", "config", "--format", "json",
         "--set", "plugin.kubelet_dir=kubelet",
         "--set", "faults.state_dir=state"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    settings = json.loads(done.stdout)
    assert settings["plugin"]["kubelet_dir"] == str(tmp_path.resolve() / "kubelet")
    assert settings["faults"]["state_dir"] == str(tmp_path.resolve() / "state")
