"""docs/architecture.md matches the tree: each layer's folder holds the modules its row names,
no more and no fewer, and a layer imports only from the layers listed before it."""

from __future__ import annotations

import re

from tests.harness import REPO

PACKAGE = REPO / "sglang_hardened"
ROW = re.compile(r"^\| (\w+) \| `sglang_hardened/(\w+)/` \|[^|]*\| (.*) \|$", re.M)


def _layers() -> list[tuple[str, set[str]]]:
    """(folder, modules named) per table row, in the table's order."""
    text = (REPO / "docs" / "architecture.md").read_text()
    return [(folder, set(re.findall(r"`([\w/]+\.(?:py|yaml))`", modules))) for _, folder, modules in ROW.findall(text)]


def test_every_layer_row_names_exactly_the_modules_in_its_folder():
    layers = _layers()
    assert {folder for folder, _ in layers} == {p.name for p in PACKAGE.iterdir()
                                               if p.is_dir() and (p / "__init__.py").exists()}
    for folder, named in layers:
        present = {str(p.relative_to(PACKAGE / folder)) for p in (PACKAGE / folder).rglob("*")
                   if p.suffix in (".py", ".yaml") and p.name != "__init__.py"}
        assert named == present, (folder, "named only:", named - present, "not named:", present - named)


def test_a_layer_imports_only_from_the_layers_before_it():
    order = [folder for folder, _ in _layers()]
    upward = []
    for rank, folder in enumerate(order):
        for path in (PACKAGE / folder).rglob("*.py"):
            for target in re.findall(r"^\s*from (?:\.{2,}|sglang_hardened\.)(\w+)", path.read_text(), re.M):
                if target in order and order.index(target) > rank:
                    upward.append(f"{folder}/{path.name} imports {target}")
    assert not upward, upward
