"""Build NVIDIA's k8s-device-plugin and GPU Feature Discovery from the Go module proxy, for the
side-by-side benchmarks.

    .venv/bin/python bench/build_nvidia_plugin.py [--version v0.19.0] [--only NAME] [--force]
        [--print-path]

Both are commands of the same Go module, github.com/NVIDIA/k8s-device-plugin:
`cmd/nvidia-device-plugin` (bench/nvidia_peer.py) and `cmd/gpu-feature-discovery`
(bench/node_peer.py). Without `--only` both are built. Each binary goes to
`.cache/peers/<name>/<version>/<name>` (or under `$EDL_PEERS_DIR`) and is reused while it is
there; the build's `.build/` directory there keeps a scratch Go module requiring the tag, its
go.sum and build.log. go-nvml is cgo (it dlopens libnvidia-ml.so.1), so the build needs
CGO_ENABLED=1 and a C compiler. A cold build of the plugin takes about 2 minutes on 2 cores;
GFD after it reuses most of the compiled packages.

Standard library only, so it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import k8sbinaries  # noqa: E402  (build helpers; standard library only too)

DEFAULT_VERSION = "v0.19.0"  # the newest tag proxy.golang.org serves (v0.20.0 answers 403)
MODULE = "github.com/NVIDIA/k8s-device-plugin"
BINARY = "nvidia-device-plugin"
GFD = "gpu-feature-discovery"
COMMANDS = (BINARY, GFD)  # each is the module's cmd/<name>
PACKAGE = f"{MODULE}/cmd/{BINARY}"
VERSION_VAR = f"{MODULE}/internal/info.version"  # what `--version` prints (both commands)


class BuildError(Exception):
    """The plugin could not be built; the message says why and what to do."""


def log(message: str) -> None:
    print(f"[build-nvidia-plugin] {message}", file=sys.stderr, flush=True)


def peers_dir() -> Path:
    return Path(os.environ.get("EDL_PEERS_DIR") or REPO / ".cache" / "peers")


def binary_path(version: str = DEFAULT_VERSION, name: str = BINARY) -> Path:
    return peers_dir() / name / version / name


def built(version: str = DEFAULT_VERSION, name: str = BINARY) -> Path | None:
    """The cached binary of `name` (the plugin unless told), or None when it is not built."""
    path = binary_path(version, name)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _tool(name: str, why: str) -> str:
    found = shutil.which(name)
    if found is None:
        msg = f"'{name}' is not on PATH: {why}"
        raise BuildError(msg)
    return found


def build(version: str = DEFAULT_VERSION, *, force: bool = False, name: str = BINARY) -> Path:
    """The binary of `name` (one of COMMANDS; the plugin unless told) for `version`, built
    first when it is not cached."""
    if name not in COMMANDS:
        msg = f"unknown command {name!r}: {MODULE} {version} builds {', '.join(COMMANDS)}"
        raise BuildError(msg)
    target = binary_path(version, name)
    if not force and built(version, name):
        return target
    go = _tool("go", f"install Go (>= 1.25 for {MODULE} {version}) to build NVIDIA's {name}")
    _tool("gcc", f"go-nvml is cgo, so building NVIDIA's {name} needs a C compiler")
    work = target.parent / ".build"
    work.mkdir(parents=True, exist_ok=True)
    logfile = work / "build.log"
    logfile.write_text("")
    # A scratch module: `go install pkg@version` would also read the proxy's version list for
    # deprecation notices, and proxy.golang.org answers 403 for this module's list.
    (work / "go.mod").write_text(
        f"module edl.local/peers/nvidia\n\ngo 1.25.0\n\nrequire {MODULE} {version}\n"
    )
    (work / "doc.go").write_text("package peers\n")
    env = {"CGO_ENABLED": "1", "GOFLAGS": "-mod=mod -buildvcs=false"}
    what = f"{name} {version}"
    package = f"{MODULE}/cmd/{name}"
    log(f"building {package}@{version} (about 2 min on 2 cores with cold Go caches; log {logfile})")
    started = time.monotonic()
    try:
        with k8sbinaries.heartbeat(what, every=30.0, say=log):
            k8sbinaries.run_logged(
                [go, "mod", "download", MODULE], cwd=work, logfile=logfile, what=what, env=env
            )
            k8sbinaries.run_logged(
                [go, "build", "-trimpath", "-ldflags", f"-s -w -X {VERSION_VAR}={version}",
                 "-o", name, package],
                cwd=work, logfile=logfile, what=what, env=env,
            )  # fmt: skip
    except k8sbinaries.BinariesError as exc:
        raise BuildError(str(exc)) from None
    built_binary = work / name
    built_binary.chmod(0o755)
    built_binary.replace(target)
    log(f"built {target} in {time.monotonic() - started:.0f}s")
    return target


def binaries(version: str, names: tuple[str, ...], *, build_missing: bool) -> list[Path] | None:
    """The binaries of `names`, built first when `build_missing`; None when one is missing
    (and not built). BuildError when a build fails."""
    paths = []
    for name in names:
        path = built(version, name)
        if path is None and build_missing:
            path = build(version, name=name)
        if path is None:
            return None
        paths.append(path)
    return paths


def not_built(version: str, names: tuple[str, ...]) -> str:
    """What to say when `binaries` found them missing."""
    return (
        f"NVIDIA's {' and '.join(names)} {version} not built; build with "
        "`.venv/bin/python bench/build_nvidia_plugin.py` (or pass --build)"
    )


def require(
    version: str, names: tuple[str, ...], *, build_missing: bool, say: Callable[[str], None]
) -> list[Path]:
    """`binaries` for a benchmark's main: it exits 1 (said why) when a build fails and 3 when
    one is not built, the status bench/run.py reads as skipped."""
    try:
        found = binaries(version, names, build_missing=build_missing)
    except BuildError as exc:
        say(f"cannot build NVIDIA's {' and '.join(names)}: {exc}")
        raise SystemExit(1) from None
    if found is None:
        say(not_built(version, names))
        raise SystemExit(3)
    return found


def module_source(version: str = DEFAULT_VERSION) -> Path | None:
    """Where the module's source (plugin and GFD) lies in the Go module cache (after a build),
    if Go is here."""
    go = shutil.which("go")
    if go is None:
        return None
    done = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, check=False)
    escaped = "".join(f"!{c.lower()}" if c.isupper() else c for c in MODULE)
    path = Path(done.stdout.strip()) / f"{escaped}@{version}"
    return path if path.is_dir() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="a tag of the Go module")
    parser.add_argument(
        "--only", action="append", choices=COMMANDS, metavar="NAME",
        help=f"build only this command (repeatable): {', '.join(COMMANDS)}; default: all",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--print-path", action="store_true", help="print each binary's path")
    args = parser.parse_args(argv)
    for name in args.only or COMMANDS:
        try:
            path = build(args.version, force=args.force, name=name)
        except BuildError as exc:
            log(f"error: {exc}")
            return 1
        if args.print_path:
            print(path)
        else:
            log(f"ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
