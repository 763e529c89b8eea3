"""The restarter's settings: layers (defaults < POD_* < file < EDL_RESTARTER_* < --set < flags),
every rule refusing with one line naming the key and its source, the label drop list, and
`restarter config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from kubernetes import client
from prometheus_client import generate_latest

from edl_agent.cli import main
from edl_agent.config import load_settings
from edl_agent.errors import UsageError
from edl_agent.restarter import cli
from edl_agent.restarter.core.replacement import replacement_pod
from edl_agent.restarter.core.settings import (
    DEFAULT_DROP_LABELS,
    RestarterSettings,
    label_dropped,
    label_pattern_problem,
    load_restarter_settings,
)
from edl_agent.restarter.process import Restarter
from edl_agent.settings_loader import ConfigError, describe_settings
from tests.waiting import wait_for, wait_until

AGENT_USER = "system:serviceaccount:edl-system:edl-agent"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["restarter", *argv])


def settings(*argv: str, environ: Mapping[str, str] | None = None) -> RestarterSettings:
    return cli.settings_from_args(parse(*argv), environ=environ or {})


def load(**layer: Any) -> RestarterSettings:
    return load_restarter_settings(environ={}, overrides=[("test", layer)])


def test_defaults_without_a_layer() -> None:
    assert settings() == RestarterSettings()
    assert parse().handler is cli.run
    assert RestarterSettings().election.lease_namespace == "edl-system"
    assert RestarterSettings().intake.agent_account == ("edl-system", "edl-agent")


def test_layers_defaults_pod_file_environment_set_flags(tmp_path: Path) -> None:
    config = tmp_path / "restarter.yaml"
    config.write_text(
        "election: {lease_namespace: from-file, lease_name: file-lease}\n"
        "storm: {max_share: 0.2, min_nodes: 5}\n"
        "node_grace_seconds: 60\n"
        "log_level: warning\n"
    )
    environ = {
        "POD_NAMESPACE": "pod-ns",
        "POD_NAME": "restarter-0",
        "EDL_RESTARTER_STORM__MAX_SHARE": "0.3",
        "EDL_RESTARTER_STORM__MIN_NODES": "7",
        "EDL_RESTARTER_NODE_GRACE_SECONDS": "70",
    }
    argv = ["--config", str(config), "--set", "storm.max_share=0.4", "--set", "storm.min_nodes=9"]
    got = settings(*argv, "--storm-max-share", "0.5", environ=environ)
    assert got.storm.max_share == 0.5  # a flag beats --set
    assert got.storm.min_nodes == 9  # --set beats the environment
    assert got.node_grace_seconds == 70  # the environment beats the file
    assert got.log_level == "warning"  # the file beats the defaults
    assert got.election.lease_namespace == "from-file"  # the file beats $POD_NAMESPACE
    assert (got.pod_namespace, got.pod_name) == ("pod-ns", "restarter-0")
    assert got.election.identity == "restarter-0"  # $POD_NAME beats the default
    assert got.metrics_addr == ":9401"  # no layer: the default

    below = settings(environ={"POD_NAMESPACE": "pod-ns", "POD_NAME": ""})
    assert below.election.lease_namespace == "pod-ns"
    assert (below.election.identity, below.pod_name) == ("", "")
    flag = settings("--lease-namespace", "flag-ns", "--identity", "me", environ=environ)
    assert (flag.election.lease_namespace, flag.election.identity) == ("flag-ns", "me")
    assert flag.pod_namespace == "pod-ns"  # who we are is not where the Lease is


FLAGS = [
    (["--listen", ""], "intake.listen", ""),
    (["--kubeconfig", "/k"], "kubeconfig", "/k"),
    (["--namespace", "a", "--namespace", "b"], "namespaces", ("a", "b")),
    (["--agent-service-account", "ops/agent"], "intake.agent_service_account", "ops/agent"),
    (["--audience", "aud"], "intake.audience", "aud"),
    (["--tls-cert", "/c", "--tls-key", "/k"], "intake.tls_cert", "/c"),
    (["--tls-cert", "/c", "--tls-key", "/k"], "intake.tls_key", "/k"),
    (["--node-grace-seconds", "5"], "node_grace_seconds", 5.0),
    (["--storm-max-share", "1"], "storm.max_share", 1.0),
    (["--storm-min-nodes", "0"], "storm.min_nodes", 0),
    (["--metrics-addr", "127.0.0.1:1"], "metrics_addr", "127.0.0.1:1"),
    (["--no-leader-elect"], "election.enabled", False),
    (["--leader-elect"], "election.enabled", True),
    (["--lease-namespace", "ns"], "election.lease_namespace", "ns"),
    (["--lease-name", "lease"], "election.lease_name", "lease"),
    (["--identity", "me"], "election.identity", "me"),
    (["--lease-duration-seconds", "30"], "election.lease_duration_seconds", 30.0),
    (["--renew-deadline-seconds", "3"], "election.renew_deadline_seconds", 3.0),
    (["--retry-period-seconds", "1"], "election.retry_period_seconds", 1.0),
    (["--log-level", "debug"], "log_level", "debug"),
    (["--log-format", "json"], "log_format", "json"),
]


@pytest.mark.parametrize(("argv", "key", "value"), FLAGS, ids=[" ".join(f[0]) for f in FLAGS])
def test_every_flag_sets_its_key(argv: list[str], key: str, value: Any) -> None:
    got: Any = settings(*argv)
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value


def test_every_flag_is_tested_and_names_a_key() -> None:
    tested = {
        word.removeprefix("--").removeprefix("no-")
        for argv, _, _ in FLAGS
        for word in argv
        if word.startswith("--")
    }
    assert {dest.replace("_", "-") for dest in cli.FLAG_KEYS} == tested
    keys = {key for key, _, _ in cli_keys()}
    assert set(cli.FLAG_KEYS.values()) <= keys


def cli_keys() -> list[tuple[str, str, str]]:
    return describe_settings(RestarterSettings)


def test_flags_may_follow_config_too() -> None:
    args = parse("--storm-max-share", "0.5", "config", "--namespace", "a")
    assert args.handler is cli.print_config
    got = cli.settings_from_args(args, environ={})
    assert (got.storm.max_share, got.namespaces) == (0.5, ("a",))


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (
            ["--storm-max-share", "0"],
            {},
            "storm.max_share: expected a share > 0 and at most 1, got",
        ),
        (["--storm-max-share", "0"], {}, "(from --storm-max-share)"),
        (["--set", "storm.max_share=0"], {}, "storm.max_share: expected a share > 0 and at most 1"),
        (["--set", "storm.max_share=0"], {}, "(from --set)"),
        (
            [],
            {"EDL_RESTARTER_STORM__MIN_NODES": "-1"},
            "storm.min_nodes: expected 0 to 1000000, got -1",
        ),
        ([], {"EDL_RESTARTER_STORM__MIN_NODES": "-1"}, "(from environment)"),
        ([], {"EDL_RESTARTER_COLOUR": "red"}, "colour: unknown key (from environment"),
        ([], {"POD_NAMESPACE": "Not_A_NS"}, "election.lease_namespace: 'Not_A_NS' is not a name"),
        ([], {"POD_NAMESPACE": "Not_A_NS"}, "(from $POD_NAMESPACE)"),
        (["--namespace", "ok", "--namespace", "Not_OK"], {}, "namespaces[1]: 'Not_OK' is not a"),
        (["--tls-cert", "/c"], {}, "intake.tls_key: must be set with tls_cert (give both or"),
        (["--tls-key", "/k"], {}, "intake.tls_cert: must be set with tls_key"),
        (["--renew-deadline-seconds", "20"], {}, "election: leader election needs 0 <"),
        (["--renew-deadline-seconds", "20"], {}, "(from --renew-deadline-seconds)"),
        (["--set", "novalue"], {}, "expected KEY=VALUE"),
        (["--set", "storm.min_nodes=[1"], {}, "(from --set storm.min_nodes)"),
        (["--set", "election.enabled=maybe"], {}, "election.enabled: expected true or false"),
    ],
)
def test_errors_name_the_key_and_its_source(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        settings(*argv, environ=environ)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_each_process_reads_its_own_variables() -> None:
    """A shell or pod may set the agent's EDL_* and the restarter's EDL_RESTARTER_* alike."""
    environ = {
        "EDL_FAULTS__STATE_DIR": "/var/lib/edl-agent",
        "EDL_LOG_LEVEL": "debug",
        "EDL_RESTARTER_LOG_LEVEL": "warning",
        "EDL_RESTARTER_ELECTION__ENABLED": "false",
    }
    got = settings(environ=environ)
    assert (got.log_level, got.election.enabled) == ("warning", False)
    agent = load_settings(environ=environ)
    assert (agent.log_level, agent.faults.state_dir) == ("debug", "/var/lib/edl-agent")


def test_an_error_in_the_file_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "restarter.yaml"
    config.write_text("intake:\n  listen: nonsense\n")
    with pytest.raises(
        ConfigError, match=r"intake\.listen: 'nonsense' has no port.*restarter\.yaml"
    ):
        settings("--config", str(config))
    config.write_text("replacement:\n  drop_labels: pod-template-hash\n")
    with pytest.raises(ConfigError, match=r"replacement\.drop_labels: expected a list"):
        settings("--config", str(config))


# Every rule the restarter's flags had (options.py), each still refused.
REFUSED = [
    ({"intake": {"agent_service_account": "edl-agent"}}, "intake.agent_service_account: expected"),
    ({"intake": {"agent_service_account": "Edl/agent"}}, "intake.agent_service_account"),
    ({"intake": {"agent_service_account": "edl-system/"}}, "intake.agent_service_account"),
    ({"namespaces": ["Not_A_Namespace"]}, "namespaces[0]: 'Not_A_Namespace' is not a namespace"),
    ({"namespaces": ["a" * 64]}, "namespaces[0]"),
    ({"intake": {"audience": ""}}, "intake.audience: must not be empty"),
    ({"intake": {"listen": "nonsense"}}, "intake.listen: 'nonsense' has no port"),
    ({"intake": {"listen": "[::1:8443"}}, "intake.listen: '[::1:8443': write an IPv6 host"),
    ({"metrics_addr": ":99999"}, "metrics_addr: ':99999': port '99999' is not a number"),
    ({"intake": {"tls_cert": "/c"}}, "intake.tls_key: must be set with tls_cert"),
    ({"intake": {"max_connections_per_peer": -1}}, "intake.max_connections_per_peer: expected 0"),
    (
        {"intake": {"max_connections": 8, "max_connections_per_peer": 9}},
        "intake.max_connections_per_peer: expected 0 (no cap) to max_connections (8)",
    ),
    ({"intake": {"tls_key": "/k"}}, "intake.tls_cert: must be set with tls_key"),
    ({"intake": {"workers": 0}}, "intake.workers: expected 1 to 1024"),
    ({"intake": {"max_calls_per_connection": 2000}}, "intake.max_calls_per_connection: expected"),
    ({"node_grace_seconds": "nan"}, "node_grace_seconds: expected a number"),
    ({"node_grace_seconds": float("nan")}, "node_grace_seconds: expected a finite number"),
    ({"node_grace_seconds": float("inf")}, "node_grace_seconds: expected a finite number"),
    ({"node_grace_seconds": -5}, "node_grace_seconds: expected seconds from 0 to 604800, got -5"),
    ({"node_grace_seconds": 604801}, "node_grace_seconds: expected seconds from 0 to 604800"),
    ({"storm": {"max_share": 0}}, "storm.max_share: expected a share > 0 and at most 1, got 0"),
    ({"storm": {"max_share": 1.5}}, "storm.max_share: expected a share > 0 and at most 1"),
    ({"storm": {"max_share": float("nan")}}, "storm.max_share: expected a finite number"),
    ({"storm": {"min_nodes": -1}}, "storm.min_nodes: expected 0 to 1000000, got -1"),
    ({"storm": {"min_nodes": 1_000_001}}, "storm.min_nodes: expected 0 to 1000000"),
    ({"storm": {"min_nodes": 2.5}}, "storm.min_nodes: expected an integer"),
    (
        {"election": {"lease_duration_seconds": 3601}},
        "election.lease_duration_seconds: expected seconds from 0 to 3600, got 3601",
    ),
    ({"election": {"renew_deadline_seconds": -1}}, "election.renew_deadline_seconds: expected"),
    (
        {"election": {"retry_period_seconds": float("inf")}},
        "election.retry_period_seconds: expected a finite number",
    ),
    ({"election": {"lease_namespace": "Not_A_NS"}}, "election.lease_namespace: 'Not_A_NS' is not"),
    ({"election": {"lease_name": ""}}, "election.lease_name: '' is not a name"),
    ({"election": {"lease_name": "a" * 254}}, "election.lease_name"),
    ({"election": {"renew_deadline_seconds": 20}}, "leader election needs 0 < retry_period_secon"),
    ({"election": {"retry_period_seconds": 10}}, "leader election needs"),
    ({"election": {"retry_period_seconds": 0}}, "leader election needs"),
    ({"replacement": {"drop_labels": ["*"]}}, "replacement.drop_labels[0]: '*' would drop every"),
    (
        {"replacement": {"drop_labels": ["ok", "a/b/c"]}},
        "replacement.drop_labels[1]: 'a/b/c' is not",
    ),
]


@pytest.mark.parametrize(("layer", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_every_rule_refuses_with_one_line_naming_the_key(
    layer: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(**layer)
    assert message in str(caught.value)
    assert str(caught.value).endswith("(from test)")


@pytest.mark.parametrize(
    "layer",
    [
        {"storm": {"max_share": 1, "min_nodes": 0}},
        {"storm": {"min_nodes": 1_000_000}},
        {"node_grace_seconds": 0},
        {"node_grace_seconds": 604800},
        {"intake": {"listen": "", "tls_cert": "/c", "tls_key": "/k"}},
        {"metrics_addr": "", "namespaces": ["a", "b-c"]},
        {"election": {"retry_period_seconds": 1, "renew_deadline_seconds": 2}},
        # Without election its names and timing are never used, so they are not checked.
        {"election": {"enabled": False, "lease_name": "", "renew_deadline_seconds": 20}},
        {"replacement": {"drop_labels": []}},
        {"replacement": {"drop_labels": ["example.com/*", "team-*", "app", "a.b/c_d.e-f"]}},
    ],
)
def test_values_at_the_limits_are_taken(layer: dict[str, Any]) -> None:
    load(**layer)


def test_the_tls_files_are_read_at_start(tmp_path: Path) -> None:
    cert, key, other = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "other"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    other.write_text("not pem\n")
    cli.check_tls_files(load(intake={"tls_cert": str(cert), "tls_key": str(key)}).intake)
    cli.check_tls_files(RestarterSettings().intake)
    with pytest.raises(UsageError, match=r"^intake\.tls_key .*other: not a PEM file$"):
        cli.check_tls_files(load(intake={"tls_cert": str(cert), "tls_key": str(other)}).intake)
    missing = tmp_path / "missing"
    with pytest.raises(UsageError, match=r"^intake\.tls_cert .*missing: No such file"):
        cli.check_tls_files(load(intake={"tls_cert": str(missing), "tls_key": str(key)}).intake)


@pytest.mark.parametrize(
    ("key", "patterns", "dropped"),
    [
        ("pod-template-hash", ["pod-template-hash"], True),
        ("pod-template-hash-x", ["pod-template-hash"], False),
        ("example.com/a", ["example.com/*"], True),
        ("example.com/", ["example.com/*"], True),
        ("example.org/a", ["example.com/*"], False),
        ("sub.example.com/a", ["example.com/*"], False),
        ("team-a", ["team-*"], True),
        ("team", ["team-*"], False),
        ("app", [], False),
        ("app", ["x", "app"], True),
    ],
)
def test_drop_list_matching(key: str, patterns: list[str], dropped: bool) -> None:
    assert label_dropped(key, patterns) is dropped


@pytest.mark.parametrize(
    ("entry", "valid"),
    [
        ("pod-template-hash", True),
        ("example.com/*", True),
        ("example.com/team-*", True),
        ("app*", True),
        ("statefulset.kubernetes.io/pod-name", True),
        ("*", False),
        ("", False),
        ("/x", False),
        ("Example.com/x", False),
        ("a/b/c", False),
        ("a*b", False),
        ("-x", False),
        ("x" * 64, False),
        ("x" * 63, True),
        ("example.com/**", False),
    ],
)
def test_drop_list_entries_are_label_keys(entry: str, valid: bool) -> None:
    assert (label_pattern_problem(entry) == "") is valid


def test_the_default_drop_list() -> None:
    assert RestarterSettings().replacement.drop_labels == DEFAULT_DROP_LABELS
    assert not [e for e in DEFAULT_DROP_LABELS if label_pattern_problem(e)]
    # The labels policies place pods by (the README's example) are never dropped by default.
    for kept in ("job-name", "replica-type", "replica-index", "app"):
        assert not label_dropped(kept, DEFAULT_DROP_LABELS)


def pod(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": "w-0", "namespace": "ns", "labels": labels},
        "spec": {"containers": [{"name": "c"}]},
    }


def test_a_replacement_keeps_the_labels_but_the_dropped_ones() -> None:
    labels = {
        "job-name": "resnet",
        "replica-index": "0",
        "pod-template-hash": "5d8f",
        "controller-uid": "u",
        "batch.kubernetes.io/controller-uid": "u",
        "batch.kubernetes.io/job-name": "resnet",
        "statefulset.kubernetes.io/pod-name": "w-0",
        "edl.io/restarter-leader": "true",
        "example.com/owner": "x",
    }
    new = replacement_pod(pod(labels), avoid_node=None)
    assert new["metadata"]["labels"] == {
        "job-name": "resnet",
        "replica-index": "0",
        "example.com/owner": "x",
    }
    custom = replacement_pod(pod(labels), avoid_node=None, drop_labels=["example.com/*"])
    assert set(custom["metadata"]["labels"]) == set(labels) - {"example.com/owner"}
    kept = replacement_pod(pod(labels), avoid_node=None, drop_labels=())
    assert kept["metadata"]["labels"] == labels
    assert replacement_pod(pod({}), avoid_node=None)["metadata"]["labels"] == {}
    bare = pod({})
    del bare["metadata"]["labels"]
    assert "labels" not in replacement_pod(bare, avoid_node=None)["metadata"]


def test_the_process_is_built_from_the_settings() -> None:
    """Built only (nothing started, no call made): who it is and what it holds come from the
    settings, the downward-API layer included."""
    layer = {"intake": {"listen": ""}, "replacement": {"drop_labels": ["x/*"]}}
    got = load_restarter_settings(
        environ={"POD_NAME": "restarter-0", "POD_NAMESPACE": "ops"}, overrides=[("t", layer)]
    )
    restarter = Restarter(got, client.ApiClient(), AGENT_USER)
    assert (restarter.identity, restarter.pod) == ("restarter-0", ("ops", "restarter-0"))
    assert restarter.server is None
    assert restarter.elector is not None
    single = Restarter(load(election={"enabled": False}), client.ApiClient(), AGENT_USER)
    assert single.elector is None
    assert single.server is not None
    assert single.pod == ("", "")
    assert single.identity  # hostname-random


def test_the_settings_the_restarter_no_longer_uses_still_load_and_are_named_in_the_log() -> None:
    """The dispatcher and the node grace no longer tick: their ticks' settings load, are
    checked as before, do nothing, and a process built with one says so (one line each)."""
    quiet = load(election={"enabled": False}, intake={"listen": ""})
    assert quiet.controller.obsolete() == []
    given = load(
        election={"enabled": False},
        intake={"listen": ""},
        controller={"tick_seconds": 1.0, "node_grace_tick_seconds": 2.0},
    )
    assert given.controller.obsolete() == ["tick_seconds", "node_grace_tick_seconds"]
    with structlog.testing.capture_logs() as logs:
        Restarter(given, client.ApiClient(), AGENT_USER)
        Restarter(quiet, client.ApiClient(), AGENT_USER)
    ignored = [e["key"] for e in logs if e["event"] == "a setting no longer used is ignored"]
    assert ignored == ["controller.tick_seconds", "controller.node_grace_tick_seconds"]
    with pytest.raises(ConfigError, match="tick_seconds"):
        load(controller={"tick_seconds": -1})


class Breakable:
    """A part that dies while `broken` is set, and serves until stopped once it is not."""

    name = "breakable"

    def __init__(self) -> None:
        self.broken = threading.Event()
        self.broken.set()

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        if self.broken.is_set():
            msg = "broken"
            raise RuntimeError(msg)
        ready()
        stop.wait()


def test_readyz_is_false_while_a_critical_part_is_down_and_parts_are_exported() -> None:
    """Built, not run (no API server): a part of its supervisor that dies keeps /readyz false
    and shows in edl_part_up and edl_part_restarts_total until it runs again."""
    tuning = {"part_backoff_seconds": 0.01, "part_backoff_max_seconds": 0.01}
    settings = load(election={"enabled": False}, intake={"listen": ""}, controller=tuning)
    restarter = Restarter(settings, client.ApiClient(), AGENT_USER)
    part = Breakable()
    restarter.supervisor.add(part)
    restarter.acting.set()  # as if leading, and done listing
    restarter.controller.recovered.set()
    restarter.supervisor.start()
    try:
        wait_until(lambda: restarter.supervisor.statuses()[0].restarts >= 2)
        assert restarter.ready() == (False, "parts not ready: breakable")
        # Started again every 10 ms, the part is up for a moment each time: a scrape may fall
        # into one of those moments.
        exported = wait_for(
            "the part exported as down",
            lambda: generate_latest(restarter.metrics.registry).decode(),
            lambda text: 'edl_part_up{part="breakable"} 0.0' in text,
        )
        assert 'edl_part_restarts_total{part="breakable"}' in exported
        part.broken.clear()
        wait_until(lambda: restarter.ready()[0])
        assert restarter.ready() == (True, f"acting ({restarter.identity})")
        assert (
            'edl_part_up{part="breakable"} 1.0'
            in generate_latest(restarter.metrics.registry).decode()
        )
    finally:
        restarter.stop.set()
        restarter.supervisor.join()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("EDL_") or key in {"POD_NAME", "POD_NAMESPACE", "KUBECONFIG"}:
            monkeypatch.delenv(key)


@pytest.mark.usefixtures("clean_env")
def test_config_prints_the_effective_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    monkeypatch.setenv("EDL_RESTARTER_STORM__MIN_NODES", "9")
    argv = ["restarter", "config", "--no-leader-elect", "--set", "replacement.drop_labels=[a]"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["election"]["enabled"] is False
    assert printed["election"]["lease_namespace"] == "ops"
    assert printed["pod_namespace"] == "ops"
    assert printed["storm"] == {"max_share": 0.1, "min_nodes": 9}
    assert printed["replacement"] == {"drop_labels": ["a"]}
    assert printed["intake"]["listen"] == ":8443"


@pytest.mark.usefixtures("clean_env")
def test_config_refuses_bad_settings_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["restarter", "config", "--storm-max-share", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("edl-agent: error: storm.max_share: expected a share > 0")


def test_config_keys_lists_every_key_with_its_default_and_meaning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["restarter", "config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0] for line in lines}
    assert listed == set(leaves(dataclasses.asdict(RestarterSettings())))
    for key, _default, meaning in cli_keys():
        assert meaning, f"{key} has no docstring"
    assert any(line.startswith("replacement.drop_labels") for line in lines)


def leaves(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            keys += leaves(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_only_the_settings_loader_reads_the_environment() -> None:
    package = Path(cli.__file__).parent
    readers = [
        path.name
        for path in sorted(package.glob("*.py"))
        if path.name != "settings.py"
        and any(word in path.read_text() for word in ("os.environ", "os.getenv"))
    ]
    assert readers == []


def test_every_thread_of_the_restarter_is_a_supervised_part() -> None:
    """Built, not run: what the controller runs while leading, all of it parts (the watches,
    the node-grace ticker, the Event writer, the dispatcher and one part per decider)."""
    settings = load(controller={"workers": 3})
    restarter = Restarter(settings, client.ApiClient(), AGENT_USER)
    names = [part.name for part in restarter.controller.parts()]
    assert names == [
        "watch-pods/*",
        "watch-nodes",
        "node-grace",
        "watch-policies/*",
        "events",
        "dispatcher",
        "decider-0",
        "decider-1",
        "decider-2",
    ]
    assert restarter.elector is not None
    assert restarter.elector.name == "leader-election"
