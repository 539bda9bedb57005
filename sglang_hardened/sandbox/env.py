"""Per-base Python environments that run real SGLang on CPU.

Five bases share torch, triton and ~110 other pins (~3 GB), so they share one
venv; each base adds a small ``--target`` layer for the pins that differ, and
each SGLang wheel (upstream or hardened) is installed ``--no-deps`` into its
own ``--target`` dir. Every part is keyed on the hash of its inputs and
stamped when complete, so a rebuild happens only when an input changes.
Test-only CPU stand-ins (an overlay dir with ``edits.toml`` and ``site/``) are
applied to these environments, never to a wheel.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..common.errors import HardenedError
from ..common.hashing import sha256_file
from ..common.paths import cache_dir

PINS = Path(__file__).with_name("pins")
PYTHON_VERSION = "3.11"  # the upstream wheels are cp311


class SandboxError(RuntimeError):
    """A harness failure with a message meant for the user."""


def bases() -> list[str]:
    """Bases the sandbox has pins for."""
    return sorted(p.stem for p in PINS.glob("0.*.txt"))


def _check_base(base: str) -> None:
    if base not in bases():
        raise SandboxError(f"unknown base {base!r}: the sandbox has pins for {', '.join(bases())}")


def _key(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Overlay:
    """Test-tree CPU stand-ins: importable modules (``site/``) and source edits."""

    root: Path

    @property
    def site(self) -> Path:
        return self.root / "site"

    def edits(self) -> list[dict]:
        return tomllib.loads((self.root / "edits.toml").read_text())["edit"]

    def digest(self, of_sglang: bool) -> str:
        """Hash of the edits to SGLang's files, or to its dependencies' (``site/`` is used
        in place): a new SGLang edit must not rebuild the 3 GB shared venv. ``bases`` says
        where an edit must apply, not what it writes, so it is left out."""
        return _key(*(json.dumps({k: v for k, v in e.items() if k != "bases"}, sort_keys=True) for e in self.edits()
                      if e["file"].startswith("sglang/") == of_sglang))

    def meant_for(self, site: Path, base: str | None) -> list[dict]:
        """The edits that must apply to ``site``: those whose package it holds, on the bases
        an edit lists (every base when it lists none; ``base`` None, an environment every
        base shares: only edits that list none)."""
        return [e for e in self.edits() if (site / e["file"].split("/")[0]).is_dir() and base in e.get("bases", [base])]

    def apply(self, site: Path, base: str | None, build: str) -> list[str]:
        """Apply every edit meant for ``site``; return what was applied. An edit whose text is
        not there fails the build, naming it: instrumentation that silently did not apply
        would leave a build without its ledger or fault hooks, and its checks empty."""
        applied = []
        for e in self.meant_for(site, base):
            target = site / e["file"]
            text = target.read_text() if target.is_file() else ""
            if e["old"] not in text:
                raise SandboxError(f"overlay edit {e['why']!r} does not apply to {e['file']} in {build}: "
                                   f"{'its text is not there' if text else 'no such file'} (fix the edit, or its "
                                   f"`bases` in {self.root / 'edits.toml'})")
            target.write_text(text.replace(e["old"], e["new"]))
            applied.append(_label(e))
        return applied

    def check_applied(self, site: Path, base: str | None, build: str, applied: list[str]) -> None:
        """A cached environment's record of what was applied must be what is meant for it now."""
        missing = [_label(e) for e in self.meant_for(site, base) if _label(e) not in applied]
        if missing:
            raise SandboxError(f"{build} ({site}) was built without overlay edits meant for it: {missing}; "
                               "remove that folder to rebuild it")


def _label(edit: dict) -> str:
    return f"{edit['file']}: {edit['why']}"


@dataclass(frozen=True)
class SandboxEnv:
    """What a process needs to run one base: the interpreter and its path."""

    base: str
    python: Path
    path: tuple[Path, ...]  # PYTHONPATH, highest priority first

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(map(str, self.path))
        env.pop("PYTHONHOME", None)
        return env


def _python311() -> str:
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which(f"python{PYTHON_VERSION}")
    if not found:
        raise SandboxError(f"python{PYTHON_VERSION} is needed: the upstream wheels are cp311")
    return found


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SandboxError(f"{cmd[0]} … failed (rc={rc}); log {log}:\n{tail}")


def _built(dest: Path, key_inputs: dict[str, str], build) -> dict:
    """Build ``dest`` once per input hash: stamp when complete, lock against peers."""
    stamp = dest / ".sandbox-stamp.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file():
            return json.loads(stamp.read_text())
        shutil.rmtree(dest, ignore_errors=True)  # an interrupted build
        dest.mkdir()
        extra = build(dest) or {}
        info = {"inputs": key_inputs, **extra}
        stamp.write_text(json.dumps(info, indent=1, sort_keys=True))
        return info


def ensure_libibverbs() -> None:
    """Mooncake's engine links libibverbs even for TCP; install Debian's if missing."""
    probe = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libibverbs.so.1" in probe:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SandboxError("libibverbs1 is missing: install it (apt-get install libibverbs1)")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "libibverbs1"]):
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if r.returncode:
            raise SandboxError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def _pip(python: str, *args: str) -> list[str]:
    return [python, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check", *args]


def _common(overlay: Overlay, log: Path) -> Path:
    pins = PINS / "common.txt"
    key = _key(pins.read_bytes(), overlay.digest(of_sglang=False), PYTHON_VERSION)
    dest = cache_dir() / "envs" / f"common-{key}"

    def build(d: Path) -> dict:
        _run([_python311(), "-m", "venv", str(d)], log)
        py = str(d / "bin" / "python")
        _run(_pip(py, "-r", str(pins)), log)
        return {"overlay": overlay.apply(_site_packages(d), None, "the shared venv")}

    info = _built(dest, {"pins": str(pins), "overlay": str(overlay.root)}, build)
    overlay.check_applied(_site_packages(dest), None, "the shared venv", info.get("overlay", []))
    return dest


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{PYTHON_VERSION}" / "site-packages"


def _target(python: Path, name: str, key: str, args: list[str], overlay: Overlay, log: Path,
            base: str | None, build_name: str) -> Path:
    """A ``pip --target`` dir for ``args``, the overlay's edits meant for it applied (``base``,
    ``build_name``: which build it is, for the edits and their errors)."""
    dest = cache_dir() / "envs" / f"{name}-{key}"

    def build(d: Path) -> dict:
        _run(_pip(str(python), "--target", str(d), *args), log)
        return {"overlay": overlay.apply(d, base, build_name)}

    info = _built(dest, {"args": " ".join(args)}, build)
    overlay.check_applied(dest, base, build_name, info.get("overlay", []))
    return dest


def upstream_wheel(base: str, patches: Path | None = None) -> Path:
    """The pinned upstream wheel for ``base`` (downloaded once, sha256-checked), pinned by
    ``patches``' lock (default the checkout's tree)."""
    from ..common.paths import patches_dir
    from ..pipeline.fetch import fetch_wheel
    from ..pipeline.lock import load_lock

    pins = load_lock(patches or patches_dir())
    if base not in pins:
        raise SandboxError(f"unknown base {base!r}: upstream.lock pins {', '.join(pins)}")
    try:
        return fetch_wheel(pins[base])
    except HardenedError as e:
        raise SandboxError(str(e)) from e


def build_env(base: str, wheels: list[Path], overlay: Path) -> SandboxEnv:
    """Build (or reuse) the environment running ``wheels`` (SGLang first) for ``base`` on CPU."""
    _check_base(base)
    for wheel in wheels:
        if not wheel.is_file():
            raise SandboxError(f"no such wheel: {wheel}")
    ov = Overlay(overlay.resolve())
    if not (ov.root / "edits.toml").is_file():
        raise SandboxError(f"not an overlay dir (no edits.toml): {overlay}")
    ensure_libibverbs()
    logs = cache_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"build-{base}.log"
    common = _common(ov, log)
    python = common / "bin" / "python"
    layers = []
    for name, layer_base in ((base, base), ("nixl", None)):  # the base's own pins, then the NIXL backend (shared)
        pins = PINS / f"{name}.txt"
        layers.append(_target(python, f"layer-{name}", _key(pins.read_bytes(), ov.digest(of_sglang=False)),
                              ["-r", str(pins)], ov, log, layer_base, f"the {name} layer"))
    # SGLang and the tool each in a layer of its own: a runtime change reinstalls the small tool
    # layer, not SGLang (which the overlay edits)
    sglang = _target(python, "sglang", _key(sha256_file(wheels[0]), ov.digest(of_sglang=True)), [str(wheels[0])], ov,
                     log, base, f"the build of {wheels[0].name}")
    tools = [_target(python, "tool", _key(sha256_file(w)), [str(w)], ov, log, None, f"the tool {w.name}")
             for w in wheels[1:]]
    return SandboxEnv(base=base, python=python, path=(ov.site, sglang, *tools, *layers))


def with_load_generator(env: SandboxEnv) -> SandboxEnv:
    """``env`` with what SGLang's own load generator imports and no server needs (``datasets``,
    pins/bench.txt): a layer of its own, after the others, for benchmarks only."""
    ov = Overlay(default_overlay())
    pins = PINS / "bench.txt"
    log = cache_dir() / "logs" / f"build-{env.base}.log"
    layer = _target(env.python, "layer-bench", _key(pins.read_bytes(), ov.digest(of_sglang=False)),
                    ["-r", str(pins)], ov, log, None, "the load generator's layer")
    return SandboxEnv(base=env.base, python=env.python, path=(*env.path, layer))


def default_overlay() -> Path:
    """The test tree's CPU stand-ins, found from a source checkout."""
    root = Path(__file__).parents[2] / "tests" / "cpu_overlay"
    if not (root / "edits.toml").is_file():
        raise SandboxError("no tests/cpu_overlay beside this package: run from a source checkout or pass an overlay")
    return root


def overlay_module(name: str, overlay: Path | None = None) -> ModuleType:
    """A module of the CPU overlay's ``site/`` (test instrumentation every sandbox build
    imports), loaded from its file: its names (environment variables, thresholds) are read
    here from their one definition, and the tool's own environment has no ``site/`` on its path."""
    path = (overlay or default_overlay()) / "site" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheels_for(base: str, hardened: bool, without: tuple[str, ...] = (),
               patches: Path | None = None) -> list[Path]:
    """The wheels a sandbox installs: pinned upstream SGLang, or the hardened build
    of ``base`` (from ``patches``, default the checkout's) plus the tool wheel whose
    runtime layer its patches import.

    ``without`` leaves out the patches of those hardening ids, to show what the
    layers behind them do alone. Builds land in a directory named by their hashes,
    so concurrent runs (and checkouts) never replace a wheel another one installs, and
    a record named by the build's inputs (``inputs_digest``) lets the next ask for the
    same inputs skip the build: a fresh clone of an unchanged tree builds nothing.
    """
    if not hardened:
        return [upstream_wheel(base, patches)]
    from ..common.paths import patches_dir
    from ..pipeline.build import build, inputs_digest
    from ..pipeline.series import copy_without

    _check_base(base)
    root = cache_dir() / "hardened"
    (root / base).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{base}-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        try:
            patches = patches or patches_dir()
            if without:
                patches = copy_without(patches, base, without, Path(tmp) / "patches")
            record = root / base / f"inputs-{inputs_digest(patches, base)[:16]}.json"
            if cached := _recorded_build(record):
                return cached
            [result], tool = build([base], out, patches=patches)
        except HardenedError as e:
            raise SandboxError(f"hardened build of {base} failed: {e}") from e
        final = root / base / _key(sha256_file(result.wheel), sha256_file(tool))
        if not final.exists():
            try:
                os.rename(out, final)
            except OSError:
                if not final.exists():
                    raise
        wheels = [final / result.wheel.name, final / tool.name]
        staged = Path(tmp) / record.name
        staged.write_text(json.dumps([str(w.relative_to(root)) for w in wheels]))
        os.replace(staged, record)  # whole or absent: a reader never sees half a record
    return wheels


def _recorded_build(record: Path) -> list[Path] | None:
    """The wheels an earlier build from the same inputs left, if they are all still there."""
    try:
        wheels = [record.parent.parent / name for name in json.loads(record.read_text())]
    except (OSError, ValueError):
        return None
    return wheels if all(w.is_file() for w in wheels) else None
