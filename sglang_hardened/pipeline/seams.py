"""The seam rule, checked: a vendor patch adds calls into the runtime layer, and little else.

Upstream files carry thin seams (an import, a call, its arguments) so that the
hardening logic is written and tested once in ``sglang_hardened/runtime`` and a
rebase has little to carry. What a seam may add besides is glue: a ``return`` or
``continue`` the call's answer decides, a line upstream's control flow needs. A
vendor patch adds at most GLUE_LINES_MAX such lines to any one upstream file;
backports (``Origin: backport``) keep upstream's own shape instead and are not held
to it. ``sglang-hardened verify`` fails a patch over the budget, naming the lines.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..common.table import markdown_table
from . import unidiff

GLUE_LINES_MAX = 3  # per vendor patch and upstream file
# A runtime line: the code (its comment aside) imports the runtime, or calls through an alias a
# seam imports it under (``hardened_<module>.f(``), not merely a line that mentions "hardened".
RUNTIME_LINE = re.compile(r"\bfrom sglang_hardened\.runtime import |\bhardened_\w+\.\w+")


def _inserted(hunk: unidiff.Hunk) -> list[tuple[int, int]]:
    """The spans of a hunk's new side that it adds (against its old side, as difflib matches them)."""
    ops = difflib.SequenceMatcher(a=hunk.old, b=hunk.new, autojunk=False).get_opcodes()
    return [(j1, j2) for tag, _, _, j1, j2 in ops if tag in ("insert", "replace")]


def added_runs(hunk: unidiff.Hunk) -> list[list[str]]:
    """Each run of lines a hunk adds."""
    return [hunk.new[j1:j2] for j1, j2 in _inserted(hunk)]


def _depth(line: str) -> int:
    return sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")


def glue_lines(diff: str) -> dict[str, list[str]]:
    """Per upstream file, the lines the diff adds that are not a runtime call or its arguments."""
    glue: dict[str, list[str]] = {}
    for fp in unidiff.parse(diff):
        for hunk in fp.hunks:
            open_call = 0  # brackets still open in a runtime call
            for raw in (line for run in added_runs(hunk) for line in run):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                if open_call > 0 or RUNTIME_LINE.search(line.split("#", 1)[0]):
                    open_call = max(0, open_call + _depth(line))
                else:
                    glue.setdefault(fp.target, []).append(line)
    return glue


def over_budget(origin: str, diff: str) -> dict[str, list[str]]:
    """The files where a vendor patch adds more glue than GLUE_LINES_MAX (none for a backport)."""
    if not origin.startswith("vendor"):
        return {}
    return {path: lines for path, lines in glue_lines(diff).items() if len(lines) > GLUE_LINES_MAX}


_IMPORT = re.compile(r"from sglang_hardened\.runtime import (\w+) as (hardened_\w+)")
_CALL = re.compile(r"\b(hardened_\w+)\.(\w+)")
_NEW_START = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)")


def _added(hunk: unidiff.Hunk) -> list[tuple[int, str]]:
    """Each line a hunk adds, with its index on the hunk's new side."""
    return [(j, hunk.new[j]) for j1, j2 in _inserted(hunk) for j in range(j1, j2)]


class _Aliases:
    """What each ``hardened_<x>`` alias names in each upstream file, across a series in order: a
    patch may call through an alias an earlier patch imported into the same file."""

    def __init__(self) -> None:
        self.modules: dict[tuple[str, str], str] = {}  # (upstream file, alias) -> runtime module

    def calls(self, target: str, line: str) -> list[str]:
        """Note the line's imports; the runtime functions (``module.function``) it calls."""
        for module, alias in _IMPORT.findall(line):
            self.modules[target, alias] = module
        return [f"{self.modules[target, alias]}.{fn}" for alias, fn in _CALL.findall(line)]


def runtime_seams(patches: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """Every runtime function a series' patches call, as ``module.function`` with the hardening
    ids of the patches that call it, from ``(hardening id, diff)`` pairs in series order.

    The one list of seams: runtime/seam_cost.py times exactly these. An alias names a module
    per upstream file (``hardened_tags`` is page_tags_seams in one, page_tags_nixl in another).
    """
    aliases, found = _Aliases(), {}
    for hardening_id, diff in patches:
        for fp in unidiff.parse(diff):
            for hunk in fp.hunks:
                for _, line in _added(hunk):
                    for seam in aliases.calls(fp.target, line):
                        found.setdefault(seam, set()).add(hardening_id)
    return found


@dataclass(frozen=True)
class Site:
    """One place a patch calls the runtime: docs/seams.md's row."""

    patch: str
    file: str  # the upstream file, relative to the wheel's root
    function: str  # the upstream function (``Class.method``) the call sits in; "(module)" at top level
    runtime: str  # ``module.function`` in sglang_hardened/runtime/


def _functions(text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function of a Python source."""
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno or child.lineno, name))
                visit(child, f"{name}.")

    visit(ast.parse(text), "")
    return found


def _enclosing(functions: list[tuple[int, int, str]], line: int) -> str:
    """The innermost function holding a line (1-based)."""
    holding = [(last - first, name) for first, last, name in functions if first <= line <= last]
    return min(holding)[1] if holding else "(module)"


class SiteIndex:
    """The seams of a series, patch by patch as it is applied: each call into the runtime with the
    upstream function it sits in, read off the file the patch leaves."""

    def __init__(self) -> None:
        self.sites: list[Site] = []
        self._aliases = _Aliases()

    def add(self, patch: str, diff: str, files: dict[str, str | None]) -> None:
        """Index one patch, given the upstream files as it left them."""
        for fp in unidiff.parse(diff):
            text = files.get(fp.target) or ""
            lines = text.splitlines(keepends=True)
            functions = _functions(text) if fp.target.endswith(".py") and text else []
            for hunk in fp.hunks:
                start = unidiff.locate(lines, hunk.new, int(_NEW_START.match(hunk.header).group(1)) - 1)
                for j, line in _added(hunk):
                    for seam in self._aliases.calls(fp.target, line):
                        where = _enclosing(functions, start + j + 1) if start is not None else "?"
                        site = Site(patch, fp.target, where, seam)
                        if site not in self.sites:
                            self.sites.append(site)


def index_markdown(by_base: dict[str, list[Site]]) -> str:
    """docs/seams.md: per base, every place a patch calls the runtime."""
    parts = [SEAMS_HEADER]
    for base, sites in by_base.items():
        parts.append(f"\n## {base}\n\n" + markdown_table(
            ("patch", "upstream file", "upstream function", "runtime function"),
            [(f"`{s.patch}`", f"`{s.file}`", f"`{s.function}`", f"`{s.runtime}`") for s in sites]) + "\n")
    return "".join(parts)


SEAMS_HEADER = """# The seams: where each patch calls the runtime

Every place a patch of a base's series calls into `sglang_hardened/runtime/`: the patch, the
upstream file and function the call sits in, and the runtime function it calls (the seam rule,
`sglang_hardened/pipeline/seams.py`, keeps everything else in a patch to a few lines of glue).
Written by `sglang-hardened verify --all --seams-index docs/seams.md`; `tests/integration/test_build.py`
fails when it is not current. `docs/hardening.md` says what each patch is for.
"""
