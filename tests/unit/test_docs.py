"""The docs follow the code: the README's table of bases and CHANGELOG.md the lock file and the
series; H-id ranges the list of ids; docs/operating.md's command table click's commands; backticked
paths, tests and constants the repository; and no doc cites a tracker number or an unknown commit."""

from __future__ import annotations

import ast
import functools
import re
import subprocess

import click
import pytest

from sglang_hardened.cli import main
from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from tests.harness import REPO, catalogue


def test_readme_bases_table_matches_lock_and_series(patches):
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (\d+\.\d+\.\d+\S*) \| (\S+) \|", readme, re.M)
    expected = [(b, hardened_version(b, load_series(patches, b).revision)) for b in load_lock(patches)]
    assert rows == expected


def test_changelog_has_a_section_for_every_revision_of_every_base_newest_first(patches):
    headings = re.findall(r"^## (.*)$", (REPO / "CHANGELOG.md").read_text(), re.M)
    for base in load_lock(patches):
        revisions = [int(n) for heading in headings
                     for b, n in re.findall(r"(\d+\.\d+\.\d+)\+hardened\.(\d+)", heading) if b == base]
        newest = load_series(patches, base).revision
        assert revisions == list(range(newest, 0, -1)), (base, revisions)


# --- the docs against the code: H-id ranges, the command table, names, references ---

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
RANGE = re.compile(r"\bH(\d+)\s*[-–]\s*H(\d+)\b")
# Names the docs quote from upstream SGLang, the kernel or pytest: not this repository's to define.
FOREIGN = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "SGLANG_IS_IN_CI", "KV_STATUS", "STAGING_RSP",
           "CAP_IPC_LOCK", "CAP_SYS_NICE", "RLIMIT_MEMLOCK", "PYTEST_ADDOPTS"}
# This repository's folders a backticked path may start with (``runtime/x.py``: under sglang_hardened/).
OURS = ("sglang_hardened/", "tests/", "docs/", "patches/", "deploy/", "scripts/", "benchmarks/", "ci/", ".github/")
LAYERS = ("runtime/", "pipeline/", "operations/", "sandbox/", "lb/", "model/", "image/")
TRACKER = re.compile(r"(?<![\w/\[&])#\d+(?:\.\d+)?\b")  # "#45", "#21.5"; not sgl-project/sglang#N, [#N](url)
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w-])")


@functools.cache
def _docstrings() -> list[tuple[str, str]]:
    """(where, text) of every module, class and function docstring of the package, its tests and
    benchmarks."""
    found = []
    for path in sorted(p for folder in ("sglang_hardened", "tests", "benchmarks") for p in (REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if (doc := ast.get_docstring(node)) is not None:
                    found.append((f"{path.relative_to(REPO)}:{getattr(node, 'name', '')}", doc))
    return found


def _texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(REPO)), p.read_text()) for p in DOCS] + _docstrings()


def test_an_h_id_range_is_within_the_list_and_one_from_h0_names_every_id():
    last = len(catalogue()) - 1
    wrong = [(where, m.group(0)) for where, text in _texts() for m in RANGE.finditer(text)
             if not int(m.group(1)) < int(m.group(2)) <= last or (m.group(1) == "0" and int(m.group(2)) != last)]
    assert not wrong, f"the ids run H0-H{last}: {wrong}"


def _leaves(command: click.Command, path: tuple[str, ...] = ()) -> set[str]:
    if isinstance(command, click.Group):
        return {leaf for name, sub in command.commands.items() for leaf in _leaves(sub, (*path, name))}
    return {" ".join(path)}


def test_operating_md_command_table_is_every_command_click_has():
    text = (REPO / "docs" / "operating.md").read_text().split("## The commands", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `sglang-hardened ([^`]*)` \|", text, re.M)
    named = {" ".join(re.match(r"[a-z][a-z-]*(?: [a-z][a-z-]*)*", row).group(0).split()) for row in rows}
    assert named == _leaves(main)


def _names(token: str) -> list[str]:
    """What a backticked token claims exists here: a path (``x.py::fn`` too), test names, constants."""
    path = re.fullmatch(r"([\w./-]+\.(?:py|md|toml|yaml|yml|json|sh|txt|patch))(?:::(\w+))?", token)
    if path:
        return [token] if "/" in path.group(1) and path.group(1).startswith(OURS + LAYERS) else []
    return [*re.findall(r"\btest_\w+", token), *re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", token)]


def _exists(name: str, corpus: set[str], tests: str) -> bool:
    if "." in name:  # a path, maybe with ::function
        file, _, function = name.partition("::")
        found = next((REPO / p for p in (file, f"sglang_hardened/{file}", f"tests/{file}") if (REPO / p).exists()),
                     None)
        return found is not None and (not function or re.search(rf"def {function}\b", found.read_text()) is not None)
    if name.startswith("test_"):
        return re.search(rf"\b{name}", tests) is not None  # a prefix where the doc elides the rest
    return name in FOREIGN or name in corpus


def test_backticked_paths_tests_and_constants_exist_in_the_repository():
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    code = [REPO / f for f in listed if (REPO / f).suffix in (".py", ".toml", ".yaml", ".yml", ".patch", "")
            and (REPO / f).is_file()]
    corpus = {word for p in code for word in re.findall(r"\w+", p.read_bytes().decode(errors="replace"))}
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py")) + "\n".join(
        p.stem for p in (REPO / "tests").rglob("*.py"))
    missing = [(str(doc.relative_to(REPO)), name) for doc in DOCS
               for token in re.findall(r"`([^`\n]+)`", doc.read_text())
               for name in _names(token.strip().rstrip("…*")) if not _exists(name, corpus, tests)]
    assert not missing, missing


def test_no_tracker_numbers_in_docs_or_docstrings():
    found = [(where, m.group(0)) for where, text in _texts() for m in TRACKER.finditer(text)]
    assert not found, f"say what the work was, not its number: {found}"


def test_a_commit_the_docs_cite_is_in_this_repositorys_history():
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
    if shallow != "false":
        pytest.skip("a shallow clone: the history to look the commits up in is not here")
    cited = {(where, m.group(0)) for where, text in _texts() for m in COMMIT.finditer(text)}
    missing = [(where, c) for where, c in sorted(cited) if subprocess.run(
        ["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=REPO, capture_output=True).returncode]
    assert not missing, missing
