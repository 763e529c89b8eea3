"""Settings layering and validation: every bad input is one line naming the key and its source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edl_agent.config import Settings, load_settings
from edl_agent.settings_loader import (
    NON_SETTING_ENV,
    ConfigError,
    describe_settings,
    env_layer,
    set_path,
)
from edl_agent.settings_loader import assignment as _assignment


def assign(text: str) -> tuple[list[str], object]:
    return _assignment(text, Settings)


def test_defaults() -> None:
    settings = load_settings()
    assert settings.host_root == "/"
    assert settings.nvidia.mig_strategy == "none"
    assert settings.nvidia.resource_name == "nvidia.com/gpu"
    assert settings.sharing == ()


def test_layers_file_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "edl.yaml"
    config.write_text("log_level: warning\nnvidia:\n  mig_strategy: single\nnode_name: from-file\n")
    settings = load_settings(
        file=str(config),
        environ={"EDL_NVIDIA__MIG_STRATEGY": "mixed", "EDL_NODE_NAME": "from-env"},
        overrides={"node_name": "from-flag"},
        defaults={"log_level": "debug", "hygon": {"enabled": False}},
    )
    assert settings.log_level == "warning"  # file beats profile defaults
    assert settings.nvidia.mig_strategy == "mixed"  # env beats file
    assert settings.node_name == "from-flag"  # flags beat env
    assert settings.hygon.enabled is False  # profile defaults still apply below everything


def test_env_values_are_typed() -> None:
    environ = {"EDL_KUNLUNXIN__ENABLED": "false", "EDL_NODE_NAME": "007", "PATH": "/bin"}
    layer = env_layer(environ, Settings)
    assert layer == {"kunlunxin": {"enabled": False}, "node_name": "007"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overrides": {"colour": "red"}}, "colour: unknown key (from command line"),
        ({"environ": {"EDL_NVIDIA__MIG_STRATEGY": "all"}}, "nvidia.mig_strategy: expected one of"),
        ({"environ": {"EDL_NVIDIA__ENABLED": "maybe"}}, "nvidia.enabled: expected true or false"),
        ({"overrides": {"nvidia": {"resource_name": "gpu"}}}, "nvidia.resource_name: 'gpu' is not"),
        (
            {"overrides": {"sharing": [{"resource": "nvidia.com/gpu", "core_unit_percent": 3}]}},
            "sharing[0].core_unit_percent: must divide 100",
        ),
        (
            {"overrides": {"sharing": [{"resource": "nvidia.com/gpu"}]}},
            "sharing[0]: set at least one of",
        ),
        ({"overrides": {"nvidia": {"typo": 1}}}, "nvidia.typo: unknown key"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**kwargs)  # type: ignore[arg-type]
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_bad_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: No such file"):
        load_settings(file=str(missing))
    broken = tmp_path / "broken.yaml"
    broken.write_text("nvidia: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken.yaml line 2"):
        load_settings(file=str(broken))
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_settings(file=str(listed))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("log_level: loud\n")
    with pytest.raises(ConfigError, match=r"log_level: .* \(from .*wrong.yaml\)"):
        load_settings(file=str(wrong))


def test_the_source_named_is_the_layer_that_set_the_key(tmp_path: Path) -> None:
    """Not the last layer that set another key of the same group."""
    config = tmp_path / "edl.yaml"
    config.write_text("nvidia:\n  mig_strategy: all\n")
    environ = {"EDL_NVIDIA__ENABLED": "true"}
    with pytest.raises(ConfigError, match=r"nvidia\.mig_strategy: .* \(from .*edl\.yaml\)$"):
        load_settings(file=str(config), environ=environ)
    config.write_text("sharing:\n  - {resource: a.com/g, replicas: 2000}\n")
    with pytest.raises(ConfigError, match=r"sharing\[0\]\.replicas: .* \(from .*edl\.yaml\)$"):
        load_settings(file=str(config), environ=environ)


def test_every_setting_is_described() -> None:
    rows = describe_settings(Settings)
    keys = {key for key, _, _ in rows}
    assert {"host_root", "nvidia.mig_strategy", "ascend.vnpu_templates", "sharing"} <= keys
    documented = {key: meaning for key, _, meaning in rows}
    assert "NVML" in documented["nvidia.enabled"]
    undocumented = [key for key, meaning in documented.items() if not meaning]
    assert undocumented == []


FLOAT_KEYS = [
    ("health", "quiet_seconds"),
    ("health", "poll_seconds"),
    ("health", "nvml_retry_seconds"),
    ("node", "resync_seconds"),
    ("node", "events_per_minute"),
    ("node", "event_dedupe_seconds"),
    ("plugin", "health_poll_seconds"),
    ("plugin", "rediscover_seconds"),
]


@pytest.mark.parametrize(("section", "key"), FLOAT_KEYS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 10**400, "1e400"])
def test_no_number_setting_takes_nan_or_infinity(section: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: expected a finite number"):
        load_settings(overrides={section: {key: value}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"node": {"event_burst": 2**63}}, "node.event_burst: an integer of about 19 digits"),
        ({"node": {"event_burst": 10**4000}}, "an integer of about 4000 digits is out of range"),
        ({"node": {"event_burst": 10001}}, "node.event_burst: must be between 1 and 10000"),
        ({"health": {"quiet_seconds": -1}}, "health.quiet_seconds: must be positive"),
        ({"node": {"events_per_minute": 0}}, "node.events_per_minute: must be positive"),
        ({"node": {"event_dedupe_seconds": -1}}, "node.event_dedupe_seconds: must be between"),
        ({"sharing": [{"resource": "a.com/g", "replicas": 1025}]}, "sharing[0].replicas: must be"),
        ({"sharing": [{"resource": "a.com/g", "memory_unit_mib": 63}]}, "at least 64"),
        ({"node_name": "Node_1"}, "node_name: 'Node_1' is not a Kubernetes node name"),
        ({"faults": {"restarter_address": "edl-restarter:"}}, "faults.restarter_address: "),
    ],
)
def test_numbers_and_names_have_bounds(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(overrides=overrides)
    assert message in str(caught.value)


def test_the_bounds_themselves_are_allowed() -> None:
    settings = load_settings(
        overrides={
            "sharing": [{"resource": "a.com/g", "replicas": 1024, "memory_unit_mib": 64}],
            "node": {"event_burst": 10000, "event_dedupe_seconds": 0},
            "health": {"quiet_seconds": 30 * 86400},
        }
    )
    assert settings.sharing[0].replicas == 1024


@pytest.mark.parametrize(
    ("environ", "file_text", "assignment"),
    [
        ({"EDL_NODE__LABELS": "off"}, None, None),
        ({}, "node:\n  labels: off\n", None),
        ({}, None, "node.labels=off"),
        ({}, None, "node.labels=OFF"),
    ],
)
def test_labels_off_means_off_from_every_source(
    tmp_path: Path, environ: dict[str, str], file_text: str | None, assignment: str | None
) -> None:
    """YAML 1.1 reads the documented `off` as false; it still means the word."""
    file = None
    if file_text is not None:
        (tmp_path / "edl.yaml").write_text(file_text)
        file = str(tmp_path / "edl.yaml")
    overrides: dict[str, object] = {}
    if assignment is not None:
        path, value = assign(assignment)
        set_path(overrides, path, value)
    settings = load_settings(file=file, environ=environ, overrides=overrides)
    assert settings.node.labels == "off"


def test_a_number_yaml_1_1_reads_as_a_string_is_still_a_number() -> None:
    assert load_settings(environ={"EDL_HEALTH__QUIET_SECONDS": "1e3"}).health.quiet_seconds == 1e3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("log_level: debug\n".encode("utf-16"), "UTF-16 text; save it as UTF-8"),
        ("node_name: caf\xe9\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 14)"),
        (b"node:\n  event_burst: " + b"9" * 5000, "a number of more than 4300 digits"),
        (b"sharing: " + b"[" * 3000 + b"]" * 3000, "nested too deeply"),
        (b"health: {quiet_seconds: 2024-13-01}", "month must be in 1..12"),
        (b"# x\n" * 300_000, "larger than 1024 KiB"),
    ],
)
def test_unreadable_files_are_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "edl.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_settings(file=str(path))
    assert str(caught.value).startswith(f"config file {path}")
    assert message in str(caught.value)


def test_a_utf8_byte_order_mark_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "edl.yaml"
    path.write_bytes(b"\xef\xbb\xbflog_level: debug\n")
    assert load_settings(file=str(path)).log_level == "debug"


def test_the_fault_senders_tunables_are_settings() -> None:
    from edl_agent.faults.sender import SenderSettings

    settings = load_settings(
        environ={"EDL_FAULTS__CALL_TIMEOUT_SECONDS": "3"},
        overrides={"faults": {"retry_later_seconds": 0.25, "backoff_max_seconds": 5}},
    )
    sender = SenderSettings.from_settings(settings.faults)
    got = (sender.call_timeout, sender.retry_later, sender.backoff_max, sender.backoff_initial)
    assert got == (3.0, 0.25, 5.0, 0.5)
    assert sender.batch_size == 100
    with pytest.raises(ConfigError, match=r"faults\.backoff_max_seconds: must be at least"):
        load_settings(
            overrides={"faults": {"backoff_initial_seconds": 2, "backoff_max_seconds": 1}}
        )


def test_timeouts_are_settings() -> None:
    settings = load_settings(
        environ={
            "EDL_HEALTH__TOOL_TIMEOUT_SECONDS": "0.5",
            "EDL_NODE__API_READ_TIMEOUT_SECONDS": "2",
        }
    )
    assert settings.health.tool_timeout_seconds == 0.5
    assert (settings.node.api_connect_timeout_seconds, settings.node.api_read_timeout_seconds) == (
        5.0,
        2.0,
    )
    with pytest.raises(ConfigError, match=r"health\.tool_timeout_seconds: must be positive"):
        load_settings(overrides={"health": {"tool_timeout_seconds": 0}})


def test_every_edl_variable_our_scripts_read_is_a_setting_or_known_not_to_be_one() -> None:
    """The agent refuses an `EDL_*` variable it does not know: one that a test or a script reads
    for itself (a cache directory, a seed) must be on the list the agent passes over, or setting
    it for the tests stops every agent they start."""
    repo = Path(__file__).resolve().parents[1]
    read = re.compile(r"""environ(?:\.get\(|\[)["'](EDL_[A-Z0-9_]+)["']""")
    names = {
        name
        for folder in ("tests", "scripts", "bench", "edl_agent")
        for path in (repo / folder).rglob("*")
        if path.is_file() and (path.suffix == ".py" or path.parent.name == "scripts")
        for name in read.findall(path.read_text(errors="replace"))
    }
    assert "EDL_K8S_BIN_DIR" in names  # the scan finds what it is for
    in_containers = {"EDL_CLAIM_UID"}  # given to containers and read in a test's pod
    for name in sorted(names - NON_SETTING_ENV - in_containers):
        load_settings(environ={name: "/x"})  # a setting: read, not refused


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ({"nvidia": 1}, r"'nvidia' is not one of ascend, hygon, kunlunxin"),
        ({"kunlunxin": 0}, r"vendor_poll_seconds\.kunlunxin: must be positive"),
        ({"hygon": 7200}, r"vendor_poll_seconds\.hygon: must be positive and at most 3600"),
    ],
)
def test_a_vendors_own_poll_period_is_checked(value: dict[str, float], refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal):
        load_settings(overrides={"health": {"vendor_poll_seconds": value}})
