"""Compile the fake `libnvidia-ml.so.1` (fake_nvml.c) once per source and compiler, and cache it.

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
from importlib import resources
from pathlib import Path

LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = (
    "-shared",
    "-fPIC",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    f"-Wl,-soname,{LIBRARY_NAME}",
)
LIBS = ("-ldl", "-pthread")
BUILD_TIMEOUT_S = 120.0


class FakeNvmlBuildError(Exception):
    """The fake NVML library could not be built; the message is one line saying why."""


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("EDL_CACHE_DIR"):
        return Path(env["EDL_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "edl-agent"
    return Path.home() / ".cache" / "edl-agent"


def source() -> bytes:
    return (resources.files("edl_agent.sim") / "fake_nvml.c").read_bytes()


def library_path(environ: Mapping[str, str] | None = None) -> Path:
    """The cached library for the current source and compiler, built first when missing."""
    env = os.environ if environ is None else environ
    compiler = _find_compiler(env.get("CC") or "gcc", env.get("PATH"))
    code = source()
    key = hashlib.sha256(
        b"\0".join([code, _compiler_identity(compiler).encode(), " ".join(CFLAGS + LIBS).encode()])
    ).hexdigest()[:24]
    target = cache_dir(env) / "fake-nvml" / key / LIBRARY_NAME
    if not target.is_file():
        _build(compiler, code, target)
    return target


def _find_compiler(name: str, search_path: str | None) -> str:
    found = shutil.which(name, path=search_path)
    if found is None:
        msg = f"C compiler {name!r} not found on PATH: it builds the simulated {LIBRARY_NAME}"
        raise FakeNvmlBuildError(msg)
    return found


@functools.lru_cache(maxsize=8)
def _compiler_identity(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        msg = f"{compiler} --version failed: {exc}"
        raise FakeNvmlBuildError(msg) from exc
    lines = done.stdout.splitlines()
    return f"{compiler} {lines[0] if lines else ''}"


def _build(compiler: str, code: bytes, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        src = Path(work) / "fake_nvml.c"
        src.write_bytes(code)
        out = Path(work) / LIBRARY_NAME
        command = [compiler, *CFLAGS, "-o", str(out), str(src), *LIBS]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            msg = f"building the simulated {LIBRARY_NAME} timed out after {BUILD_TIMEOUT_S:g}s"
            raise FakeNvmlBuildError(msg) from exc
        except OSError as exc:
            msg = f"cannot run {compiler}: {exc.strerror or exc}"
            raise FakeNvmlBuildError(msg) from exc
        if done.returncode != 0:
            msg = (
                f"building the simulated {LIBRARY_NAME} failed: {Path(compiler).name} "
                f"exited {done.returncode}: {_first_error(done.stderr)}"
            )
            raise FakeNvmlBuildError(msg)
        out.chmod(0o755)
        # Atomic within the directory; a concurrent build of the same key writes identical bytes.
        out.replace(target)


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or ["no compiler output"])[0]
