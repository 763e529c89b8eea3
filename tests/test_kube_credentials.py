"""Where Kubernetes credentials come from: the explicit kubeconfig, then $KUBECONFIG, then the
pod's service account; only the explicit one for a simulated node. The environment is passed in
explicitly; the kubeconfig files are real and point at a server that is not there (nothing is
dialled to build a client)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edl_agent.cli.command import build_parser
from edl_agent.cli.settings import settings_from_args
from edl_agent.kube import KubeConfigError, api_client, kubeconfig_to_use

IN_CLUSTER = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    return path


@pytest.fixture
def service_account(tmp_path: Path) -> tuple[str, str]:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("secret-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(token), str(ca)


def host_of(kubeconfig: str, environ: dict[str, str], sa: tuple[str, str], **kw: bool) -> str:
    api = api_client(kubeconfig, environ=environ, token_file=sa[0], ca_file=sa[1], **kw)
    if api is None:
        return "none"
    host = str(api.configuration.host)
    api.close()
    return host


@pytest.mark.parametrize(
    ("explicit", "env_kubeconfig", "in_cluster", "ambient", "expected"),
    [
        (True, True, True, True, "https://explicit:1"),
        (False, True, True, True, "https://from-env:1"),
        (False, False, True, True, "https://10.0.0.1:443"),
        (False, False, False, True, "none"),
        # A simulated node: only what it is given.
        (True, True, True, False, "https://explicit:1"),
        (False, True, True, False, "none"),
        (False, False, True, False, "none"),
    ],
)
def test_the_order_of_credentials(
    tmp_path: Path,
    service_account: tuple[str, str],
    *,
    explicit: bool,
    env_kubeconfig: bool,
    in_cluster: bool,
    ambient: bool,
    expected: str,
) -> None:
    given = write_kubeconfig(tmp_path / "given", "https://explicit:1")
    from_env = write_kubeconfig(tmp_path / "env", "https://from-env:1")
    environ = {**(IN_CLUSTER if in_cluster else {})}
    if env_kubeconfig:
        environ["KUBECONFIG"] = str(from_env)
    kubeconfig = str(given) if explicit else ""
    assert host_of(kubeconfig, environ, service_account, ambient=ambient) == expected


def test_kubeconfig_to_use_is_pure() -> None:
    env = {"KUBECONFIG": "/a:/b"}
    assert kubeconfig_to_use("/x", name="--kubeconfig", environ=env, ambient=True) == (
        "/x",
        "--kubeconfig",
    )
    assert kubeconfig_to_use("", name="n", environ=env, ambient=True) == ("/a:/b", "$KUBECONFIG")
    assert kubeconfig_to_use("", name="n", environ=env, ambient=False) is None
    for unset in ({}, {"KUBECONFIG": ""}, {"KUBECONFIG": ":"}):
        assert kubeconfig_to_use("", name="n", environ=unset, ambient=True) is None


def test_kubeconfig_lists_skip_missing_files_like_kubectl(tmp_path: Path) -> None:
    real = write_kubeconfig(tmp_path / "real", "https://listed:1")
    environ = {"KUBECONFIG": f"{tmp_path / 'missing'}:{real}"}
    api = api_client("", environ=environ)
    assert api is not None
    assert api.configuration.host == "https://listed:1"
    api.close()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing", None, "--kubeconfig: {path} does not exist"),
        ("directory", "DIR", "--kubeconfig: {path} is not a file"),
        ("empty", "", "--kubeconfig: cannot use {path}"),
        ("no-context", "apiVersion: v1\nkind: Config\n", "--kubeconfig: cannot use {path}"),
        ("garbage", "clusters: [oops\n", "--kubeconfig: cannot use {path}"),
        ("a-list", "- 1\n- 2\n", "--kubeconfig: cannot use {path}"),
        ("deep", "[" * 5000 + "]" * 5000, "--kubeconfig: cannot use {path}"),
        ("huge-number", "x: " + "9" * 5000, "--kubeconfig: cannot use {path}"),
    ],
)
def test_a_named_kubeconfig_that_cannot_be_used_is_an_error(
    tmp_path: Path, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(KubeConfigError) as caught:
        api_client(str(path), name="--kubeconfig", environ=IN_CLUSTER)
    assert str(caught.value).startswith(message.format(path=path))
    assert "\n" not in str(caught.value)


def test_a_missing_env_kubeconfig_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(KubeConfigError, match=r"^\$KUBECONFIG: .*nope does not exist"):
        api_client("", environ={**IN_CLUSTER, "KUBECONFIG": str(missing)})
    both = f"{missing}:{tmp_path / 'other'}"
    with pytest.raises(KubeConfigError, match=r"^\$KUBECONFIG: none of .* exists"):
        api_client("", environ={"KUBECONFIG": both})
    # ... but not read at all for a simulated node.
    assert api_client("", environ={"KUBECONFIG": str(missing)}, ambient=False) is None


def test_run_kubeconfig_flag_is_the_node_kubeconfig_setting() -> None:
    args = build_parser().parse_args(["run", "--kubeconfig", "/etc/edl/kubeconfig"])
    assert settings_from_args(args, environ={}).node.kubeconfig == "/etc/edl/kubeconfig"
    args = build_parser().parse_args(["run"])
    settings = settings_from_args(args, environ={"EDL_NODE__KUBECONFIG": "/from/env"})
    assert settings.node.kubeconfig == "/from/env"


def test_run_help_states_the_order_and_the_simulate_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kubeconfig FILE" in text
    assert "Without it: $KUBECONFIG, else the pod's service account" in text
    assert "With --simulate only this flag or node.kubeconfig counts" in text


def test_restarter_help_states_the_order(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["restarter", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kubeconfig FILE kubeconfig file (default: $KUBECONFIG, else the pod's" in text


def edl_agent(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EDL_", "KUBE"))}
    if "EDL_CACHE_DIR" in os.environ:
        base["EDL_CACHE_DIR"] = os.environ["EDL_CACHE_DIR"]
    return subprocess.run(
        [str(Path(sys.executable).with_name("edl-agent")), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, **env},
    )


def test_a_simulated_node_ignores_kubeconfig_env_but_not_the_flag(tmp_path: Path) -> None:
    """The command line end to end: with --simulate a broken $KUBECONFIG is not even read (the
    run gets as far as its metrics port, held busy here), while --kubeconfig is."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        env = {"KUBECONFIG": str(tmp_path / "missing")}
        ignored = edl_agent(
            "run", "--simulate", "dgx-h100", "--log-format", "json", "--metrics-addr", address,
            env=env,
        )  # fmt: skip
        explicit = edl_agent(
            "run", "--simulate", "dgx-h100", "--log-level", "error",
            "--kubeconfig", str(tmp_path / "given"), env=env,
        )  # fmt: skip
        real_host = edl_agent(
            "run", "--host-root", str(tmp_path), "--kubelet-dir", str(tmp_path / "kubelet"),
            env=env,
        )  # fmt: skip
    assert ignored.returncode == 2
    assert "$KUBECONFIG ignored for a simulated node" in ignored.stderr
    assert ignored.stderr.splitlines()[-1] == (
        f"edl-agent: error: metrics_addr {address}: Address already in use"
    )
    assert explicit.returncode == 2
    assert (
        explicit.stderr == f"edl-agent: error: node.kubeconfig: {tmp_path}/given does not exist\n"
    )
    assert real_host.returncode == 2
    assert real_host.stderr == (
        f"edl-agent: error: $KUBECONFIG: {tmp_path}/missing does not exist\n"
    )


def test_connect_uses_the_thin_client_unless_only_the_kubernetes_package_can(
    tmp_path: Path,
) -> None:
    """The agent's client: our own (no kubernetes package) for what it serves, the package's for
    what only it serves (here a proxy from the environment), none without credentials."""
    from edl_agent.kube import KubeApi
    from edl_agent.kube_rest import RestKubeApi, connect

    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", "https://explicit:1"))
    thin = connect(kubeconfig, environ={})
    assert isinstance(thin, RestKubeApi)
    thin.close()
    proxied = connect(kubeconfig, environ={"https_proxy": "http://127.0.0.1:3128"})
    assert isinstance(proxied, KubeApi)
    proxied.close()
    from_env = connect("", environ={"KUBECONFIG": kubeconfig})
    assert isinstance(from_env, RestKubeApi)
    from_env.close()
    assert connect("", environ={"KUBECONFIG": kubeconfig}, ambient=False) is None
    assert connect("", environ={}) is None
    with pytest.raises(KubeConfigError, match=r"^node.kubeconfig: .* does not exist$"):
        connect(str(tmp_path / "missing"), environ={})
