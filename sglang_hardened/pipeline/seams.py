"""The seam rule, checked: a vendor patch adds calls into the runtime layer, and little else.

Upstream files carry thin seams (an import, a call, its arguments) so that the
hardening logic is written and tested once in ``sglang_hardened/runtime`` and a
rebase has little to carry. What a seam may add besides is glue: a ``return`` or
``continue`` the call's answer decides, a line upstream's control flow needs. A
vendor patch adds at most GLUE_LINES_MAX such lines to any one upstream file;
backports (``Origin: backport``) keep upstream's own shape instead and are not held
to it. ``sglang-hardened verify`` fails a patch over the budget, naming the lines.

A runtime call is told from glue by its alias: a seam imports each runtime module once per
upstream file, as ``hardened_<module>`` (its dotted path under runtime joined by ``_``), and a
line counts as a runtime call only through an alias its file imported. One alias per module
makes a seam greppable across every patch and base; ``verify`` fails an import under any other
name, of anything but a runtime module (a package, a function, another library under a
``hardened_`` alias), and any other line that names the layer, naming the patch's line.

Lines are read as Python tokens, so a ``#`` or bracket inside a string neither ends a line's code
nor holds a call open; a line that does not tokenize alone, or that holds a ``;``, is glue.
"""

from __future__ import annotations

import ast
import difflib
import functools
import io
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..common.table import markdown_table
from . import unidiff

GLUE_LINES_MAX = 3  # per vendor patch and upstream file
RUNTIME = "sglang_hardened.runtime"
RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
# A line that is a runtime import: ``from sglang_hardened.runtime[.<package>] import <names>``, or
# any ``import sglang_hardened...`` (which the rule refuses: a seam imports one module, aliased).
_IMPORT = re.compile(r"from sglang_hardened\.runtime((?:\.\w+)*) import (.+)|import sglang_hardened\b.*")
_NAME = re.compile(r"(\w+) as (\w+)")
_HARDENED_ALIAS = re.compile(r"\bimport\b.*\bas hardened_\w")  # ``hardened_`` names runtime modules only
_BLANKED = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}  # 3.12 splits f-strings
_LAYOUT = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
_CALL = re.compile(r"(?<![\w.])(hardened_\w+)\.(\w+)")  # ``hardened_<module>.f``, not ``x.hardened_y.f``
_NEW_START = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)")


def alias_for(module: str) -> str:
    """The one alias every seam imports a runtime module under: ``hardened_`` and the module's
    dotted path under runtime joined by ``_`` (``page_tags.seams``: ``hardened_page_tags_seams``)."""
    return "hardened_" + module.replace(".", "_")


@functools.cache
def runtime_modules() -> frozenset[str]:
    """Every module of the runtime layer, as its dotted path under runtime (packages excluded:
    a seam calls a module's function, and its alias names that module)."""
    return frozenset(".".join(p.relative_to(RUNTIME_DIR).with_suffix("").parts)
                     for p in RUNTIME_DIR.rglob("*.py") if p.name != "__init__.py")


def _tokens(line: str) -> list[tokenize.TokenInfo] | None:
    """A line's tokens, layout dropped (None: it does not tokenize alone, as inside a string that
    spans lines). A bracket left open, or closed from an earlier line, is no error here."""
    found: list[tokenize.TokenInfo] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line.strip()).readline):
            if tok.type not in _LAYOUT:
                found.append(tok)
    except tokenize.TokenError as exc:
        if "statement" not in str(exc.args[0]):  # "EOF in multi-line statement": a bracket open
            return None
    except SyntaxError:
        return None
    return found


def _code(line: str) -> str | None:
    """A line's code: its comment dropped and each string blanked to ``""``, so neither a comment
    nor a string that names the layer or holds a ``#`` or a bracket changes how it is read (None:
    it does not tokenize alone)."""
    if (tokens := _tokens(line)) is None:
        return None
    text, parts, end = line.strip(), [], 0
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            break
        parts += [text[end:tok.start[1]], '""' if tok.type in _BLANKED else tok.string]
        end = tok.end[1]
    return "".join(parts)


def _names_layer(line: str) -> bool:
    """Whether a line's code or strings (not its comment) name the hardening package."""
    if (tokens := _tokens(line)) is None:
        return "sglang_hardened" in line
    return any("sglang_hardened" in tok.string for tok in tokens if tok.type != tokenize.COMMENT)


def _runtime_import(code: str | None) -> re.Match[str] | None:
    """The line's code read as a runtime import, when it is nothing but that."""
    return _IMPORT.fullmatch(code) if code is not None and ";" not in code else None


def _imports(code: str | None) -> tuple[list[tuple[str, str]], str | None]:
    """The (runtime module, alias) pairs a line of code imports when it is nothing but a runtime
    import, and what breaks the alias rule there (None: nothing)."""
    if not (found := _runtime_import(code)):
        return [], None
    if found.group(2) is None:
        return [], f"`{code}`: import a runtime module as `from {RUNTIME} import <module> as hardened_<module>`"
    package, pairs, faults = found.group(1), [], []
    for name in filter(None, (n.strip() for n in found.group(2).split(","))):
        module = f"{package[1:]}.{name.split()[0]}" if package else name.split()[0]
        alias = match.group(2) if (match := _NAME.fullmatch(name)) else None
        if module not in runtime_modules():
            faults.append(f"`{code}`: {RUNTIME}.{module} is no runtime module (a seam imports a module, "
                          "not a package or a function)")
        elif alias != alias_for(module):
            faults.append(f"`{code}`: {RUNTIME}.{module} must be imported as {alias_for(module)}")
        else:
            pairs.append((module, alias))
    return pairs, "; ".join(faults) or None


def _fault(line: str) -> str | None:
    """What breaks the alias rule in one added line (None: nothing)."""
    code = _code(line)
    if _runtime_import(code):
        return _imports(code)[1]
    if _names_layer(line):
        return f"`{line.strip()}`: a seam names {RUNTIME} only in its one import line"
    if code is not None and _HARDENED_ALIAS.search(code):
        return f"`{line.strip()}`: a `hardened_` alias names a runtime module, imported from {RUNTIME}"
    return None


def alias_faults(diff: str) -> list[tuple[int, str]]:
    """Each added line of a diff that breaks the alias rule (one runtime module per name, aliased
    ``alias_for(module)``, and the layer named nowhere else): its line number in the diff (1-based)
    and why."""
    faults = []
    for number, line in enumerate(diff.splitlines(), 1):
        if line.startswith("+") and not line.startswith("+++"):
            if (fault := _fault(line[1:])) is not None:
                faults.append((number, fault))
    return faults


def _inserted(hunk: unidiff.Hunk) -> list[tuple[int, int]]:
    """The spans of a hunk's new side that it adds (against its old side, as difflib matches them)."""
    ops = difflib.SequenceMatcher(a=hunk.old, b=hunk.new, autojunk=False).get_opcodes()
    return [(j1, j2) for tag, _, _, j1, j2 in ops if tag in ("insert", "replace")]


def added_runs(hunk: unidiff.Hunk) -> list[list[str]]:
    """Each run of lines a hunk adds."""
    return [hunk.new[j1:j2] for j1, j2 in _inserted(hunk)]


def _added(hunk: unidiff.Hunk) -> list[tuple[int, str]]:
    """Each line a hunk adds, with its index on the hunk's new side."""
    return [(j, hunk.new[j]) for j1, j2 in _inserted(hunk) for j in range(j1, j2)]


class Aliases:
    """What each ``hardened_<module>`` alias names in each upstream file, across a series in order:
    a patch may call through an alias an earlier patch imported into the same file."""

    def __init__(self) -> None:
        self.modules: dict[tuple[str, str], str] = {}  # (upstream file, alias) -> runtime module

    def note(self, diff: str) -> list[unidiff.FilePatch]:
        """Note the aliases a patch imports (before its calls are read: imports head a file);
        returns the patch, parsed."""
        parsed = unidiff.parse(diff)
        for fp in parsed:
            for hunk in fp.hunks:
                for _, line in _added(hunk):
                    for module, alias in _imports(_code(line))[0]:
                        self.modules[fp.target, alias] = module
        return parsed

    def calls(self, target: str, line: str) -> list[str]:
        """The runtime functions (``module.function``) a line of ``target`` calls through its aliases."""
        code = _code(line)
        if code is None or ";" in code:
            return []
        return [f"{self.modules[target, alias]}.{fn}" for alias, fn in _CALL.findall(code)
                if (target, alias) in self.modules]


def _depth(code: str) -> int:
    """The brackets a line's code leaves open (negative: closes), its strings already blanked."""
    return sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")


def glue_lines(diff: str, aliases: Aliases | None = None) -> dict[str, list[str]]:
    """Per upstream file, the lines the diff adds that are not a runtime import, a call through an
    alias the file imports (``aliases``: the series' so far; by default the diff's own) or its
    arguments."""
    aliases = aliases or Aliases()
    glue: dict[str, list[str]] = {}
    for fp in aliases.note(diff):
        for hunk in fp.hunks:
            open_call = 0  # brackets still open in a runtime call
            for raw in (line for run in added_runs(hunk) for line in run):
                line, code = raw.strip(), _code(raw)
                if code == "":  # blank, or only a comment
                    continue
                seam = _runtime_import(code) or (code is not None and ";" not in code and (
                    open_call > 0 or aliases.calls(fp.target, line)))
                if seam:
                    open_call = max(0, open_call + _depth(code))
                else:
                    glue.setdefault(fp.target, []).append(line)
    return glue


def over_budget(origin: str, diff: str, aliases: Aliases | None = None) -> dict[str, list[str]]:
    """The files where a vendor patch adds more glue than GLUE_LINES_MAX (none for a backport)."""
    if not origin.startswith("vendor"):
        return {}
    return {path: lines for path, lines in glue_lines(diff, aliases).items() if len(lines) > GLUE_LINES_MAX}


def runtime_seams(patches: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """Every runtime function a series' patches call, as ``module.function`` (the module's dotted
    path under runtime) with the hardening ids of the patches that call it, from
    ``(hardening id, diff)`` pairs in series order.

    The one list of seams: runtime/seam_cost.py times exactly these.
    """
    aliases, found = Aliases(), {}
    for hardening_id, diff in patches:
        for fp in aliases.note(diff):
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
        self.aliases = Aliases()

    def add(self, patch: str, diff: str, files: dict[str, str | None]) -> None:
        """Index one patch, given the upstream files as it left them."""
        for fp in self.aliases.note(diff):
            text = files.get(fp.target) or ""
            lines = text.splitlines(keepends=True)
            functions = _functions(text) if fp.target.endswith(".py") and text else []
            for hunk in fp.hunks:
                start = unidiff.locate(lines, hunk.new, int(_NEW_START.match(hunk.header).group(1)) - 1)
                for j, line in _added(hunk):
                    for seam in self.aliases.calls(fp.target, line):
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
