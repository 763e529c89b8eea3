"""What the command line tells a person: help texts that are true (the settings epilog, the
precedence of the layers, `discover`'s JSON shape), `config` as the agent resolves it, the
device table, and the closest key or flag for a typo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from edl_agent import log
from edl_agent.cli import main
from edl_agent.cli.command import build_parser
from edl_agent.cli.settings import settings_from_args
from edl_agent.settings_loader import PRECEDENCE

README = Path(__file__).resolve().parent.parent / "README.md"


def flat(text: str) -> str:
    return " ".join(text.split())


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def no_settings_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    for key in [k for k in os.environ if k.startswith("EDL_")]:
        if not key.startswith(("EDL_CACHE", "EDL_K8S")):
            monkeypatch.delenv(key)


def test_the_settings_epilog_points_to_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    text = flat(help_of(capsys))
    assert "every key below" not in text
    assert "`edl-agent config --keys` lists them" in text


@pytest.mark.parametrize("argv", [("run",), ("discover",), ("config",), ("restarter",)])
def test_every_settings_help_states_the_same_precedence(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    assert PRECEDENCE in flat(help_of(capsys, *argv))


def test_the_readme_states_the_precedence_for_both_processes() -> None:
    assert flat(README.read_text(encoding="utf-8")).count(PRECEDENCE) >= 2


def test_the_precedence_is_what_the_agent_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(log, "configure", lambda *_a, **_k: None)
    file = tmp_path / "edl.yaml"
    file.write_text("log_level: error\nnode_name: from-file\n")
    parser = build_parser()

    def level(*argv: str, env: dict[str, str]) -> str:
        args = parser.parse_args(["config", "--config", str(file), *argv])
        return settings_from_args(args, environ=env).log_level

    assert level(env={}) == "error"  # the file
    assert level(env={"EDL_LOG_LEVEL": "warning"}) == "warning"  # environment over file
    assert level("--set", "log_level=info", env={"EDL_LOG_LEVEL": "warning"}) == "info"
    assert level("--set", "log_level=info", "--log-level", "debug", env={}) == "debug"
    assert level("--log-level", "debug", "--set", "log_level=info", env={}) == "debug"


def test_config_prints_yaml_with_the_node_name_resolved(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_text("gpu-from-hostname\n")
    assert main(["config", "--host-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not out.lstrip().startswith("{")
    printed = yaml.safe_load(out)
    assert printed["node_name"] == "gpu-from-hostname"
    assert printed["nvidia"]["enabled"] is True
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    assert main(["config", "--host-root", str(tmp_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["node_name"] == "gpu-7"
    assert main(["config", "--host-root", str(tmp_path), "--node-name", "given"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["node_name"] == "given"


def test_the_yaml_config_reads_back_as_a_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["config", "--host-root", str(tmp_path), "--set", "nvidia.mig_strategy=mixed"]
    assert main([*argv, "--set", "sharing=[{resource: nvidia.com/gpu, replicas: 4}]"]) == 0
    first = capsys.readouterr().out
    saved = tmp_path / "saved.yaml"
    saved.write_text(first)
    assert main(["config", "--config", str(saved), "--format", "json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again == yaml.safe_load(first)
    assert again["nvidia"]["mig_strategy"] == "mixed"


def test_config_keys_prints_yaml_values_not_python(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["config", "--keys"], ["restarter", "config", "--keys"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        defaults = {line.split()[0]: line.split()[1] for line in out.splitlines()}
        assert not re.search(r"\s(True|False|None|\(\)|\{\}\)|'[^']*')\s", out), out
        if argv[0] == "config":
            assert defaults["nvidia.enabled"] == "true"
            assert defaults["sharing"] == "[]"
            assert defaults["host_root"] == '"/"'
        else:
            assert defaults["namespaces"] == "[]"


def test_the_discover_help_names_every_key_of_its_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = flat(help_of(capsys, "discover"))
    assert main(["discover", "--simulate", "mixed-gpu-npu", "--format", "json"]) == 0
    inventory: dict[str, Any] = json.loads(capsys.readouterr().out)
    shape = text[text.index("json for programs:") :]
    for key in inventory:
        assert f'"{key}"' in shape, key
    for nested in ("resources", "vendors"):
        for key in inventory[nested][0]:
            assert f'"{key}"' in shape, f"{nested}.{key}"
    topology_help = text[text.index("With --format json:") :]
    assert main(["discover", "--simulate", "mixed-gpu-npu", "--topology", "--format", "json"]) == 0
    for key in json.loads(capsys.readouterr().out):
        assert f'"{key}"' in topology_help, key


def test_the_table_counts_gpus_and_mig_devices_apart(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--simulate", "dgx-a100-mig", "--log-level", "error"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "node sim-dgx-a100: 8 GPUs, 24 MIG devices"
    mig = [line.split() for line in lines if line.startswith("nvidia  mig")]
    assert len(mig) == 24
    assert [row[2] for row in mig[:3]] == ["0:0", "0:1", "1:0"]
    assert all(re.fullmatch(r"\d+:\d+", row[2]) for row in mig)


def test_an_empty_node_says_why_in_the_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["discover", "--host-root", str(tmp_path), "--node-name", "bare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("node bare: 0 accelerators\nno accelerators found under ")
    assert "/dev and /sys missing" in out


def test_the_restarter_usage_has_no_stray_positional(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys, "restarter")
    assert "[config]" not in text
    usage = text[: text.index("\n\n")]
    assert "edl-agent restarter config [--keys]" in usage


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["config", "--set", "healt.x=1"], "healt: unknown key, did you mean health?"),
        (
            ["config", "--set", "health.quiet_secnds=1"],
            "health.quiet_secnds: unknown key, did you mean health.quiet_seconds?",
        ),
        (
            ["discover", "--formt", "json"],
            "unrecognized arguments: --formt json, did you mean --format?",
        ),
        (["config", "--kyes"], "did you mean --keys?"),
        (["restarter", "config", "--lisen", ":1"], "did you mean --listen?"),
        (
            ["restarter", "--lisen", ":1"],
            "unrecognized arguments: --lisen, did you mean --listen?",
        ),
        (["restarter", "--listen", ":1", "confg"], "did you mean config?"),
        (["discver"], "invalid choice: 'discver'"),
        (["discver"], "did you mean discover?"),
        (["discover", "--format", "jsn"], "did you mean json?"),
    ],
)
def test_a_typo_gets_the_closest_key_or_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert says in err


def test_a_mistyped_flags_value_is_not_taken_for_a_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`restarter` has an optional command (`config`): the value after a flag it does not know
    would otherwise be read as that command."""
    with pytest.raises(SystemExit) as done:
        main(["restarter", "--lisen", ":1"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" not in err
    assert "':1'" not in err


def test_nothing_close_is_not_guessed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["discover", "--zzz"])
    assert "did you mean" not in capsys.readouterr().err
    assert main(["config", "--set", "colour=red"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_output_without_a_traceback() -> None:
    """`edl-agent config --keys | head`, with a reader gone before the first write (`true`
    exits while Python still starts): the exit status of a tool killed by SIGPIPE, nothing on
    stderr."""
    edl_agent = Path(sys.executable).with_name("edl-agent")
    done = subprocess.run(
        ["bash", "-c", f'"{edl_agent}" config --keys | true; echo "status ${{PIPESTATUS[0]}}"'],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert (done.stdout, done.stderr) == ("status 141\n", "")
