"""Every SGLANG_HARDENED_* variable is declared once, in sglang_hardened/common/knobs.py: no name
in the repository escapes the registry, no code spells one again, and docs/operating.md's table
is the registry's."""

from __future__ import annotations

import ast
import functools
import re
import subprocess

import pytest

from sglang_hardened.common import knobs
from sglang_hardened.common.knobs import KNOBS, PREFIX, Limit
from sglang_hardened.runtime.policy import knob_value, knobs_markdown, limit, load_policy
from tests.harness import REPO

NAME = re.compile(rf"{PREFIX}[A-Z0-9_]*[A-Z0-9]")
REGISTRY = REPO / "sglang_hardened" / "common" / "knobs.py"
TABLE = re.compile(r"<!-- knobs -->\n(.*?)<!-- end knobs -->", re.S)


@functools.cache
def _files() -> list[str]:
    """The repository's files, committed or not (ignored ones aside)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


@functools.cache
def _text(path: str) -> str:
    return (REPO / path).read_bytes().decode(errors="replace")


def test_every_name_in_the_repository_is_declared():
    declared = {k.name for k in KNOBS}
    undeclared = sorted({(name, path) for path in _files() for name in NAME.findall(_text(path))
                         if name not in declared})
    assert not undeclared, f"declare each in sglang_hardened/common/knobs.py: {undeclared}"


def _spelled_in_code(tree: ast.AST) -> list[str]:
    """String literals (not docstrings) holding a variable's name."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and NAME.search(node.value)]


def test_code_reads_a_variable_through_its_declaration_never_by_its_name_again():
    spelled = {path: found for path in _files() if path.endswith(".py") and REPO / path != REGISTRY
               if (found := _spelled_in_code(ast.parse(_text(path))))}
    assert not spelled, spelled


def test_every_declaration_is_read_somewhere():
    imported = {alias.name for path in _files() if path.endswith(".py")
                for node in ast.walk(ast.parse(_text(path)))
                if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("common.knobs")
                for alias in node.names}
    outside = {name for path in _files() if not path.endswith(".py") and not path.startswith("docs/")
               for name in NAME.findall(_text(path))}
    unread = [k.name for k in KNOBS if k.name.removeprefix(PREFIX) not in imported and k.name not in outside]
    assert not unread, unread


def test_each_declaration_is_the_module_attribute_of_its_name():
    assert [getattr(knobs, k.name.removeprefix(PREFIX)) for k in KNOBS] == list(KNOBS)
    assert len({k.name for k in KNOBS}) == len(KNOBS)


def test_a_policy_default_is_the_number_policy_yaml_owns_and_launch_sets():
    for knob in KNOBS:
        if isinstance(knob.default, Limit):
            assert knob_value(knob, {}) == limit(knob.default), knob.name
    for entry in load_policy():
        declared = next((k for k in KNOBS if k.name == entry.env), None)
        if declared is not None:
            assert str(knob_value(declared, {})) == entry.value, entry.env


def test_the_image_sets_the_declared_health_port():
    assert f"ENV {knobs.HEALTH_PORT.name}={knobs.HEALTH_PORT.default}\n" in (REPO / "Dockerfile").read_text()


def test_operating_md_carries_the_registry_table():
    found = TABLE.search((REPO / "docs" / "operating.md").read_text())
    assert found, "docs/operating.md: no <!-- knobs --> ... <!-- end knobs --> block"
    assert found.group(1) == knobs_markdown() + "\n", "regenerate: sglang-hardened policy knobs --markdown"


@pytest.mark.parametrize(("knob", "value", "expected"), [
    (knobs.PAGE_TAGS, " OFF ", False), (knobs.PAGE_TAGS, "on", True),
    (knobs.ALLOW_EARLY_RELEASE, "1", True), (knobs.ALLOW_EARLY_RELEASE, "0", False),
    (knobs.HEALTH_PORT, "8080", 8080), (knobs.TRANSFER_LINK_RATE, "1e9", 1e9),
])
def test_a_value_reads_as_its_type(knob, value, expected):
    assert knob_value(knob, {knob.name: value}) == expected


@pytest.mark.parametrize(("knob", "value"), [(knobs.PAGE_TAGS, "of"), (knobs.PAGE_TAGS_COST_EVERY, "-1"),
                                             (knobs.TRANSFER_MAX_ENTRIES, "1k"), (knobs.TRANSFER_LINK_RATE, "fast"),
                                             (knobs.PAGE_TAGS_FAIL_CLOSED, "true")])  # a typo never turns a guarantee off
def test_a_value_its_type_refuses_stops_naming_the_knob(knob, value):
    with pytest.raises(ValueError, match=rf"{knob.name}='{re.escape(value)}': "):
        knob_value(knob, {knob.name: value})
