"""The agent as its image runs it, for the benchmarks that time its start and its idle cost.

The image holds the runtime dependencies only, with their bytecode compiled at install
(Dockerfile); the test environment holds more (import-linter brings `rich`, which structlog
imports when it finds it) and, with PYTHONDONTWRITEBYTECODE, would compile our own modules again
at every start. So the benchmarks run the agent from a virtual environment with the
`[project] dependencies` of pyproject.toml only (made once under .cache/bench-runtime/, one per
set of dependencies), our package from this tree with its bytecode compiled beforehand.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "bench-runtime"


def dependencies() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return sorted(project["dependencies"])


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@functools.cache
def runtime_python(log: Callable[[str], None] = _progress) -> Path:
    """The interpreter of the runtime environment, made when missing; our bytecode compiled."""
    wanted = dependencies()
    key = hashlib.sha256("\n".join([sys.version, *wanted]).encode()).hexdigest()[:12]
    venv = CACHE / key
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        log(f"[runtime] making {venv} with the runtime dependencies only")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *wanted], check=True)
        (venv / ".complete").write_text("\n".join(wanted) + "\n")
    subprocess.run(
        [str(python), "-m", "compileall", "-q", str(REPO / "edl_agent")],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return python
