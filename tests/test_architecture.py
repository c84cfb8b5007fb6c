"""The shape of the code base (#11): the import graph of memplan has no circle (lazy imports
inside functions count too), rich is imported only under memplan/render, and no module
under memplan/ grows past 600 lines except the ones being reworked elsewhere."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "memplan"
MAX_LINES = 600
# Over the bar and reworked by other issues this round (cli.py: its command bodies are being
# thinned separately); listed so that the debt is visible, not hidden.
OVER_LIMIT_FOR_NOW: set[str] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """memplan modules ``path`` imports anywhere in the file (``from memplan import x`` names
    the submodule ``memplan.x`` when there is one)."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names} & modules
    return out


def graph() -> dict[str, set[str]]:
    edges = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    for name, targets in edges.items():
        # A package's __init__ is imported with each of its submodules: not an edge back.
        targets -= {n for n in targets if name.startswith(n + ".") or n == name}
        # Importing memplan.x.y imports the package memplan.x first; memplan itself only
        # holds the version and re-exports, so the top package is not an edge.
        targets.discard("memplan")
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_has_no_circle():
    assert find_cycle(graph()) is None, " → ".join(find_cycle(graph()) or [])


def test_the_old_cli_circle_would_be_found():
    edges = graph()
    edges["memplan.cli.check"] = edges["memplan.cli.check"] | {"memplan.cli"}
    assert find_cycle(edges) == ["memplan.cli", "memplan.cli.check", "memplan.cli"]


def test_rich_only_in_render():
    users = sorted(
        module_name(p)
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rich")
        or (
            isinstance(node, ast.Import) and any(a.name.split(".")[0] == "rich" for a in node.names)
        )
    )
    assert users and all(u.startswith("memplan.render") for u in users), users


def test_no_module_over_600_lines():
    sizes = {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert set(over) <= OVER_LIMIT_FOR_NOW, over
