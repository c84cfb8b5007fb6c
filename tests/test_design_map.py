"""docs/design.md's module map names every module of the tree, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memplan"


def map_rows(text: str) -> dict[str, str]:
    """``{'probe/': row text, 'plan.py': row text, ...}`` from the map's table."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            rows[name] = line
    return rows


def missing_and_stale(text: str, package: Path) -> tuple[list[str], list[str]]:
    rows = map_rows(text)
    missing = []
    present = set()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.name in {"__init__.py", "__main__.py"}:
            continue
        if len(rel.parts) == 1:
            present.add(rel.name)
            if rel.name not in rows:
                missing.append(str(rel))
            continue
        folder = rel.parts[0] + "/"
        present.add(folder)
        row = rows.get(folder, "")
        if f"`{rel.stem}`" not in row and f"`{rel.parts[0]}/{rel.name}`" not in row:
            missing.append(str(rel))
    stale = sorted(name for name in rows if name not in present)
    return missing, stale


def test_every_module_is_in_the_design_map_and_no_gone_one_is():
    missing, stale = missing_and_stale((ROOT / "docs" / "design.md").read_text(), PACKAGE)
    assert missing == [], f"add these to docs/design.md's module map: {missing}"
    assert stale == [], f"the module map names what the tree no longer has: {stale}"


def test_the_map_check_fails_on_a_new_module_and_on_a_gone_one(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "known.py").write_text("")
    (tmp_path / "pkg" / "new.py").write_text("")
    (tmp_path / "root.py").write_text("")
    text = (
        "## Module map\n\n| module | job |\n| --- | --- |\n"
        "| `pkg/` | `known` things |\n| `root.py` | a root module |\n| `gone.py` | gone |\n"
    )
    missing, stale = missing_and_stale(text, tmp_path)
    assert missing == ["pkg/new.py"]
    assert stale == ["gone.py"]
