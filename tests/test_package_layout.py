"""The package's shape: small modules, one-way imports, leaves that stay leaves."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "adadsf_modifier"
MAX_LINES = 400
LEAVES = (
    "adadsf_modifier.utils",
    "adadsf_modifier.constraints",
    "adadsf_modifier.atomic",
    "adadsf_modifier.precision",
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _unit(module: str) -> str:
    """The package-level unit a module belongs to: ``adadsf_modifier.<first part>``."""
    return ".".join(module.split(".")[:2])


def _module_level_imports(path: Path) -> set[str]:
    """Project modules imported at module level (imports inside functions are lazy)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("adadsf_modifier"))
    return found


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in _modules().items():
        a = _unit(module)
        for imported in _module_level_imports(path):
            b = _unit(imported)
            if "adadsf_modifier" not in (a, b) and a != b:
                graph.setdefault(a, set()).add(b)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_is_over_the_size_limit(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (limit {MAX_LINES})"


def test_no_package_level_import_cycle():
    assert _find_cycle(_unit_graph()) is None


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_the_package(leaf):
    assert _module_level_imports(_modules()[leaf]) == set()
