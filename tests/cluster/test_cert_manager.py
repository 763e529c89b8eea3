"""deploy/cert-manager: deploy/daemonset with the fault intake's TLS issued by cert-manager.

- It is deploy/daemonset plus a CA chain and two Certificates, and one change: the agents read
  the CA from the Secret edl-restarter-trust instead of the ConfigMap edl-restarter-ca.
- The certificates fit the workloads: the intake's names the host the agents call and lands in
  the Secret the restarter serves; the one the agents mount ca.crt from names no host.
- With cert-manager's CRDs (v1.21.2, from its Go module; kube_tools.py) installed for real, the
  kustomization passes a server-side dry run, and their schemas refuse a broken Certificate.
- The certificate the agents take the CA from cannot pass for the intake: made as cert-manager
  makes these specs (with openssl: cert-manager's controller is not in the module the Go module
  proxy serves), the agents' TLS accepts the intake's certificate and refuses that one.
- The chart's intakeTLS.certManager renders the same objects.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from kube_tools import Kubectl
from manifests import (
    CERT_MANAGER,
    DEPLOY,
    NAMESPACE,
    WITH_PROMETHEUS_OPERATOR,
    Doc,
    Key,
    as_kustomized,
    by_key,
    cel_spaced,
    dry_run_warnings,
    find,
    kubectl_name,
    kustomized,
    pod_spec,
    rendered,
)

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.intake_server import IntakeServer
from edl_agent.restarter.core.callers import Identity

CERT_MANAGER_OBJECTS = {
    ("Issuer", NAMESPACE, "edl-restarter-selfsigned"),
    ("Certificate", NAMESPACE, "edl-restarter-ca"),
    ("Issuer", NAMESPACE, "edl-restarter-ca"),
    ("Certificate", NAMESPACE, "edl-restarter-tls"),
    ("Certificate", NAMESPACE, "edl-restarter-trust"),
}
DAEMONSET: Key = ("DaemonSet", NAMESPACE, "edl-agent")
CA_FROM_SECRET = {
    "name": "restarter-ca",
    "secret": {
        "secretName": "edl-restarter-trust",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    },
}


def ca_volume(daemonset: Doc) -> Doc:
    volumes = daemonset["spec"]["template"]["spec"]["volumes"]
    (volume,) = (v for v in volumes if v["name"] == "restarter-ca")
    return dict(volume)


def with_volume(daemonset: Doc, volume: Doc) -> Doc:
    changed = copy.deepcopy(daemonset)
    volumes = changed["spec"]["template"]["spec"]["volumes"]
    changed["spec"]["template"]["spec"]["volumes"] = sorted(
        [volume, *(v for v in volumes if v["name"] != volume["name"])], key=lambda v: v["name"]
    )
    return changed


def test_it_is_deploy_daemonset_with_the_ca_from_a_secret() -> None:
    base = by_key(kustomized(DEPLOY))
    tls = by_key(kustomized(CERT_MANAGER))

    assert tls.keys() - base.keys() == CERT_MANAGER_OBJECTS
    assert base.keys() <= tls.keys()
    assert [k for k in base if k != DAEMONSET and tls[k] != base[k]] == []
    assert ca_volume(base[DAEMONSET])["configMap"]["name"] == "edl-restarter-ca"
    assert ca_volume(tls[DAEMONSET]) == CA_FROM_SECRET
    assert with_volume(tls[DAEMONSET], CA_FROM_SECRET) == with_volume(
        base[DAEMONSET], CA_FROM_SECRET
    )


def test_the_certificates_fit_the_workloads() -> None:
    docs = kustomized(CERT_MANAGER)
    (agent,) = pod_spec(docs, "DaemonSet", "edl-agent")["containers"]
    restarter_pod = pod_spec(docs, "Deployment", "edl-restarter")
    (tls_volume,) = (v for v in restarter_pod["volumes"] if v["name"] == "tls")
    address = next(a for a in agent["args"] if a.startswith("--restarter-address="))
    host = address.split("=", 1)[1].rsplit(":", 1)[0]
    certificates = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}

    # The intake's: for the host the agents call, in the Secret the restarter serves.
    intake = certificates["edl-restarter-tls"]
    assert intake["dnsNames"] == [host] == ["edl-restarter.edl-system.svc"]
    assert intake["secretName"] == tls_volume["secret"]["secretName"]
    assert "server auth" in intake["usages"]
    # The CA's carrier: mounted by the agents (ca.crt alone), good for nothing else.
    trust = certificates["edl-restarter-trust"]
    assert (
        trust["secretName"]
        == ca_volume(find(docs, "DaemonSet", "edl-agent"))["secret"]["secretName"]
    )
    assert not {"dnsNames", "ipAddresses", "uris", "emailAddresses"} & trust.keys()
    assert trust["commonName"] != host
    assert "server auth" not in trust["usages"]
    assert trust.get("isCA") is not True
    # Both from the CA Issuer, whose key is the CA certificate's, kept across renewals; the CA
    # from the self-signed Issuer.
    ca = certificates["edl-restarter-ca"]
    ca_issuer = {"kind": "Issuer", "name": "edl-restarter-ca"}
    assert intake["issuerRef"] == trust["issuerRef"] == ca_issuer
    assert issuers["edl-restarter-ca"] == {"ca": {"secretName": ca["secretName"]}}
    assert ca["isCA"] is True
    assert ca["privateKey"]["rotationPolicy"] == "Never"
    assert issuers[ca["issuerRef"]["name"]] == {"selfSigned": {}}
    # No Secret a workload mounts holds a CA's key.
    assert ca["secretName"] not in {tls_volume["secret"]["secretName"], trust["secretName"]}


# cert-manager's usages as X.509 extensions (it marks key usage critical).
KEY_USAGES = {"digital signature": "digitalSignature", "key encipherment": "keyEncipherment"}
EXTENDED_KEY_USAGES = {"server auth": "serverAuth", "client auth": "clientAuth"}


def openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    assert binary, "the openssl CLI makes the test certificates (scripts/test-deps installs it)"
    subprocess.run([binary, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def issue(spec: Doc, directory: Path) -> tuple[Path, Path]:
    """A certificate and key as cert-manager's CA Issuer makes them from ``spec``, signed by
    ca.crt/ca.key in ``directory``."""
    name = spec["secretName"]
    usages = spec["usages"]
    extensions = [
        "keyUsage=critical," + ",".join(KEY_USAGES[u] for u in usages if u in KEY_USAGES),
        "basicConstraints=critical,CA:FALSE",
    ]
    if any(u in EXTENDED_KEY_USAGES for u in usages):
        eku = ",".join(EXTENDED_KEY_USAGES[u] for u in usages if u in EXTENDED_KEY_USAGES)
        extensions.append(f"extendedKeyUsage={eku}")
    if spec.get("dnsNames"):
        extensions.append("subjectAltName=" + ",".join(f"DNS:{n}" for n in spec["dnsNames"]))
    (directory / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={spec['commonName']}",
        cwd=directory,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=directory,
    )  # fmt: skip
    return directory / f"{name}.crt", directory / f"{name}.key"


@pytest.fixture(scope="module")
def issued(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """The CA, and the certificates of deploy/cert-manager signed by it, by Certificate name."""
    directory = tmp_path_factory.mktemp("issued")
    docs = kustomized(CERT_MANAGER)
    ca = find(docs, "Certificate", "edl-restarter-ca")["spec"]
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", f"/CN={ca['commonName']}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=directory,
    )  # fmt: skip
    certificates = {"edl-restarter-ca": (directory / "ca.crt", directory / "ca.key")}
    for name in ("edl-restarter-tls", "edl-restarter-trust"):
        certificates[name] = issue(find(docs, "Certificate", name)["spec"], directory)
    return certificates


@pytest.fixture
def intake_with() -> Iterator[Callable[[Path, Path], int]]:
    """``intake_with(cert, key)``: the restarter's intake serving that pair on 127.0.0.1; its
    port. Every call is refused as unauthenticated (no token), after the TLS handshake."""
    servers: list[IntakeServer] = []

    def start(cert: Path, key: Path) -> int:
        intake = FaultIntake(
            review=lambda _token: Identity(authenticated=False, error="test"),
            agent_user="system:serviceaccount:edl-system:edl-agent",
            on_fault=lambda _fault: None,
        )
        server = IntakeServer(intake, listen="127.0.0.1:0", tls_cert=cert, tls_key=key)
        server.start()
        servers.append(server)
        return server.port

    yield start
    for server in servers:
        server.stop(0)


def test_the_agents_trust_the_intake_and_not_the_certificate_carrying_the_ca(
    issued: dict[str, tuple[Path, Path]], intake_with: Callable[[Path, Path], int]
) -> None:
    docs = kustomized(CERT_MANAGER)
    (agent,) = pod_spec(docs, "DaemonSet", "edl-agent")["containers"]
    address = next(a for a in agent["args"] if a.startswith("--restarter-address="))
    host = address.split("=", 1)[1].rsplit(":", 1)[0]
    ca = issued["edl-restarter-ca"][0].read_bytes()  # the trust Secret's ca.crt

    def call(port: int) -> grpc.StatusCode:
        # As the agent connects (faults/sender.py): this CA, the intake's host name.
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        options = [("grpc.ssl_target_name_override", host)]
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
            stub = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
            try:
                stub.Report(fault_pb2.ReportRequest(), timeout=10)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    # The intake's certificate: the handshake passes, the call reaches the intake.
    assert call(intake_with(*issued["edl-restarter-tls"])) == grpc.StatusCode.UNAUTHENTICATED
    # The one every agent's node can read: the handshake fails, nothing reaches the intake.
    assert call(intake_with(*issued["edl-restarter-trust"])) == grpc.StatusCode.UNAVAILABLE


def test_the_kustomization_passes_a_server_side_dry_run(
    kubectl: Kubectl, monitoring_crds: None, cert_manager_crds: None
) -> None:
    kubectl("apply", "-f", str(DEPLOY / "namespace.yaml"))

    result = kubectl("apply", "--dry-run=server", "-k", str(CERT_MANAGER))

    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert all(line.endswith("(server dry run)") for line in lines), result.stdout
    assert {line.split()[0] for line in lines} == {
        kubectl_name(doc) for doc in kustomized(CERT_MANAGER)
    }
    assert not dry_run_warnings(result.stderr), result.stderr


def test_cert_managers_schemas_refuse_a_broken_certificate(
    kubectl: Kubectl, cert_manager_crds: None, tmp_path: Path
) -> None:
    kubectl("apply", "-f", str(DEPLOY / "namespace.yaml"))
    intake = find(kustomized(CERT_MANAGER), "Certificate", "edl-restarter-tls")
    broken: dict[str, Doc] = {
        "no issuer": copy.deepcopy(intake),
        "an unknown usage": copy.deepcopy(intake),
        "no Secret": copy.deepcopy(intake),
    }
    del broken["no issuer"]["spec"]["issuerRef"]
    broken["an unknown usage"]["spec"]["usages"] = ["server-auth"]
    del broken["no Secret"]["spec"]["secretName"]

    def dry_run(doc: Doc) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "certificate.yaml"
        path.write_text(yaml.safe_dump(doc))
        return kubectl("apply", "--dry-run=server", "-f", str(path), check=False)

    assert dry_run(intake).returncode == 0
    refusals = {what: dry_run(doc) for what, doc in broken.items()}
    assert {what: r.returncode for what, r in refusals.items()} == dict.fromkeys(broken, 1)
    assert "spec.issuerRef: Required value" in refusals["no issuer"].stderr
    assert 'Unsupported value: "server-auth"' in refusals["an unknown usage"].stderr
    assert "spec.secretName: Required value" in refusals["no Secret"].stderr


def test_the_chart_renders_the_same_objects() -> None:
    kustomize = by_key(kustomized(CERT_MANAGER))

    chart = by_key(
        rendered(
            *WITH_PROMETHEUS_OPERATOR,
            "--set",
            "intakeTLS.certManager.enabled=true",
            "--set",
            "namespace.create=true",
        )
    )

    assert chart.keys() == kustomize.keys()
    assert ca_volume(chart[DAEMONSET]) == ca_volume(kustomize[DAEMONSET]) == CA_FROM_SECRET
    for name in sorted(kustomize, key=str):
        got, want = as_kustomized(chart[name]), cel_spaced(kustomize[name])
        if name == DAEMONSET:  # the patch puts the CA's volume first; the order means nothing
            got, want = with_volume(got, CA_FROM_SECRET), with_volume(want, CA_FROM_SECRET)
        assert got == want, name
