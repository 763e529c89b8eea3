"""The size limits the layout keeps: no module of ours over 500 lines, no class over 300
(generated protos aside). A module past them is a sign it holds more than one job."""

from __future__ import annotations

import ast
from pathlib import Path

import edl_agent

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
PACKAGE = Path(edl_agent.__file__).parent


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_proto" not in p.relative_to(PACKAGE).parts)


def too_long(source: str) -> list[str]:
    """What in `source` is past the limits, as `module: N lines` / `class C: N lines`."""
    found = []
    lines = source.count("\n") + (0 if source.endswith("\n") or not source else 1)
    if lines > MAX_MODULE_LINES:
        found.append(f"module: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            size = node.end_lineno - node.lineno + 1
            if size > MAX_CLASS_LINES:
                found.append(f"class {node.name}: {size} lines")
    return found


def test_the_check_sees_a_long_module_and_a_long_class() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    assert too_long(f"class Big:\n{body}\n") == [f"class Big: {MAX_CLASS_LINES + 1} lines"]
    assert too_long("x = 1\n" * MAX_MODULE_LINES) == []
    assert too_long("x = 1\n" * (MAX_MODULE_LINES + 1)) == [f"module: {MAX_MODULE_LINES + 1} lines"]


def test_no_module_or_class_is_past_the_limits() -> None:
    past = {
        str(path.relative_to(PACKAGE)): found
        for path in sources()
        if (found := too_long(path.read_text()))
    }
    assert past == {}
