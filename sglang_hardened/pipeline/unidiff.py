"""Apply unified diffs to a directory tree, hunk by hunk, with exact context.

Our own applier rather than `patch(1)`: errors must name the patch, file and
hunk; a dry run must touch nothing; and the rebase job needs to tell "applies
at an offset" and "already applied" apart from a conflict.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..common.errors import HardenedError

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
DEV_NULL = "/dev/null"
Files = dict[str, str | None]  # path -> text, None where the file does not exist


@dataclass
class Hunk:
    """One `@@` block: the lines it expects and the lines it leaves."""

    header: str
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    """All hunks for one file; `old`/`new` are paths with the a/ b/ prefix stripped."""

    old: str
    new: str
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.old if self.new == DEV_NULL else self.new


class HunkFailed(HardenedError):
    """A hunk whose context is not in the file: the series needs a human."""

    def __init__(self, file: str, number: int, hunk: Hunk, reason: str):
        self.file, self.number, self.hunk = file, number, hunk
        super().__init__(f"hunk #{number} ({hunk.header}) of {file} does not apply: {reason}")


def _strip(path: str) -> str:
    """The -p1 path of a header, refused unless it names a file inside the tree (a patch
    must not write outside the wheel it hardens)."""
    path = path.split("\t", 1)[0].strip()
    if path == DEV_NULL:
        return path
    if "/" not in path:
        raise HardenedError(f"patch path {path!r} has no a/ or b/ prefix to strip")
    rel = path.split("/", 1)[1]
    if not rel or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        raise HardenedError(f"patch path {path!r} is not a file inside the tree")
    return rel


def parse(diff: str) -> list[FilePatch]:
    """Parse a (git or plain) unified diff into file patches, -p1 paths."""
    files: list[FilePatch] = []
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip(line[4:]), _strip(lines[i + 1][4:])))
            i += 2
            continue
        match = _HUNK.match(line)
        if match:
            if not files:
                raise HardenedError(f"hunk before any file header: {line.strip()}")
            old_len = int(match.group(2) or 1)
            new_len = int(match.group(4) or 1)
            hunk = Hunk(line.strip(), int(match.group(1)))
            i += 1
            while (len(hunk.old) < old_len or len(hunk.new) < new_len) and i < len(lines):
                body = lines[i]
                tag, text = body[:1], body[1:]
                if tag == "\\":
                    _drop_newline(hunk, lines[i - 1][:1])
                elif tag in (" ", "\n"):
                    text = text if tag == " " else "\n"
                    hunk.old.append(text)
                    hunk.new.append(text)
                elif tag == "-":
                    hunk.old.append(text)
                elif tag == "+":
                    hunk.new.append(text)
                else:
                    raise HardenedError(f"malformed hunk {hunk.header}: line {body!r}")
                i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                _drop_newline(hunk, lines[i - 1][:1])
                i += 1
            if len(hunk.old) != old_len or len(hunk.new) != new_len:
                raise HardenedError(f"truncated hunk {hunk.header} in {files[-1].target}")
            files[-1].hunks.append(hunk)
            continue
        i += 1
    return files


def _drop_newline(hunk: Hunk, tag: str) -> None:
    """Honour '\\ No newline at end of file' for the side the previous line was on."""
    sides = {"-": [hunk.old], "+": [hunk.new], " ": [hunk.old, hunk.new]}[tag]
    for side in sides:
        side[-1] = side[-1].removesuffix("\n")


def locate(lines: list[str], block: list[str], expected: int) -> int | None:
    """Index of `block` in `lines` nearest to `expected`, or None."""
    if not block:
        return min(max(expected, 0), len(lines))
    limit = len(lines) - len(block)
    for distance in range(0, len(lines) + 1):
        for pos in {expected - distance, expected + distance}:
            if 0 <= pos <= limit and lines[pos:pos + len(block)] == block:
                return pos
        if expected - distance < 0 and expected + distance > limit:
            break
    return None


@dataclass
class FileResult:
    """What applying a file patch did: each hunk's offset from its stated line."""

    file: str
    offsets: list[int]
    already_applied: bool = False


def apply_file(root: Path, fp: FilePatch, *, write: bool) -> FileResult:
    """Apply one file patch under `root`; raise HunkFailed naming the hunk that does not fit."""
    path = root / fp.target
    if fp.old == DEV_NULL:
        if path.exists():
            raise HardenedError(f"{fp.target}: patch creates it, but it already exists")
        lines: list[str] = []
    else:
        if not path.is_file():
            raise HardenedError(f"{fp.target}: file to patch does not exist")
        lines = path.read_text().splitlines(keepends=True)
    offsets: list[int] = []
    delta = 0  # lines added minus removed by the hunks applied so far
    offset = 0  # where the last hunk was found, relative to where it said
    for number, hunk in enumerate(fp.hunks, 1):
        stated = max(hunk.old_start - 1, 0) + delta
        pos = locate(lines, hunk.old, stated + offset)
        if pos is None:
            if all(locate(lines, h.new, 0) is not None for h in fp.hunks):
                return FileResult(fp.target, [], already_applied=True)
            raise HunkFailed(fp.target, number, hunk, "context not found")
        offset = pos - stated
        offsets.append(offset)
        lines[pos:pos + len(hunk.old)] = hunk.new
        delta += len(hunk.new) - len(hunk.old)
    if write:
        if fp.new == DEV_NULL:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(lines))
    return FileResult(fp.target, offsets)


def apply(root: Path, diff: str, *, write: bool = True) -> list[FileResult]:
    """Apply a whole diff; with write=False nothing under `root` changes (dry run).

    A dry run checks every file independently against the tree as it is, so
    check a series with the tree patched by the earlier patches (see verify).
    """
    return [apply_file(root, fp, write=write) for fp in parse(diff)]


def apply_to_files(files: Files, diff: str) -> tuple[Files, list[FileResult]]:
    """Apply `diff` to in-memory files (through a scratch dir: one applier, one behaviour)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, text in files.items():
            if text is not None:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(text)
        results = apply(root, diff)
        after = {n: (root / n).read_text() if (root / n).is_file() else None for n in files}
    return after, results
