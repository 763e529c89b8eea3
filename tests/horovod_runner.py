"""Horovod's own host-discovery parser, for tests: `horovod==0.28.1` installed once into a venv of
its own under `.cache/horovod/` (``$EDL_HOROVOD_VENV`` to put it elsewhere), then
`horovod.runner.elastic.discovery.HostDiscoveryScript` run in that venv on a script of ours.

Only Horovod's pure-Python runner is installed: `HOROVOD_SKIP_COMPILE=1` skips its CMake build
(the `HOROVOD_WITHOUT_*` switches alone still configure and build with CMake when it is there,
and fail without it), `HOROVOD_WITHOUT_PYTORCH=1` leaves out cffi. From the PyPI sdist with pip's
cache cold: about 12 s and 35 MiB on 2 cores. Not an extra of `[test]`: pip cannot pass these
variables to a dependency's build, and without them the build needs CMake and a framework.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = "0.28.1"
BUILD_ENV = {"HOROVOD_SKIP_COMPILE": "1", "HOROVOD_WITHOUT_PYTORCH": "1",
             "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1"}  # fmt: skip
# Runs HostDiscoveryScript(script, default slots) and prints what it found as JSON, or the
# exception it raised.
_PARSE = """
import json, sys
from horovod.runner.elastic.discovery import HostDiscoveryScript
try:
    found = HostDiscoveryScript(sys.argv[1], int(sys.argv[2])).find_available_hosts_and_slots()
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
else:
    print(json.dumps({"hosts": found}))
"""


def venv_dir() -> Path:
    return Path(os.environ.get("EDL_HOROVOD_VENV") or REPO / ".cache" / "horovod" / VERSION)


def horovod_python() -> Path:
    """The Python of the venv with Horovod's runner, installed on first use (fails, never
    skips, when it cannot be: CI has PyPI, as for `pip install -e .[test]`)."""
    target = venv_dir()
    python = target / "bin" / "python"
    if python.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time; the others find it made
        if python.exists():
            return python
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            venv.create(staging, with_pip=True)
            done = subprocess.run(
                [str(staging / "bin" / "python"), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", f"horovod=={VERSION}"],
                env={**os.environ, **BUILD_ENV}, capture_output=True, text=True, check=False,
                timeout=600,
            )  # fmt: skip
            if done.returncode != 0:
                pytest.fail(
                    f"could not install horovod=={VERSION} into {staging}: "
                    f"{(done.stderr or done.stdout)[-2000:]}",
                    pytrace=False,
                )
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return python


def discover(script: Path, default_slots: int = 1) -> dict[str, object]:
    """What Horovod's HostDiscoveryScript makes of `script`: {"hosts": {host: slots}} or
    {"error": "..."} (a non-zero exit raises RuntimeError there)."""
    done = subprocess.run(
        [str(horovod_python()), "-c", _PARSE, str(script), str(default_slots)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


if __name__ == "__main__":  # `python -m tests.horovod_runner`: install it now
    sys.stdout.write(f"{horovod_python()}\n")
