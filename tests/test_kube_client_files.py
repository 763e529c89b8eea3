"""A kubeconfig's certificate data stays off the disk: the kubernetes client copies it to
temporary files that only a clean exit removes (a killed agent would leave them); `api_client`
moves each into a memory file the process keeps, and removes the copy at once."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from edl_agent.kube import api_client
from tests.test_kube_rest import b64, kubeconfig

CA, CERT, KEY = b"CA PEM\n", b"CERT PEM\n", b"KEY PEM\n"


def test_certificate_data_lives_in_memory_not_in_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path = kubeconfig(
        tmp_path / "kubeconfig",
        cluster={"server": "https://k8s.test:6443", "certificate-authority-data": b64(CA)},
        user={"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)},
    )
    clients = [api_client(str(path), ambient=False) for _ in range(2)]
    try:
        for client in clients:
            assert client is not None
            conf = client.configuration
            files = (conf.ssl_ca_cert, conf.cert_file, conf.key_file)
            assert all(name.startswith("/proc/self/fd/") for name in files), files
            assert [Path(name).read_bytes() for name in files] == [CA, CERT, KEY]
        assert list(scratch.iterdir()) == []  # the client's copies are gone already
    finally:
        for client in clients:
            if client is not None:
                client.close()
