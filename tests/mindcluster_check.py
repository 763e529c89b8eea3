"""A checker built from MindCluster's own Go code (its Ascend device plugin's `pkg/common`): it
reads a ConfigMap's data on stdin and says whether MindCluster would write and read it so
(`tests/mindcluster_check/main.go`). Built once per source commit into `.cache/volcano-check/`.

The source is not downloaded here: export the two components from a clone of MindCluster
(github.com/Ascend/mind-cluster) into `.cache/volcano-check/src`:

    git -C MIND_CLUSTER archive HEAD component/ascend-device-plugin component/ascend-common \\
        | tar -x -C .cache/volcano-check/src
    git -C MIND_CLUSTER rev-parse HEAD > .cache/volcano-check/src/COMMIT

Their Go dependencies come through the Go module proxy. Without Go, the source or a build, the
callers skip, saying which.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "volcano-check"
SOURCE = CACHE / "src"
PROGRAM = Path(__file__).resolve().parent / "mindcluster_check" / "main.go"
GO_MOD = """module mindclustercheck

go 1.26

require Ascend-device-plugin v0.0.0

replace Ascend-device-plugin => {source}/component/ascend-device-plugin

replace ascend-common => {source}/component/ascend-common
"""


def checker() -> Path:
    """The built checker (built now when missing); pytest.skip when it cannot be had."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not on PATH: the MindCluster check builds MindCluster's Go code")
    commit_file = SOURCE / "COMMIT"
    if not (SOURCE / "component" / "ascend-device-plugin" / "go.mod").is_file():
        pytest.skip(f"MindCluster's source is not in {SOURCE} (see tests/mindcluster_check.py)")
    commit = commit_file.read_text().strip() if commit_file.is_file() else "unknown"
    program = PROGRAM.read_bytes()
    tag = f"{commit[:12]}-{hashlib.sha256(program).hexdigest()[:12]}"
    binary = CACHE / "bin" / tag / "mindcluster-check"
    if binary.is_file():
        return binary
    build = CACHE / "build" / tag
    build.mkdir(parents=True, exist_ok=True)
    (build / "main.go").write_bytes(program)
    (build / "go.mod").write_text(GO_MOD.format(source=SOURCE))
    for args in (["mod", "tidy"], ["build", "-o", str(binary), "."]):
        result = subprocess.run(
            [go, *args], cwd=build, capture_output=True, text=True, check=False, timeout=900
        )
        if result.returncode != 0:
            pytest.skip(f"go {' '.join(args)} failed in {build}: {result.stderr[-2000:]}")
    return binary


def check(binary: Path, data: str) -> tuple[bool, str]:
    """Run the checker on a ConfigMap's data (a JSON object of strings): (accepted, its output)."""
    result = subprocess.run(
        [str(binary)], input=data, capture_output=True, text=True, check=False, timeout=60
    )
    return result.returncode == 0, (result.stdout + result.stderr).strip()
