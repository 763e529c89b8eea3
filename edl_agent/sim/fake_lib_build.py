"""Compile the simulator's fake vendor libraries (`libnvidia-ml.so.1` from fake_nvml.c, and the
others named in `FakeLibrary` values) once per source and compiler, and cache them.

The cache lives in `$EDL_CACHE_DIR`, else `$XDG_CACHE_HOME/edl-agent`, else
`~/.cache/edl-agent`; the compiler is `$CC`, else `gcc`. Builds go to a temporary file that is
renamed into place, so concurrent test processes never see a half-written library.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror")
LIBS = ("-ldl", "-pthread")
BUILD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FakeLibrary:
    """One fake library: its file (and soname), its C source in `edl_agent.sim`, and the name of
    its cache folder."""

    name: str
    source: str
    folder: str

    def flags(self) -> tuple[str, ...]:
        return (*CFLAGS, f"-Wl,-soname,{self.name}")


NVML = FakeLibrary("libnvidia-ml.so.1", "fake_nvml.c", "fake-nvml")


class FakeLibraryBuildError(Exception):
    """A fake library could not be built; the message is one line saying why."""


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("EDL_CACHE_DIR"):
        return Path(env["EDL_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "edl-agent"
    return Path.home() / ".cache" / "edl-agent"


def source(library: FakeLibrary = NVML) -> bytes:
    return (resources.files("edl_agent.sim") / library.source).read_bytes()


def library_path(library: FakeLibrary = NVML, environ: Mapping[str, str] | None = None) -> Path:
    """The cached `library` for the current source and compiler, built first when missing."""
    env = os.environ if environ is None else environ
    compiler = _find_compiler(env.get("CC") or "gcc", env.get("PATH"), library)
    code = source(library)
    flags = " ".join(library.flags() + LIBS)
    key = hashlib.sha256(
        b"\0".join([code, _compiler_identity(compiler).encode(), flags.encode()])
    ).hexdigest()[:24]
    target = cache_dir(env) / library.folder / key / library.name
    if not target.is_file():
        _build(compiler, code, target, library)
    return target


def _find_compiler(name: str, search_path: str | None, library: FakeLibrary) -> str:
    found = shutil.which(name, path=search_path)
    if found is None:
        msg = f"C compiler {name!r} not found on PATH: it builds the simulated {library.name}"
        raise FakeLibraryBuildError(msg)
    return found


@functools.lru_cache(maxsize=8)
def _compiler_identity(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        msg = f"{compiler} --version failed: {exc}"
        raise FakeLibraryBuildError(msg) from exc
    lines = done.stdout.splitlines()
    return f"{compiler} {lines[0] if lines else ''}"


def _build(compiler: str, code: bytes, target: Path, library: FakeLibrary) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        src = Path(work) / library.source
        src.write_bytes(code)
        out = Path(work) / library.name
        command = [compiler, *library.flags(), "-o", str(out), str(src), *LIBS]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            msg = f"building the simulated {library.name} timed out after {BUILD_TIMEOUT_S:g}s"
            raise FakeLibraryBuildError(msg) from exc
        except OSError as exc:
            msg = f"cannot run {compiler}: {exc.strerror or exc}"
            raise FakeLibraryBuildError(msg) from exc
        if done.returncode != 0:
            msg = (
                f"building the simulated {library.name} failed: {Path(compiler).name} "
                f"exited {done.returncode}: {_first_error(done.stderr)}"
            )
            raise FakeLibraryBuildError(msg)
        out.chmod(0o755)
        # Atomic within the directory; a concurrent build of the same key writes identical bytes.
        out.replace(target)


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or ["no compiler output"])[0]
