"""The kubeconfig check that runs before the agent registers with kubelet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edl_agent.kube import KubeConfigError, check_credentials
from edl_agent.kubeconfig_check import kubeconfig_problem


def config(
    *,
    current: str | None = "ctx",
    contexts: Any = None,
    clusters: Any = None,
) -> dict[str, Any]:
    document: dict[str, Any] = {"apiVersion": "v1", "kind": "Config"}
    if current is not None:
        document["current-context"] = current
    document["contexts"] = (
        [{"name": "ctx", "context": {"cluster": "c1", "user": "u"}}]
        if contexts is None
        else contexts
    )
    document["clusters"] = (
        [{"name": "c1", "cluster": {"server": "https://127.0.0.1:6443"}}]
        if clusters is None
        else clusters
    )
    return document


@pytest.mark.parametrize(
    ("documents", "problem"),
    [
        pytest.param([config()], None, id="usable"),
        pytest.param([config(current=None)], "no current-context", id="no-current"),
        pytest.param(
            [config(current="other")], "current-context 'other' names no context", id="no-context"
        ),
        pytest.param(
            [config(contexts=[{"name": "ctx", "context": {"user": "u"}}])],
            "context 'ctx' names no cluster",
            id="context-without-cluster",
        ),
        pytest.param(
            [config(clusters=[])],
            "context 'ctx': cluster 'c1' is not defined",
            id="cluster-missing",
        ),
        pytest.param(
            [config(clusters=[{"name": "c1", "cluster": {}}])],
            "cluster 'c1' has no server",
            id="no-server",
        ),
        pytest.param(["just text"], "not a kubeconfig (a YAML mapping)", id="not-a-mapping"),
        pytest.param([None], "no current-context", id="empty-file"),
        pytest.param(
            [{"apiVersion": "v1", "kind": "Config"}], "no current-context", id="header-only"
        ),
        # $KUBECONFIG merging: the current context of one file, the cluster of another.
        pytest.param(
            [config(clusters=[]), {"clusters": config()["clusters"]}], None, id="merged-files"
        ),
        # The first file to set current-context wins, as for kubectl.
        pytest.param(
            [config(current="first", contexts=[]), config()],
            "current-context 'first' names no context",
            id="first-current-context-wins",
        ),
        # The first definition of a name wins.
        pytest.param(
            [config(clusters=[{"name": "c1", "cluster": {}}]), config()],
            "cluster 'c1' has no server",
            id="first-definition-wins",
        ),
    ],
)
def test_kubeconfig_problem(documents: list[object], problem: str | None) -> None:
    assert kubeconfig_problem(documents) == problem


def test_check_credentials_reads_the_files_it_would_load(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: ctx\n"
        "contexts: [{name: ctx, context: {cluster: c1}}]\n"
        "clusters: [{name: c1, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
    )
    check_credentials(str(good))  # no error
    bad_yaml = tmp_path / "bad"
    bad_yaml.write_text("clusters: [\n")
    with pytest.raises(KubeConfigError, match=rf"^node.kubeconfig: cannot use {bad_yaml}: "):
        check_credentials(str(bad_yaml))
    missing = tmp_path / "missing"
    env = {"KUBECONFIG": f"{missing}:{good}"}
    check_credentials("", environ=env)  # a missing file in the list is skipped, as by kubectl
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(KubeConfigError, match=r"^\$KUBECONFIG: cannot use .*: no current-context$"):
        check_credentials("", environ={"KUBECONFIG": f"{missing}:{empty}"})
    check_credentials("", environ=env, ambient=False)  # not ambient: $KUBECONFIG is not read
