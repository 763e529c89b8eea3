"""Settings layering and validation: every bad input is one line naming the key and its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_agent.config import ConfigError, describe_settings, env_layer, load_settings


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
    layer = env_layer({"EDL_KUNLUNXIN__ENABLED": "false", "EDL_NODE_NAME": "007", "PATH": "/bin"})
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


def test_every_setting_is_described() -> None:
    rows = describe_settings()
    keys = {key for key, _, _ in rows}
    assert {"host_root", "nvidia.mig_strategy", "ascend.vnpu_templates", "sharing"} <= keys
    documented = {key: meaning for key, _, meaning in rows}
    assert "NVML" in documented["nvidia.enabled"]
    undocumented = [key for key, meaning in documented.items() if not meaning]
    assert undocumented == []
