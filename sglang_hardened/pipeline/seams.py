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

import difflib
import re
from collections.abc import Iterable

from . import unidiff

GLUE_LINES_MAX = 3  # per vendor patch and upstream file
RUNTIME_MARK = "hardened"  # every seam imports the runtime as ``hardened_<module>`` (or names sglang_hardened)


def added_runs(hunk: unidiff.Hunk) -> list[list[str]]:
    """Each run of lines a hunk adds (its new side against its old, as difflib matches them)."""
    ops = difflib.SequenceMatcher(a=hunk.old, b=hunk.new, autojunk=False).get_opcodes()
    return [hunk.new[j1:j2] for tag, _, _, j1, j2 in ops if tag in ("insert", "replace")]


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
                if open_call > 0 or RUNTIME_MARK in line:
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


def runtime_seams(patches: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """Every runtime function a series' patches call, as ``module.function`` with the hardening
    ids of the patches that call it, from ``(hardening id, diff)`` pairs in series order.

    The one list of seams: runtime/seam_cost.py times exactly these. An alias names a module
    per upstream file (``hardened_tags`` is page_tags_seams in one, page_tags_nixl in another),
    and a patch may call through an alias an earlier patch imported into the same file.
    """
    aliases: dict[tuple[str, str], str] = {}  # (upstream file, alias) -> runtime module
    calls: list[tuple[str, str, str, str]] = []  # (id, upstream file, alias, function)
    for hardening_id, diff in patches:
        for fp in unidiff.parse(diff):
            for line in (line for hunk in fp.hunks for run in added_runs(hunk) for line in run):
                for module, alias in _IMPORT.findall(line):
                    aliases[fp.target, alias] = module
                calls += [(hardening_id, fp.target, alias, fn) for alias, fn in _CALL.findall(line)]
    found: dict[str, set[str]] = {}
    for hardening_id, target, alias, fn in calls:
        found.setdefault(f"{aliases[target, alias]}.{fn}", set()).add(hardening_id)
    return found
