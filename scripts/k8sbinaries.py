"""Provide pinned etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kubelet,
kwok and helm binaries, and our fake container runtime, for tests.

Resolution order for every binary:

1. the bin dir (``$EDL_K8S_BIN_DIR``, default ``<repo>/.cache/k8s/<kubernetes version>/``)
   when the binary there carries a version stamp that matches the pin below;
2. ``$KUBEBUILDER_ASSETS/<name>`` (etcd, kube-apiserver and kubectl: what envtest bundles hold);
3. otherwise ``ensure()`` builds it into the bin dir from the Go module proxy, in scratch
   modules under ``<bin dir>/.build/`` (go.mod, go.sum and build.log stay there for
   inspection). Go's own caches (GOMODCACHE, GOCACHE) are used as configured, so a rebuild
   after a version bump only compiles what changed.

Measured on 2 cores with cold Go caches: etcd ~70 s, kube-apiserver ~260 s, then (sharing its
compiled packages) kube-scheduler, kube-controller-manager, kubectl and kubelet about a minute or
two each, kwok ~135 s, helm ~80 s. From v1.36.3 to v1.37.2 with Go's caches warm (nice 10, a
shared machine): kube-apiserver 459 s, kube-scheduler 86 s, kube-controller-manager 111 s,
kubectl 40 s, kubelet 49 s.

Standard library only, so ``scripts/k8s-binaries`` runs with any Python >= 3.11.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

K8S_VERSION = "v1.37.2"
# etcd v3.5.16 serves a v1.37 kube-apiserver (the whole test suite passes on it; v1.36 too);
# kubeadm 1.37 ships etcd 3.7.0 and the API server's client is v3.7.0.
ETCD_VERSION = "v3.5.16"
KWOK_VERSION = "v0.8.0"
# helm lints and renders the chart in deploy/helm (tests/cluster/test_helm_chart.py). Helm 3: the
# chart (apiVersion v2) is for the Helm most installations run, and Helm 4 reads it too.
HELM_VERSION = "v3.22.0"
HELM_MODULE = "helm.sh/helm/v3"
# The training stack users submit to, beside kube-controller-manager in the kubelet tier
# (scripts/jobstack.py starts them): JobSet's controller and Kueue's manager, each built in a
# scratch module of its own (Kueue v0.17 requires JobSet v0.11.1: one module for both would lift
# Kueue's to v0.12), with the CRDs and webhook configurations of the same module version copied
# beside them as `<name>-manifests/`.
JOBSET = "jobset-controller"
JOBSET_VERSION = "v0.12.0"
KUEUE = "kueue-manager"
KUEUE_VERSION = "v0.17.0"
# name: (module, version, main package)
CONTROLLER_MODULES = {
    JOBSET: ("sigs.k8s.io/jobset", JOBSET_VERSION, "sigs.k8s.io/jobset"),
    KUEUE: ("sigs.k8s.io/kueue", KUEUE_VERSION, "sigs.k8s.io/kueue/cmd/kueue"),
}

# kube-scheduler binds the pods of end-to-end tests; kube-controller-manager runs the Job,
# ResourceClaim, node-lifecycle and other controllers where a test opts in
# (scripts/testcluster.py's controller_manager); kubectl applies deploy/daemonset (-k); kubelet
# runs the real nodes of scripts/test-node.
KUBERNETES_COMMANDS = (
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubectl",
    "kubelet",
)
FAKE_CRI = "edl-fake-cri"
HELM = "helm"
# Everything `scripts/k8s-binaries` provides when run without names (as scripts/test runs it).
BINARIES = ("etcd", *KUBERNETES_COMMANDS, "kwok", FAKE_CRI, HELM, JOBSET, KUEUE)
# What scripts/testcluster.py starts; the others are checked by the tests that use them.
CONTROL_PLANE = ("etcd", "kube-apiserver", "kwok")

# Stages copied out of the kwok module (never committed): path under kustomize/stage/.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "node/chaos/node-not-ready.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
)
STAGES_FILE = "kwok-stages.yaml"

REPO_ROOT = Path(__file__).resolve().parent.parent
# Our fake container runtime for kubelet nodes (scripts/testnode.py), a Go module in the repo.
FAKE_CRI_SOURCE = REPO_ROOT / "scripts" / "fakecri"


def _source_version(directory: Path) -> str:
    """A version for a binary built from our own sources: a hash of them, so edits rebuild it."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*")):
        if path.is_file() and (path.suffix == ".go" or path.name in ("go.mod", "go.sum")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return "src-" + digest.hexdigest()[:16]


PINS = {
    "etcd": ETCD_VERSION,
    "kwok": KWOK_VERSION,
    FAKE_CRI: _source_version(FAKE_CRI_SOURCE),
    HELM: HELM_VERSION,
    JOBSET: JOBSET_VERSION,
    KUEUE: KUEUE_VERSION,
} | dict.fromkeys(KUBERNETES_COMMANDS, K8S_VERSION)
GO_PROXY_DEFAULT = "https://proxy.golang.org"


class BinariesError(RuntimeError):
    """A binary is missing or could not be built; the message says what to do."""


def log(message: str) -> None:
    print(f"k8s-binaries: {message}", file=sys.stderr, flush=True)


def bin_dir() -> Path:
    override = os.environ.get("EDL_K8S_BIN_DIR")
    if override:
        return Path(override).resolve()
    return REPO_ROOT / ".cache" / "k8s" / K8S_VERSION


def _stamp(directory: Path, name: str) -> Path:
    return directory / f".{name}.version"


def _cached(directory: Path, name: str) -> Path | None:
    path = directory / name
    stamp = _stamp(directory, name)
    if (
        path.is_file()
        and os.access(path, os.X_OK)
        and stamp.is_file()
        and stamp.read_text().strip() == PINS[name]
    ):
        return path
    return None


def _from_kubebuilder_assets(name: str) -> Path | None:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets or name not in ("etcd", "kube-apiserver", "kubectl"):
        return None
    path = Path(assets) / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    return None


def find(name: str) -> Path | None:
    """Where binary ``name`` is, without building anything (a controller of
    CONTROLLER_MODULES only with its manifests beside it)."""
    if name in CONTROLLER_MODULES and manifests_dir(name) is None:
        return None
    return _cached(bin_dir(), name) or _from_kubebuilder_assets(name)


def manifests_dir(name: str) -> Path | None:
    """The CRDs (``crd/*.yaml``) and webhook configurations (``webhook/``: the module's
    ``manifests.yaml`` and its kustomization's patches) of controller ``name``, copied from its
    module at the pinned version."""
    path = bin_dir() / f"{name}-manifests"
    stamp = path / ".version"
    if stamp.is_file() and stamp.read_text().strip() == PINS[name]:
        return path
    return None


def stages_file() -> Path | None:
    path = bin_dir() / STAGES_FILE
    stamp = _stamp(bin_dir(), STAGES_FILE)
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == KWOK_VERSION:
        return path
    return None


def missing(names: tuple[str, ...] = BINARIES) -> list[str]:
    """Which of ``names`` (and kwok's stages, when kwok is among them) are not available yet."""
    absent = [name for name in names if find(name) is None]
    if "kwok" in names and stages_file() is None:
        absent.append(STAGES_FILE)
    return absent


# --- building -----------------------------------------------------------------------------


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BinariesError(
            "the Go toolchain ('go') is not on PATH: install Go >= 1.26 (kwok v0.8.0 needs it) "
            "and run scripts/k8s-binaries again; it builds into "
            f"{bin_dir()}"
        )
    return go


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


@contextlib.contextmanager
def heartbeat(what: str, every: float = 60.0, say: Callable[[str], None] = log) -> Iterator[None]:
    """Say a line every ``every`` seconds so a long cold build does not look hung."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            say(f"  ... still building {what} ({time.monotonic() - started:.0f}s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run_logged(
    argv: list[str], *, cwd: Path, logfile: Path, what: str, env: dict[str, str] | None = None
) -> None:
    """Run a build step with its output appended to ``logfile``; BinariesError with the log's
    tail when it fails. ``env`` is laid over the environment (CGO off, no VCS stamping)."""
    with logfile.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        result = subprocess.run(
            argv,
            cwd=cwd,
            env={**_go_env(), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if result.returncode != 0:
        lines = logfile.read_text(errors="replace").splitlines()
        tail = "\n".join(f"    {line}" for line in lines[-25:])
        raise BinariesError(
            f"building {what} failed: `{' '.join(argv)}` exited with {result.returncode} "
            f"(full log: {logfile}); last lines:\n{tail}"
        )


def _fetch_text(url: str) -> str:
    if not url.startswith("https://"):
        raise BinariesError(f"refusing a non-https module proxy URL: {url}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (https only)
            return str(response.read().decode())
    except OSError as exc:
        raise BinariesError(f"could not fetch {url}: {exc}") from exc


def _proxy() -> str:
    for entry in os.environ.get("GOPROXY", GO_PROXY_DEFAULT).replace("|", ",").split(","):
        if entry.startswith("https://"):
            return entry.rstrip("/")
    return GO_PROXY_DEFAULT


def _staging_replaces(version: str) -> list[str]:
    """k8s.io/<staging> modules that kubernetes' go.mod requires at v0.0.0."""
    text = _fetch_text(f"{_proxy()}/k8s.io/kubernetes/@v/{version}.mod")
    modules = []
    for raw in text.splitlines():
        fields = raw.split()
        if len(fields) == 2 and fields[0].startswith("k8s.io/") and fields[1] == "v0.0.0":
            modules.append(fields[0])
    if not modules:
        raise BinariesError(
            f"found no k8s.io/* v0.0.0 requirements in k8s.io/kubernetes@{version}'s go.mod"
        )
    return sorted(set(modules))


def _scratch(name: str, version: str) -> Path:
    work = bin_dir() / ".build" / f"{name}-{version}"
    work.mkdir(parents=True, exist_ok=True)
    return work


def _install(built: Path, name: str) -> Path:
    target = bin_dir() / name
    built.chmod(0o755)
    built.replace(target)  # same file system: the scratch dir lives inside the bin dir
    _stamp(bin_dir(), name).write_text(PINS[name] + "\n")
    return target


def build_kubernetes_command(name: str) -> Path:
    """Build k8s.io/kubernetes/cmd/<name> (kube-apiserver, kube-scheduler,
    kube-controller-manager, kubectl, kubelet)."""
    go = _go()
    version = PINS[name]
    staging = "v0" + version[2:]
    work = _scratch(name, version)
    logfile = work / "build.log"
    logfile.write_text("")
    lines = [
        f"module edl.local/build/{name}",
        "",
        "go 1.23.0",
        "",
        f"require k8s.io/kubernetes {version}",
        "",
    ]
    lines += [f"replace {mod} => {mod} {staging}" for mod in _staging_replaces(version)]
    (work / "go.mod").write_text("\n".join(lines) + "\n")
    (work / "doc.go").write_text("package build\n")
    what = f"{name} {version}"
    pkg = f"k8s.io/kubernetes/cmd/{name}"
    major, minor = version[1:].split(".")[:2]
    stamps = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    # kubectl reports its version from client-go's copy of the version package.
    version_pkgs = ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"]
    ldflags = " ".join(
        ["-s -w"]
        + [f"-X {pkg_}.{key}={value}" for pkg_ in version_pkgs for key, value in stamps.items()]
    )
    log(
        f"building {what} from the Go module proxy "
        f"(kube-apiserver about 4-5 min on 2 cores with cold Go caches, the others less once "
        f"it is built; log {logfile})"
    )
    with heartbeat(what):
        run_logged([go, "get", f"{pkg}@{version}"], cwd=work, logfile=logfile, what=what)
        run_logged(
            [
                go,
                "build",
                "-trimpath",
                "-tags",
                "selinux,notest",
                "-ldflags",
                ldflags,
                "-o",
                name,
                pkg,
            ],
            cwd=work,
            logfile=logfile,
            what=what,
        )
    return _install(work / name, name)


def build_etcd() -> Path:
    go = _go()
    work = _scratch("etcd", ETCD_VERSION)
    logfile = work / "build.log"
    logfile.write_text("")
    (work / "go.mod").write_text("module edl.local/build/etcd\n\ngo 1.22\n")
    (work / "doc.go").write_text("package build\n")
    what = f"etcd {ETCD_VERSION}"
    pkg = "go.etcd.io/etcd/server/v3"
    log(
        f"building {what} from the Go module proxy (1.5-2.5 min with cold Go caches; log {logfile})"
    )
    with heartbeat(what):
        run_logged([go, "get", f"{pkg}@{ETCD_VERSION}"], cwd=work, logfile=logfile, what=what)
        run_logged(
            [go, "build", "-trimpath", "-ldflags", "-s -w", "-o", "etcd", pkg],
            cwd=work,
            logfile=logfile,
            what=what,
        )
    return _install(work / "etcd", "etcd")


def _kwok_module_dir(go: str, logfile: Path) -> Path:
    result = subprocess.run(
        [go, "mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK_VERSION}"],
        cwd=bin_dir(),
        env={**_go_env(), "GO111MODULE": "on", "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
        check=False,
    )
    with logfile.open("a") as out:
        out.write(result.stdout + result.stderr)
    try:
        directory = Path(json.loads(result.stdout)["Dir"])
    except (ValueError, KeyError) as exc:
        raise BinariesError(
            f"could not locate the kwok {KWOK_VERSION} module source for its stages "
            f"(`go mod download` said: {result.stderr.strip() or result.stdout.strip()})"
        ) from exc
    return directory


def build_kwok() -> Path:
    go = _go()
    work = _scratch("kwok", KWOK_VERSION)
    logfile = work / "build.log"
    logfile.write_text("")
    what = f"kwok {KWOK_VERSION}"
    log(f"building {what} with `go install` (1.5-2.5 min with cold Go caches; log {logfile})")
    ldflags = f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={KWOK_VERSION[1:]}"
    package = f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}"
    return _go_install(go, package, ldflags, work=work, what=what, name="kwok")


def _go_install(go: str, package: str, ldflags: str, *, work: Path, what: str, name: str) -> Path:
    """`go install PACKAGE` into WORK/bin with these linker flags, then into the bin dir."""
    gobin = work / "bin"
    gobin.mkdir(exist_ok=True)
    with heartbeat(what):
        run_logged(
            [go, "install", "-trimpath", "-ldflags", ldflags, package],
            cwd=work,
            logfile=work / "build.log",
            what=what,
            env={"GOBIN": str(gobin)},
        )
    return _install(gobin / name, name)


def copy_kwok_stages() -> Path:
    go = _go()
    work = _scratch("kwok", KWOK_VERSION)
    source = _kwok_module_dir(go, work / "build.log") / "kustomize" / "stage"
    documents = []
    for rel in KWOK_STAGES:
        path = source / rel
        if not path.is_file():
            raise BinariesError(f"kwok {KWOK_VERSION} module lacks the stage file {path}")
        documents.append(f"# from sigs.k8s.io/kwok@{KWOK_VERSION} kustomize/stage/{rel}\n")
        documents.append(path.read_text().strip() + "\n---\n")
    target = bin_dir() / STAGES_FILE
    target.write_text("".join(documents))
    _stamp(bin_dir(), STAGES_FILE).write_text(KWOK_VERSION + "\n")
    log(f"copied {len(KWOK_STAGES)} kwok stages to {target}")
    return target


def build_fake_cri() -> Path:
    """scripts/fakecri: kubelet's container runtime in tests (k8s.io/cri-client's fake, logging
    every CreateContainer and making containers exit on request)."""
    go = _go()
    work = _scratch(FAKE_CRI, "src")
    logfile = work / "build.log"
    logfile.write_text("")
    what = f"the fake container runtime ({FAKE_CRI_SOURCE})"
    log(f"building {what} (about 1 min with cold Go caches; log {logfile})")
    with heartbeat(what):
        run_logged(
            [go, "build", "-trimpath", "-ldflags", "-s -w", "-o", str(work / FAKE_CRI), "."],
            cwd=FAKE_CRI_SOURCE,
            logfile=logfile,
            what=what,
        )
    return _install(work / FAKE_CRI, FAKE_CRI)


def _required_version(module: str, version: str, requirement: str) -> str:
    """The version of ``requirement`` that ``module``@``version``'s go.mod asks for."""
    text = _fetch_text(f"{_proxy()}/{module}/@v/{version}.mod")
    for raw in text.splitlines():
        fields = raw.split()
        if fields[:1] == ["require"]:  # a one-line `require path version`
            fields = fields[1:]
        if len(fields) >= 2 and fields[0] == requirement:
            return fields[1]
    raise BinariesError(f"{module}@{version}'s go.mod does not require {requirement}")


def build_helm() -> Path:
    """helm.sh/helm/v3/cmd/helm, stamped as helm's Makefile stamps a release: its version, and the
    Kubernetes minor its client-go is for, which `helm template` reports as
    .Capabilities.KubeVersion and `helm lint` checks deprecated APIs against."""
    go = _go()
    work = _scratch(HELM, HELM_VERSION)
    logfile = work / "build.log"
    logfile.write_text("")
    what = f"helm {HELM_VERSION}"
    client_go = _required_version(HELM_MODULE, HELM_VERSION, "k8s.io/client-go")  # v0.37.0
    kube_minor = client_go.split(".")[1]
    stamps = {
        "internal/version.version": HELM_VERSION,
        "internal/version.gitTreeState": "clean",
        "pkg/chartutil.k8sVersionMajor": "1",
        "pkg/chartutil.k8sVersionMinor": kube_minor,
        "pkg/lint/rules.k8sVersionMajor": "1",
        "pkg/lint/rules.k8sVersionMinor": kube_minor,
    }
    ldflags = " ".join(
        ["-s -w"] + [f"-X {HELM_MODULE}/{var}={value}" for var, value in stamps.items()]
    )
    log(f"building {what} with `go install` (about 1.5 min with cold Go caches; log {logfile})")
    package = f"{HELM_MODULE}/cmd/helm@{HELM_VERSION}"
    return _go_install(go, package, ldflags, work=work, what=what, name=HELM)


def _module_dir(go: str, module: str, version: str, work: Path) -> Path:
    """Where the Go module cache keeps ``module``@``version``'s source (downloaded if needed)."""
    result = subprocess.run(
        [go, "mod", "download", "-json", f"{module}@{version}"],
        cwd=work,
        env={**_go_env(), "GO111MODULE": "on", "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return Path(json.loads(result.stdout)["Dir"])
    except (ValueError, KeyError) as exc:
        raise BinariesError(
            f"could not locate the source of {module}@{version} "
            f"(`go mod download` said: {result.stderr.strip() or result.stdout.strip()})"
        ) from exc


def _copy_manifests(name: str, source: Path) -> Path:
    """``config/components/crd/bases/*.yaml`` and ``config/components/webhook/`` of a
    controller's module into ``<name>-manifests/``."""
    target = bin_dir() / f"{name}-manifests"
    shutil.rmtree(target, ignore_errors=True)
    crds = sorted((source / "config" / "components" / "crd" / "bases").glob("*.yaml"))
    webhook = source / "config" / "components" / "webhook"
    if not crds or not (webhook / "manifests.yaml").is_file():
        raise BinariesError(f"{source} lacks config/components/crd/bases or webhook/manifests.yaml")
    (target / "crd").mkdir(parents=True)
    for path in crds:
        shutil.copyfile(path, target / "crd" / path.name)
    shutil.copytree(webhook, target / "webhook")
    for path in target.rglob("*"):  # the module cache's files are read-only
        path.chmod(0o755 if path.is_dir() else 0o644)
    (target / ".version").write_text(PINS[name] + "\n")
    return target


def build_controller(name: str) -> Path:
    """A controller of CONTROLLER_MODULES (JobSet's, Kueue's): `go get` its module at the pinned
    version into a scratch module, `go build` its main package, copy its manifests."""
    go = _go()
    module, version, package = CONTROLLER_MODULES[name]
    work = _scratch(name, version)
    logfile = work / "build.log"
    logfile.write_text("")
    (work / "go.mod").write_text(f"module edl.local/build/{name}\n\ngo 1.26.0\n")
    (work / "doc.go").write_text("package build\n")
    what = f"{name} {version}"
    # `go install module@version` reads the proxy's @v/list for deprecations, which some
    # proxies refuse; `go get` then `go build` in a scratch module does not.
    log(f"building {what} from the Go module proxy (3-6 min with cold Go caches; log {logfile})")
    with heartbeat(what):
        # The main package, not only the module: its imports' go.sum entries come with it.
        run_logged([go, "get", f"{package}@{version}"], cwd=work, logfile=logfile, what=what)
        ldflags = f"-s -w -X {module}/pkg/version.GitVersion={version}"
        run_logged(
            [go, "build", "-trimpath", "-ldflags", ldflags, "-o", name, package],
            cwd=work,
            logfile=logfile,
            what=what,
        )
    _copy_manifests(name, _module_dir(go, module, version, work))
    return _install(work / name, name)


BUILDERS: dict[str, Callable[[], Path]] = (
    {
        "etcd": build_etcd,
        "kwok": build_kwok,
        FAKE_CRI: build_fake_cri,
        HELM: build_helm,
    }
    | {name: functools.partial(build_kubernetes_command, name) for name in KUBERNETES_COMMANDS}
    | {name: functools.partial(build_controller, name) for name in CONTROLLER_MODULES}
)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    lock_path = bin_dir() / ".lock"
    with lock_path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another k8s-binaries run to finish ({lock_path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure(names: tuple[str, ...] = BINARIES) -> dict[str, Path]:
    """Make ``names`` (default: every binary) available, and kwok's stages when kwok is among
    them; build what is missing."""
    directory = bin_dir()
    directory.mkdir(parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    timings: dict[str, float] = {}
    with _lock():
        for name in names:
            path = find(name)
            if path is not None:
                log(f"{name} {PINS[name]}: using {path}")
                found[name] = path
                continue
            started = time.monotonic()
            found[name] = BUILDERS[name]()
            timings[name] = time.monotonic() - started
            log(f"{name} {PINS[name]}: built {found[name]} in {timings[name]:.0f}s")
        if "kwok" in names and stages_file() is None:
            copy_kwok_stages()
    if timings:
        summary = ", ".join(f"{name} {secs:.0f}s" for name, secs in timings.items())
        log(f"build times: {summary}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/k8s-binaries",
        description=(
            f"Provide etcd {ETCD_VERSION}, kube-apiserver, kube-scheduler, "
            f"kube-controller-manager, kubectl and kubelet "
            f"{K8S_VERSION}, kwok {KWOK_VERSION} (plus kwok's stage files), helm {HELM_VERSION}, "
            f"JobSet's controller {JOBSET_VERSION} and Kueue's manager {KUEUE_VERSION} (with their "
            "CRDs and webhook configurations) "
            f"and our fake container runtime (scripts/fakecri) for the test control plane, "
            f"kubelet nodes and the Helm chart in {bin_dir()} (override with EDL_K8S_BIN_DIR; "
            "etcd, kube-apiserver and kubectl are also taken from $KUBEBUILDER_ASSETS). "
            "Missing ones are built from "
            "the Go module proxy; the first build of all takes about 20 minutes on 2 cores."
        ),
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"only these ({', '.join(BINARIES)}); default: all",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print-dir", action="store_true", help="print the bin dir; build nothing")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if anything is missing; build nothing"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(BINARIES))
    if unknown:
        parser.error(f"unknown binary {', '.join(unknown)} (choose from {', '.join(BINARIES)})")
    names = tuple(args.names) or BINARIES
    status = 0
    if args.check:
        absent = missing(names)
        if absent:
            log(f"missing in {bin_dir()}: {', '.join(absent)}; run scripts/k8s-binaries")
            status = 1
    elif not args.print_dir:
        try:
            ensure(names)
        except BinariesError as exc:
            log(f"ERROR: {exc}")
            status = 1
    if status == 0:
        print(bin_dir())
    return status


if __name__ == "__main__":
    raise SystemExit(main())
