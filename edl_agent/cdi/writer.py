"""Writes CDI specs where the container runtime reads them (`dra.cdi_dir`).

Files are `edl.io-<vendor>.json` (static vendor specs) and `edl.io-claim-<uid>.json` (one per
prepared claim); no file without the `edl.io-` prefix is ever touched. A spec is written to a
temporary file in the same directory and renamed over the old one, so a runtime reading the
directory sees either the old spec or the new one, never part of one. Temporary files end in
`.tmp`, which runtimes do not load as specs.

Errors are OSErrors naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from edl_agent.cdi.spec import check_claim_uid
from edl_agent.devices import names
from edl_agent.devices.model import Vendor
from edl_agent.runtime.durable import fsync_directory

PREFIX = f"{names.DOMAIN}-"
CLAIM_PREFIX = f"{PREFIX}claim-"
SUFFIX = ".json"
TEMP_SUFFIX = ".tmp"
FILE_MODE = 0o644
DIRECTORY_MODE = 0o755
_CLAIM_FILE = re.compile(rf"^{re.escape(CLAIM_PREFIX)}(.+){re.escape(SUFFIX)}$")


class CdiWriter:
    """Our CDI spec files in one directory. Safe to share between threads."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()

    def vendor_path(self, vendor: Vendor) -> Path:
        return self.directory / f"{PREFIX}{vendor.value}{SUFFIX}"

    def claim_path(self, claim_uid: str) -> Path:
        return self.directory / f"{CLAIM_PREFIX}{check_claim_uid(claim_uid)}{SUFFIX}"

    def sync_vendor_specs(self, specs: Mapping[Vendor, Mapping[str, Any] | None]) -> list[Path]:
        """Make the vendor spec files match `specs`: write those whose content changed, remove
        those of vendors missing from `specs` or mapped to None, and clear temporary files left
        by an interrupted write. Returns the files written or removed."""
        changed = []
        with self._lock:
            self._remove_leftover_temporaries()
            for vendor in Vendor:
                path = self.vendor_path(vendor)
                spec = specs.get(vendor)
                done = self._remove(path) if spec is None else self._write(path, spec)
                if done:
                    changed.append(path)
        return changed

    def write_claim(self, claim_uid: str, spec: Mapping[str, Any]) -> Path:
        path = self.claim_path(claim_uid)
        with self._lock:
            self._write(path, spec)
        return path

    def remove_claim(self, claim_uid: str) -> bool:
        """Remove the claim's spec; False when there was none."""
        path = self.claim_path(claim_uid)
        with self._lock:
            return self._remove(path)

    def claim_uids(self) -> list[str]:
        """The uids of the claims whose specs are in the directory, sorted."""
        matches = map(_CLAIM_FILE.match, self._our_file_names())
        uids = (m.group(1) for m in matches if m is not None)
        return sorted(uid for uid in uids if _is_claim_uid(uid))

    def _write(self, path: Path, spec: Mapping[str, Any]) -> bool:
        """Write `spec` to `path` unless it already holds exactly that; True when written."""
        content = (json.dumps(spec, indent=2) + "\n").encode()
        if _holds(path, content):
            return False
        with _errors_name(path, "cannot write CDI spec"):
            self.directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(
                dir=self.directory, prefix=f"{path.name}.", suffix=TEMP_SUFFIX
            )
            temporary = Path(name)
            try:
                with os.fdopen(fd, "wb") as file:
                    os.fchmod(file.fileno(), FILE_MODE)  # mkstemp's 0600 would hide it
                    file.write(content)
                    file.flush()
                    os.fsync(file.fileno())
                temporary.replace(path)
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            fsync_directory(self.directory)
        return True

    def _remove(self, path: Path) -> bool:
        with _errors_name(path, "cannot remove CDI spec"):
            try:
                path.unlink()
            except FileNotFoundError:
                return False
            fsync_directory(self.directory)
        return True

    def _remove_leftover_temporaries(self) -> None:
        for name in self._our_file_names():
            if name.endswith(TEMP_SUFFIX):
                self._remove(self.directory / name)

    def _our_file_names(self) -> list[str]:
        """The names in the directory that carry our prefix; none when it does not exist."""
        try:
            with os.scandir(self.directory) as entries:
                return [entry.name for entry in entries if entry.name.startswith(PREFIX)]
        except FileNotFoundError:
            return []
        except OSError as err:
            raise _naming(err, "cannot list CDI specs", self.directory) from err


def _is_claim_uid(text: str) -> bool:
    try:
        check_claim_uid(text)
    except ValueError:
        return False
    return True


def _holds(path: Path, content: bytes) -> bool:
    """Whether the file exists with exactly `content` and our mode."""
    try:
        with path.open("rb") as file:
            same_mode = (os.fstat(file.fileno()).st_mode & 0o777) == FILE_MODE
            return same_mode and file.read() == content
    except FileNotFoundError:
        return False
    except OSError as err:
        raise _naming(err, "cannot read CDI spec", path) from err


@contextlib.contextmanager
def _errors_name(path: Path, action: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise _naming(err, action, path) from err


def _naming(err: OSError, action: str, path: Path) -> OSError:
    """`err` again, saying what was being done to which file (the errno, hence the OSError
    subclass, is kept)."""
    return OSError(err.errno, f"{action}: {err.strerror or err}", str(path))
