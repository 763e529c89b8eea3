"""Who the agent is to the API server, without the kubernetes package: credentials read from
kubeconfig documents or the pod's service account, the TLS context they make, and a bearer token
file re-read at most once a minute and after a 401, as client-go does (kubelet rotates projected
tokens). What is not implemented makes `Credentials.from_kubeconfig` return None (see
`kube_rest`)."""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edl_agent.kube import (
    SERVICE_CERT_FILENAME,
    SERVICE_TOKEN_FILENAME,
    KubeConfigError,
)
from edl_agent.kubeconfig_check import kubeconfig_problem, named_entry

TOKEN_REREAD_SECONDS = 60.0


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are. PEM data (`*_data`) is preferred
    over files, as kubectl does; a `token_file` over a `token`."""

    server: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    cert_file: str | None = None
    cert_data: bytes | None = None
    key_file: str | None = None
    key_data: bytes | None = None
    token: str | None = None
    token_file: str | None = None
    username: str | None = None
    password: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None

    @classmethod
    def from_service_account(
        cls,
        environ: Mapping[str, str],
        token_file: str = SERVICE_TOKEN_FILENAME,
        ca_file: str = SERVICE_CERT_FILENAME,
    ) -> Credentials:
        host = environ.get("KUBERNETES_SERVICE_HOST", "")
        port = environ.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            msg = "in-cluster service account: KUBERNETES_SERVICE_HOST/PORT is not set"
            raise KubeConfigError(msg)
        if ":" in host:
            host = f"[{host}]"
        return cls(server=f"https://{host}:{port}", ca_file=ca_file, token_file=token_file)

    @classmethod
    def from_kubeconfig(cls, documents: Sequence[tuple[Path, object]]) -> Credentials | None:
        """From (file, parsed YAML) pairs in $KUBECONFIG order. Relative paths in an entry are
        relative to the directory of the file that defined it. None: the user or cluster needs
        what only the kubernetes package implements. KubeConfigError: unusable."""
        problem = kubeconfig_problem([document for _, document in documents])
        if problem is not None:
            raise KubeConfigError(problem)
        merged = [(p, d) for p, d in documents if isinstance(d, Mapping)]
        current = next(str(d["current-context"]) for _, d in merged if d.get("current-context"))
        _, context = _first(merged, "contexts", current) or (Path(), {})
        cluster_dir, cluster = _first(merged, "clusters", str(context["cluster"])) or (Path(), {})
        user_dir, user = _first(merged, "users", str(context.get("user") or "")) or (Path(), {})
        if "exec" in user or "auth-provider" in user or cluster.get("proxy-url"):
            return None
        username, password = user.get("username"), user.get("password")
        return cls(
            server=str(cluster["server"]),
            ca_file=_path(cluster_dir, cluster.get("certificate-authority")),
            ca_data=_base64(cluster, "certificate-authority-data"),
            cert_file=_path(user_dir, user.get("client-certificate")),
            cert_data=_base64(user, "client-certificate-data"),
            key_file=_path(user_dir, user.get("client-key")),
            key_data=_base64(user, "client-key-data"),
            token=str(user["token"]) if user.get("token") else None,
            token_file=_path(user_dir, user.get("tokenFile")),
            username=str(username) if username is not None and password is not None else None,
            password=str(password) if username is not None and password is not None else None,
            insecure=cluster.get("insecure-skip-tls-verify") is True,
            tls_server_name=str(cluster["tls-server-name"])
            if cluster.get("tls-server-name")
            else None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS settings: the CA (or none checked), and the client certificate if any."""
        try:
            if self.insecure:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            elif self.ca_data:
                context = ssl.create_default_context(cadata=self.ca_data.decode("ascii"))
            else:
                context = ssl.create_default_context(cafile=self.ca_file)
            cert = self.cert_data or _read(self.cert_file)
            key = self.key_data or _read(self.key_file)
            if cert or key:
                if not (cert and key):
                    msg = "a client certificate needs both the certificate and its key"
                    raise KubeConfigError(msg)
                _load_chain(context, cert, key)
        except (OSError, ssl.SSLError, ValueError) as exc:
            msg = f"TLS: {type(exc).__name__}: {exc}"
            raise KubeConfigError(msg) from None
        return context


def _first(
    documents: Sequence[tuple[Path, Mapping[object, object]]], kind: str, name: str
) -> tuple[Path, Mapping[str, object]] | None:
    """The first entry of `kind` called `name`, with the directory of the file defining it."""
    for path, document in documents:
        entry = named_entry([document], kind, name)
        if entry is not None:
            return path.expanduser().absolute().parent, entry
    return None


def _path(directory: Path, value: object) -> str | None:
    return str(directory / str(value)) if value else None


def _base64(entry: Mapping[str, object], key: str) -> bytes | None:
    value = entry.get(key)
    if not value:
        return None
    try:
        return base64.b64decode("".join(str(value).split()), validate=True)
    except (binascii.Error, ValueError):
        msg = f"{key} is not base64"
        raise KubeConfigError(msg) from None


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def _load_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """`load_cert_chain` reads only files: give it the PEM through an anonymous memory file
    (nothing on disk, and a read-only root filesystem is fine), else a private temporary file
    removed at once."""
    try:
        fd = os.memfd_create("kube-client-cert", os.MFD_CLOEXEC)
        path, temporary = f"/proc/self/fd/{fd}", False
    except (AttributeError, OSError):
        import tempfile

        fd, path = tempfile.mkstemp(prefix="kube-client-cert-")  # mode 0600
        temporary = True
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            out.write(cert.rstrip(b"\n") + b"\n" + key)
        context.load_cert_chain(path)
    finally:
        os.close(fd)
        if temporary:
            Path(path).unlink()


class TokenFile:
    """A bearer token file, re-read when `TOKEN_REREAD_SECONDS` have passed or when asked (after
    a 401). A failed re-read keeps the token we have: kubelet swaps the file atomically, so that
    is a passing moment, not a reason to stop authenticating."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._clock = path, clock
        self._lock = threading.Lock()
        self._token = self._load()
        if not self._token:
            msg = f"token file {path} is empty or unreadable"
            raise KubeConfigError(msg)
        self._read_at = clock()

    def get(self) -> str:
        with self._lock:
            if self._clock() - self._read_at >= TOKEN_REREAD_SECONDS:
                self._refresh()
            return self._token

    def reread(self) -> bool:
        """Read the file now; whether the token changed."""
        with self._lock:
            before = self._token
            self._refresh()
            return self._token != before

    def _refresh(self) -> None:
        self._token = self._load() or self._token
        self._read_at = self._clock()

    def _load(self) -> str:
        try:
            return Path(self.path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return ""
