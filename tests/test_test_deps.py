"""scripts/test-deps, as a new user meets it: the README's test command starts with it.

Each case runs the real script with a PATH made for it (a folder of the few programs bash needs,
plus stand-in executables for the tools that are "installed"), so what is missing is what the
case says, whatever this machine has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "test-deps"
UNIT_TOOLS = ("gcc", "openssl", "prometheus", "promtool")
CLUSTER_TOOLS = ("unshare", "mount", "go")
NEEDED_BY_THE_SCRIPT = ("id", "sed")


def path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH that holds the script's own needs and stand-ins for `tools`."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True)
    for program in NEEDED_BY_THE_SCRIPT:
        real = shutil.which(program)
        assert real is not None, program
        (folder / program).symlink_to(real)
    for tool in tools:
        stand_in = folder / tool
        stand_in.write_text("#!/bin/sh\nexit 0\n")
        stand_in.chmod(0o755)
    return str(folder)


def run(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(SCRIPT), *args],
        env={"PATH": path, "HOME": os.environ.get("HOME", "/")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_nothing_installed_is_one_line_naming_every_tool_and_the_install_command(
    tmp_path: Path,
) -> None:
    result = run(path_with(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("scripts/test-deps: missing gcc openssl prometheus promtool unshare")
    assert "install them with: sudo apt-get install gcc openssl prometheus util-linux mount" in line
    assert "Go >= 1.26" in line


def test_the_unit_tier_asks_only_for_its_own_tools(tmp_path: Path) -> None:
    result = run(path_with(tmp_path, "gcc", "openssl"), "--unit")
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line == (
        "scripts/test-deps: missing prometheus promtool; "
        "install them with: sudo apt-get install prometheus"
    )


def test_everything_present_is_silent(tmp_path: Path) -> None:
    result = run(path_with(tmp_path, *UNIT_TOOLS, *CLUSTER_TOOLS))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    result = run(path_with(tmp_path / "unit", *UNIT_TOOLS), "--unit")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.skipif(os.geteuid() != 0, reason="the install path is taken only by root")
def test_root_with_apt_installs_the_packages_and_check_never_does(tmp_path: Path) -> None:
    """apt-get here is a stand-in that records its arguments and installs nothing: the script
    then still finds the tools missing and says so in its one line."""
    path = path_with(tmp_path, "gcc", "openssl", *CLUSTER_TOOLS)
    calls = tmp_path / "apt-get.calls"
    apt = Path(path) / "apt-get"
    apt.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    apt.chmod(0o755)

    checked = run(path, "--check")
    assert checked.returncode == 2
    assert not calls.exists()

    installed = run(path)
    assert installed.returncode == 2
    assert calls.read_text().splitlines() == [
        "update -qq",
        "install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends prometheus",
    ]
    assert installed.stderr.splitlines() == [
        "scripts/test-deps: installing prometheus (missing: prometheus promtool)",
        "scripts/test-deps: missing prometheus promtool; install them",
    ]


def test_an_unknown_argument_is_refused_in_one_line(tmp_path: Path) -> None:
    result = run(path_with(tmp_path), "--bogus")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "scripts/test-deps: unknown argument '--bogus' (see --help)"
    ]
