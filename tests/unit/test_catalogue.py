"""patches/hardening.toml is the one list of hardening ids: the patches' Hardening-Id headers,
the README's table, docs/hardening.md, the protocol model's switches, the metrics' refusal ids,
the knobs and the gate's claims all follow it."""

from __future__ import annotations

import ast
import re

import pytest

from sglang_hardened.common.knobs import KNOBS
from sglang_hardened.model.configs import Switch
from sglang_hardened.pipeline.catalogue import header_table, load_catalogue
from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.runtime.metrics import REFUSALS
from sglang_hardened.runtime.policy import load_policy
from tests.harness import REPO, catalogue

RUNTIME_IMPORT = re.compile(r"^\+.*from sglang_hardened\.runtime((?:\.\w+)*) import (\w+)", re.M)


@pytest.fixture(scope="module")
def items(patches):
    return load_catalogue(patches)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_the_harness_reads_its_ids_from_here(items):
    assert catalogue() == [i.id for i in items] == [f"H{n}" for n in range(len(items))]


def test_each_item_names_exactly_the_patches_and_bases_that_carry_its_id(items, patches):
    bases = list(load_lock(patches))
    carried: dict[str, dict[str, list[str]]] = {}  # id -> patch -> bases
    for base in bases:
        for patch in load_series(patches, base).patches:
            carried.setdefault(patch.headers["Hardening-Id"], {}).setdefault(patch.name.removesuffix(".patch"),
                                                                            []).append(base)
    assert set(carried) <= {i.id for i in items}, "a Hardening-Id patches/hardening.toml does not list"
    for item in items:
        found = carried.get(item.id, {})
        assert sorted(item.patches) == sorted(found), item.id
        expected = sorted({b for bs in found.values() for b in bs}, key=bases.index) if found else bases
        assert list(item.bases) == expected, item.id


def test_the_runtime_modules_exist_and_cover_every_module_the_patches_import(items, patches):
    for item in items:
        assert all((REPO / path).exists() for path in item.runtime), item.id
        imported = {f"sglang_hardened/runtime{package.replace('.', '/')}/{module}.py" for base in load_lock(patches)
                    for patch in load_series(patches, base).patches if patch.headers["Hardening-Id"] == item.id
                    for package, module in RUNTIME_IMPORT.findall(patch.diff)}
        assert imported <= set(item.runtime), (item.id, imported - set(item.runtime))


def test_the_knobs_are_those_the_registry_and_the_policy_give_the_id(items):
    for item in items:
        expected = {k.name for k in KNOBS if k.id == item.id} | {k.name for k in load_policy() if k.id == item.id}
        assert set(item.knobs) == expected, item.id


COUNTED = re.compile(r"metrics\.refused\(\s*\"(H\d+)\"")  # the id a runtime module counts a refusal under


def _counted(path: str) -> set[str]:
    """The ids a runtime module counts refusals under (``metrics.refused("H<n>", ...)``)."""
    return set(COUNTED.findall((REPO / path).read_text())) if path.endswith(".py") else set()


def test_a_patch_and_the_refusals_its_runtime_modules_count_name_one_id(items, patches):
    """Each module that counts refusals under an id is that id's (its catalogue entry lists it),
    and a patch calling modules that count refusals carries one of the ids they count: the
    catalogue, the patch's Hardening-Id and the metric's id label say the same item."""
    runtime = {path for item in items for path in item.runtime}
    for item in items:
        for path in runtime:
            if item.id in _counted(path):
                assert path in item.runtime, f"{path} counts {item.id}'s refusals; {item.id} does not list it"
    for base in load_lock(patches):
        for patch in load_series(patches, base).patches:
            counted = set().union(*(_counted(f"sglang_hardened/runtime{package.replace('.', '/')}/{module}.py")
                                    for package, module in RUNTIME_IMPORT.findall(patch.diff)))
            assert not counted or patch.hardening_id in counted, \
                f"{base}/{patch.name} is filed under {patch.hardening_id}; its refusals count as {sorted(counted)}"


def test_the_model_switches_and_the_refusal_metrics_follow_the_list(items):
    assert {s.value for s in Switch} == {i.id for i in items if i.modelled}
    assert set(REFUSALS) == {i.id for i in items if i.refuses}


def _claims() -> dict[str, set[tuple[str, str]]]:
    """``path::function`` -> its (id, side) claim markers, over the e2e tests."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path in sorted((REPO / "tests" / "e2e").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for mark in node.decorator_list:
                    if isinstance(mark, ast.Call) and ast.unparse(mark.func).endswith("mark.claim"):
                        key = f"{path.relative_to(REPO)}::{node.name}"
                        found.setdefault(key, set()).add((mark.args[0].value, mark.args[1].value))
    return found


def test_each_items_tests_carry_its_claims_and_every_claim_names_a_listed_id(items):
    claims = _claims()
    for item in items:
        assert (item.id, "upstream") in claims.get(item.upstream, set()), item.id
        assert (item.id, "hardened") in claims.get(item.hardened, set()), item.id
    assert {hid for pairs in claims.values() for hid, _ in pairs} <= {i.id for i in items}


def test_the_readme_table_lists_every_id_linked_to_its_entry(items):
    rows = re.findall(r"^\| \[(H\d+)\]\(docs/hardening\.md#([\w-]+)\) \|", (REPO / "README.md").read_text(), re.M)
    assert rows == [(i.id, slug(f"{i.id}: {i.title}")) for i in items]


def test_hardening_md_has_one_entry_per_id_opening_with_its_generated_table(items, patches):
    text = (REPO / "docs" / "hardening.md").read_text()
    entries = re.split(r"^## ", text, flags=re.M)[1:]
    assert [e.splitlines()[0] for e in entries] == [f"{i.id}: {i.title}" for i in items]
    bases = list(load_lock(patches))
    for item, entry in zip(items, entries):
        table = header_table(item, bases)
        assert entry.split("\n\n")[1] == table, f"{item.id}: its table should read\n{table}"
        prose = entry.split("\n\n", 2)[2]
        assert len(prose.split()) <= 170, f"{item.id}: {len(prose.split())} words; move detail to hardening-details.md"
