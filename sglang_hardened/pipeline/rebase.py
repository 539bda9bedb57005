"""Carry a base's patch series onto a newer upstream release, patch by patch.

Each patch is first applied as it is to the new release; if that fails, a
three-way merge (`git merge-file`: the old release before and after the patch,
against the new release) tells a change upstream already has from one that
conflicts. Only the files the series touches are read from either wheel.
"""

from __future__ import annotations

import datetime as dt
import difflib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..common.errors import HardenedError
from . import unidiff
from .fetch import fetch_wheel, pin_release
from .lock import UpstreamPin, add_pin, load_lock, load_wheels
from .series import SERIES_NAME, Patch, Series, load_series
from .unidiff import Files
from .wheelfile import read_members

APPLIES, OFFSET, MERGED, UPSTREAM, CONFLICT = (
    "applies", "applies with offset", "applies (3-way merge)", "already upstream", "conflict")
# Share of a patch's added code lines that must be in the new release for a
# conflicting patch to count as already upstream: a backport differs from
# upstream's change in a line or two where the old base lacked a helper.
PRESENT_SHARE = 0.9

@dataclass
class Verdict:
    """What happened to one patch, and its refreshed text when it still applies."""

    patch: Patch
    verdict: str
    detail: str = ""
    refreshed: str | None = None
    rejects: dict[str, str] = field(default_factory=dict)


@dataclass
class RebaseResult:
    source: str
    target: str
    wheels: list[UpstreamPin]  # every wheel of target, reference first
    verdicts: list[Verdict]

    @property
    def pin(self) -> UpstreamPin:
        """The target's reference wheel, which the carry is checked on."""
        return self.wheels[0]

    @property
    def clean(self) -> bool:
        return all(v.verdict != CONFLICT for v in self.verdicts)


def _merge3(current: str, base: str, other: str) -> tuple[str, bool]:
    """`git merge-file`: (merged text, clean?)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for label, text in (("new-upstream", current), ("old-upstream", base), ("patched", other)):
            path = Path(tmp) / label
            path.write_text(text)
            paths.append(str(path))
        run = subprocess.run(["git", "merge-file", "-p", "--diff3", "-L", "new upstream",
                              "-L", "old upstream", "-L", "patched", *paths],
                             capture_output=True, text=True)
    if run.returncode < 0 or run.returncode > 127:
        raise HardenedError(f"git merge-file failed: {run.stderr.strip()}")
    return run.stdout, run.returncode == 0


def make_diff(before: Files, after: Files) -> str:
    """A unified diff (a/ b/ prefixes, 3 lines of context) between two file sets."""
    out = []
    for name in sorted(after):
        old, new = before.get(name), after[name]
        if old == new:
            continue
        lines = difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            "/dev/null" if old is None else f"a/{name}", "/dev/null" if new is None else f"b/{name}")
        for line in lines:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def _header(patch: Patch, today: dt.date) -> str:
    """The patch's DEP-3 header as written, with Last-Update moved to the rebase date."""
    text = patch.path.read_text()
    head = text[: len(text) - len(patch.diff)]
    return head.replace(f"Last-Update: {patch.headers['Last-Update']}", f"Last-Update: {today}")


def _code_lines(lines: list[str]) -> list[str]:
    """Stripped lines that carry code (no blanks, no comments)."""
    return [t for t in (line.strip() for line in lines) if t and not t.startswith("#")]


def change_present(patch: Patch, new: Files) -> bool:
    """Whether upstream already made `patch`'s change, wherever it put it and however it
    worded the comments: every definition the patch adds is in the new release, and
    at least PRESENT_SHARE of its added code lines are."""
    for fp in unidiff.parse(patch.diff):
        added = _code_lines([line for h in fp.hunks for line in h.new if line not in h.old])
        have = set(_code_lines((new.get(fp.target) or "").splitlines()))
        if not added:
            continue
        missing = [line for line in added if line not in have]
        if any(line.startswith(("def ", "class ")) for line in missing):
            return False
        if len(missing) > (1 - PRESENT_SHARE) * len(added):
            return False
    return True


def carry(series: Series, old: Files, new: Files, today: dt.date) -> list[Verdict]:
    """Verdicts for each patch of `series`, carried from `old` files onto `new` files."""
    verdicts = []
    for patch in series.patches:
        old_after, _ = unidiff.apply_to_files(old, patch.diff)
        failure = ""
        try:
            new_after, results = unidiff.apply_to_files(new, patch.diff)
        except HardenedError as exc:
            results, failure = None, str(exc).split(": ", 1)[-1]
        if results is not None and not any(r.already_applied for r in results):
            offsets = [o for r in results for o in r.offsets if o]
            verdict = Verdict(patch, OFFSET if offsets else APPLIES,
                              f"offset {', '.join(map(str, offsets))}" if offsets else "")
        else:
            new_after, rejects = dict(new), {}
            for name in (n for n in old if old_after[n] != old[n]):
                merged, clean = _merge3(new[name] or "", old[name] or "", old_after[name] or "")
                if clean:
                    new_after[name] = merged
                else:
                    rejects[name] = merged
            if change_present(patch, new) if rejects else new_after == new:
                new_after = dict(new)
                verdict = Verdict(patch, UPSTREAM, "the change is present: dropped")
            elif rejects:
                verdict = Verdict(patch, CONFLICT, failure, rejects=rejects)
            else:
                verdict = Verdict(patch, MERGED)
        if verdict.verdict in (APPLIES, OFFSET, MERGED):
            verdict.refreshed = _header(patch, today) + make_diff(new, new_after)
            new = new_after
        old = old_after
        verdicts.append(verdict)
    return verdicts


def rebase(patches: Path, source: str, target: str, *, today: dt.date | None = None) -> RebaseResult:
    """Carry `source`'s series onto `target` (pinning `target` if the lock lacks it)."""
    pins = load_wheels(patches)
    if source not in pins:
        raise HardenedError(f"unknown base {source!r}; supported bases: {', '.join(pins)}")
    series = load_series(patches, source)
    wheels = pins.get(target) or pin_release(target, pins[source][0])
    names = {fp.target for p in series.patches for fp in unidiff.parse(p.diff)}
    old = read_members(fetch_wheel(pins[source][0]), names)
    new = read_members(fetch_wheel(wheels[0]), names)
    return RebaseResult(source, target, wheels, carry(series, old, new, today or dt.date.today()))


def write_series(patches: Path, result: RebaseResult, *, force: bool) -> Path:
    """Write `patches/<target>/` (and the lock entry) for a clean rebase; never clobber silently."""
    if not result.clean:
        raise HardenedError(f"rebase onto {result.target} has conflicts: nothing written")
    target_dir = patches / result.target
    if target_dir.exists() and not force:
        raise HardenedError(f"{target_dir} exists: pass --force to replace its series")
    staging = Path(tempfile.mkdtemp(dir=patches, prefix=f".{result.target}-"))
    try:
        lines = [f"# Patch series for sglang {result.target}, carried from {result.source} "
                 "by `sglang-hardened rebase`.", "# Revision: 1"]
        for v in result.verdicts:
            if v.verdict == UPSTREAM:
                lines.append(f"# dropped {v.patch.name}: Applied-Upstream: {result.target}")
            else:
                (staging / v.patch.name).write_text(v.refreshed)
                lines.append(v.patch.name)
        (staging / SERIES_NAME).write_text("\n".join(lines) + "\n")
        if target_dir.exists():
            shutil.rmtree(target_dir)
        os.replace(staging, target_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if result.target not in load_lock(patches):
        add_pin(patches, result.wheels)
    return target_dir


def write_rejects(result: RebaseResult, directory: Path) -> list[Path]:
    """Each conflicting file's three-way merge (with markers), for the human who resolves it."""
    written = []
    for v in result.verdicts:
        for name, text in v.rejects.items():
            path = directory / f"{v.patch.name}.{name.replace('/', '_')}.rej"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written
