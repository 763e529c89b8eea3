"""scripts/k8s-binaries builds what it is asked for: every binary without names (as
scripts/test runs it), only the named ones otherwise. Builders are stood in for: nothing is
compiled here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import k8sbinaries


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """An empty bin dir, and builders that only record their name and write a stub."""
    monkeypatch.setenv("EDL_K8S_BIN_DIR", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    names: list[str] = []

    def builder(name: str) -> Path:
        names.append(name)
        path = tmp_path / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        k8sbinaries._stamp(tmp_path, name).write_text(k8sbinaries.PINS[name] + "\n")
        return path

    fakes = {name: (lambda name=name: builder(name)) for name in k8sbinaries.BINARIES}
    monkeypatch.setattr(k8sbinaries, "BUILDERS", fakes)
    monkeypatch.setattr(k8sbinaries, "copy_kwok_stages", lambda: names.append("stages"))
    return names


def test_without_names_everything_is_built_helm_too(built: list[str]) -> None:
    assert k8sbinaries.main([]) == 0

    assert built == [*k8sbinaries.BINARIES, "stages"]
    assert k8sbinaries.HELM in built


def test_named_binaries_alone_are_built(built: list[str]) -> None:
    assert k8sbinaries.main(["helm"]) == 0

    assert built == ["helm"]
    assert k8sbinaries.missing(("helm",)) == []
    assert "kubectl" in k8sbinaries.missing()


def test_check_names_only_what_is_asked_for(
    built: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert k8sbinaries.main(["--check", "helm", "kubectl"]) == 1
    assert "missing in" in capsys.readouterr().err

    assert k8sbinaries.missing(("helm", "kubectl")) == ["helm", "kubectl"]
    assert k8sbinaries.missing(k8sbinaries.CONTROL_PLANE) == [
        *k8sbinaries.CONTROL_PLANE,
        k8sbinaries.STAGES_FILE,
    ]
    assert built == []


def test_an_unknown_name_is_refused(built: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        k8sbinaries.main(["helmet"])

    assert exited.value.code == 2
    assert built == []
