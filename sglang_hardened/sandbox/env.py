"""Per-base Python environments that run real SGLang on CPU, under a chosen Python.

Five bases share torch, triton and ~110 other pins (~3 GB), so they share one
venv per Python; each base adds a small ``--target`` layer for the pins that differ, and
each SGLang wheel (upstream or hardened) is installed ``--no-deps`` into its
own ``--target`` dir. Every part is keyed on the hash of its inputs and
stamped when complete, so a rebuild happens only when an input changes (the
Python is one: each part holds compiled code for its CPython).
Test-only CPU stand-ins (an overlay dir with ``edits.toml`` and ``site/``) are
applied to these environments, never to a wheel.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from ..common.errors import HardenedError
from ..common.hashing import sha256_file
from ..common.paths import cache_dir
from ..common.pythons import interpreter, runs_on

if TYPE_CHECKING:
    from ..pipeline.lock import UpstreamPin

PINS = Path(__file__).with_name("pins")
# The Pythons an environment can run, each with the pins file (in pins/) whose pins replace
# common.txt's of the same names (None: common.txt as it is). 3.11 is the default because
# common.txt's CPU-only torch is on this machine's index for cp311 only.
PYTHONS: dict[str, str | None] = {"3.11": None, "3.12": "torch-cuda.txt", "3.13": "torch-cuda.txt"}
DEFAULT_PYTHON = "3.11"


class SandboxError(RuntimeError):
    """A harness failure with a message meant for the user."""


def bases() -> list[str]:
    """Bases the sandbox has pins for."""
    return sorted(p.stem for p in PINS.glob("0.*.txt"))


def _check_base(base: str) -> None:
    if base not in bases():
        raise SandboxError(f"unknown base {base!r}: the sandbox has pins for {', '.join(bases())}")


def _check_python(python: str) -> None:
    if python not in PYTHONS:
        raise SandboxError(f"the sandbox runs Python {', '.join(PYTHONS)}, not {python!r}")


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

    @property
    def version(self) -> str:
        """The environment's Python (``3.12``), read from its venv: the one record of what built it."""
        cfg = (self.python.parent.parent / "pyvenv.cfg").read_text()
        return re.search(r"^version(?:_info)?\s*=\s*(\d+\.\d+)", cfg, re.M).group(1)

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(map(str, self.path))
        env.pop("PYTHONHOME", None)
        return env


def _interpreter(python: str) -> str:
    try:
        return interpreter(python)
    except HardenedError as e:
        raise SandboxError(f"{e} (the sandbox builds its Python {python} environments with it)") from e


def _pin_name(line: str) -> str | None:
    """The canonical name a pins line pins, or None for a blank or comment line."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    try:
        return canonicalize_name(Requirement(text).name)
    except InvalidRequirement as e:
        raise SandboxError(f"bad pins line {line!r}: {e}") from e


def common_pins(python: str) -> str:
    """The shared venv's pins for ``python``: common.txt, with its pins of the names that
    ``python``'s pins file pins replaced by that file's."""
    _check_python(python)
    common = (PINS / "common.txt").read_text()
    if PYTHONS[python] is None:
        return common
    own = (PINS / PYTHONS[python]).read_text()
    replaced = {_pin_name(line) for line in own.splitlines()} - {None}
    kept = [line for line in common.splitlines() if _pin_name(line) not in replaced]
    return "\n".join([*kept, f"# {PYTHONS[python]}, for Python {python}:", *own.splitlines()]) + "\n"


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


def _common(overlay: Overlay, log: Path, python: str) -> Path:
    pins = common_pins(python)
    key = _key(pins, overlay.digest(of_sglang=False), python)
    dest = cache_dir() / "envs" / f"common-{key}"
    what = f"the shared Python {python} venv"

    def build(d: Path) -> dict:
        _run([_interpreter(python), "-m", "venv", str(d)], log)
        (d / "sandbox-pins.txt").write_text(pins)
        _run(_pip(str(d / "bin" / "python"), "-r", str(d / "sandbox-pins.txt")), log)
        return {"overlay": overlay.apply(_site_packages(d, python), None, what)}

    info = _built(dest, {"pins": f"common.txt for Python {python}", "overlay": str(overlay.root)}, build)
    overlay.check_applied(_site_packages(dest, python), None, what, info.get("overlay", []))
    return dest


def _site_packages(venv: Path, python: str) -> Path:
    return venv / "lib" / f"python{python}" / "site-packages"


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


def _pin(base: str, patches: Path, python: str) -> UpstreamPin:
    """The upstream pin of ``base`` that Python ``python`` on this machine runs, by ``patches``' lock."""
    from ..pipeline.lock import load_wheels, pin_for

    _check_python(python)
    try:
        wheels = load_wheels(patches)
        if base not in wheels:
            raise SandboxError(f"unknown base {base!r}: upstream.lock pins {', '.join(wheels)}")
        return pin_for(wheels[base], runs_on(python))
    except HardenedError as e:
        raise SandboxError(str(e)) from e


def upstream_wheel(base: str, patches: Path | None = None, python: str = DEFAULT_PYTHON) -> Path:
    """The pinned upstream wheel of ``base`` for ``python`` (downloaded once, sha256-checked),
    pinned by ``patches``' lock (default the checkout's tree)."""
    from ..common.paths import patches_dir
    from ..pipeline.fetch import fetch_wheel

    pin = _pin(base, patches or patches_dir(), python)
    try:
        return fetch_wheel(pin)
    except HardenedError as e:
        raise SandboxError(str(e)) from e


def _check_wheel(wheel: Path, python: str) -> None:
    """A wheel of compiled code for another CPython cannot run in ``python``'s environment: say so
    before pip says "not a supported wheel" deep in a log."""
    if not wheel.is_file():
        raise SandboxError(f"no such wheel: {wheel}")
    built_for = {t.interpreter for t in parse_wheel_filename(wheel.name)[3] if t.interpreter.startswith("cp")}
    if built_for and runs_on(python).split()[0] not in built_for:
        raise SandboxError(f"{wheel.name} is built for {', '.join(sorted(built_for))}, not the environment's "
                           f"Python {python}: choose the Python it is built for, or its wheel for {python}")


def build_env(base: str, wheels: list[Path], overlay: Path, python: str = DEFAULT_PYTHON) -> SandboxEnv:
    """Build (or reuse) the environment running ``wheels`` (SGLang first) for ``base`` on CPU,
    under Python ``python``."""
    _check_base(base)
    _check_python(python)
    for wheel in wheels:
        _check_wheel(wheel, python)
    ov = Overlay(overlay.resolve())
    if not (ov.root / "edits.toml").is_file():
        raise SandboxError(f"not an overlay dir (no edits.toml): {overlay}")
    ensure_libibverbs()
    logs = cache_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"build-{base}.log"
    venv = _common(ov, log, python) / "bin" / "python"
    layers = []
    for name, layer_base in ((base, base), ("nixl", None)):  # the base's own pins, then the NIXL backend (shared)
        pins = PINS / f"{name}.txt"
        layers.append(_target(venv, f"layer-{name}", _key(pins.read_bytes(), ov.digest(of_sglang=False), python),
                              ["-r", str(pins)], ov, log, layer_base, f"the {name} layer"))
    # SGLang and the tool each in a layer of its own: a runtime change reinstalls the small tool
    # layer, not SGLang (which the overlay edits; its wheel is already one CPython's)
    sglang = _target(venv, "sglang", _key(sha256_file(wheels[0]), ov.digest(of_sglang=True)), [str(wheels[0])], ov,
                     log, base, f"the build of {wheels[0].name}")
    tools = [_target(venv, "tool", _key(sha256_file(w), python), [str(w)], ov, log, None, f"the tool {w.name}")
             for w in wheels[1:]]
    return SandboxEnv(base=base, python=venv, path=(ov.site, sglang, *tools, *layers))


def with_load_generator(env: SandboxEnv) -> SandboxEnv:
    """``env`` with what SGLang's own load generator imports and no server needs (``datasets``,
    pins/bench.txt): a layer of its own, after the others, for benchmarks only."""
    ov = Overlay(default_overlay())
    pins = PINS / "bench.txt"
    log = cache_dir() / "logs" / f"build-{env.base}.log"
    layer = _target(env.python, "layer-bench", _key(pins.read_bytes(), ov.digest(of_sglang=False), env.version),
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
               patches: Path | None = None, python: str = DEFAULT_PYTHON) -> list[Path]:
    """The wheels a sandbox installs under ``python``: the pinned upstream SGLang wheel for
    that Python, or the hardened build of it (from ``patches``, default the checkout's) plus
    the tool wheel whose runtime layer its patches import.

    ``without`` leaves out the patches of those hardening ids, to show what the
    layers behind them do alone. Builds land in a directory named by their hashes,
    so concurrent runs (and checkouts) never replace a wheel another one installs, and
    a record named by the build's inputs (``inputs_digest``) lets the next ask for the
    same inputs skip the build: a fresh clone of an unchanged tree builds nothing.
    """
    if not hardened:
        return [upstream_wheel(base, patches, python)]
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
            pin = _pin(base, patches, python)
            record = root / base / f"inputs-{inputs_digest(patches, base)[:16]}-{pin.runs_on.replace(' ', '-')}.json"
            if cached := _recorded_build(record):
                return cached
            [result], tool = build([base], out, patches=patches, choose=lambda pins: [pin])
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
