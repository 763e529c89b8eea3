"""The intake's TLS certificate, read again when its files change: a renewed certificate (a
Secret volume updated by cert-manager, a file replaced by hand) serves new connections without a
restart, while connections already open keep theirs."""

from __future__ import annotations

import ssl
import threading
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger()

Signature = tuple[tuple[int, int, int], ...]


class CertificateError(Exception):
    """The certificate or its key cannot be read or do not belong together."""


class ReloadingCertificate:
    """A certificate and its key as gRPC server credentials that follow the files."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert = cert
        self.key = key
        self._lock = threading.Lock()
        self._serving: Signature | None = None
        self._refused: Signature | None = None
        self.reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that ask for the files' state before every handshake; the first read
        must succeed."""
        signature = self._signature()
        initial = self._load() if signature is not None else None
        if signature is None or initial is None:
            msg = f"cannot use the intake's certificate {self.cert} and key {self.key}"
            raise CertificateError(msg)
        self._serving = signature
        return grpc.dynamic_ssl_server_credentials(initial, self.fetch)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC calls this before each new connection's handshake: the new pair when the files
        changed and hold a usable pair, else None (keep serving the current one)."""
        try:
            with self._lock:
                signature = self._signature()
                if signature is None or signature in (self._serving, self._refused):
                    return None
                loaded = self._load()
                if loaded is None or self._signature() != signature:
                    # Unusable, or replaced while read: decided again at a later handshake.
                    if loaded is None:
                        self._refused = signature
                        log.warning(
                            "intake certificate changed but unusable; serving the previous one",
                            cert=str(self.cert),
                            key=str(self.key),
                        )
                    return None
                self._serving = signature
                self.reloads += 1
                log.info("intake certificate reloaded", cert=str(self.cert))
                return loaded
        except Exception:  # a raise here would only be logged by gRPC, without our context
            log.exception("intake certificate check failed; serving the previous one")
            return None

    def _signature(self) -> Signature | None:
        try:
            stats = [path.stat() for path in (self.cert, self.key)]
        except OSError:
            return None
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def _load(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            # Proves the key belongs to the certificate before gRPC is handed the pair.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            cert, key = self.cert.read_bytes(), self.key.read_bytes()
        except (OSError, ssl.SSLError):
            return None
        return grpc.ssl_server_certificate_configuration([(key, cert)])
