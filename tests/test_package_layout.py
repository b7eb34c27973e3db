"""The repository's shape: the plug-in (``adadsf_modifier``) and the lab (``lab/``,
``adadsf_lab``) are two packages; the lab imports the plug-in, never the reverse; no
import cycle between modules or between packages; leaves stay leaves; the plug-in's
wheel and its import carry none of the lab or its plotting and evaluation stack.

Modules are cut by concept, not by size, so there is no line limit here."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"adadsf_modifier": REPO, "adadsf_lab": REPO / "lab"}
LEAVES = (
    "adadsf_modifier.utils",
    "adadsf_modifier.constraints",
    "adadsf_modifier.atomic",
    "adadsf_modifier.precision",
    "adadsf_modifier.algorithm_versions",
)


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: Path, lazy: bool = False) -> set[str]:
    """Project modules ``path`` imports: at module level (imports inside functions
    run later, after every module has loaded), or anywhere with ``lazy``."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if lazy else tree.body
    modules = _modules()
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _unit(module: str) -> str:
    """The package-level unit a module belongs to: ``<package>.<first part>``."""
    return ".".join(module.split(".")[:2])


def _module_graph() -> dict[str, set[str]]:
    return {m: _imports(p) - {m} for m, p in _modules().items()}


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, imported in _module_graph().items():
        a = _unit(module)
        for b in map(_unit, imported):
            if a != b and a not in PACKAGES and b not in PACKAGES:
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


def test_no_import_cycle_between_modules():
    assert _find_cycle(_module_graph()) is None


def test_no_import_cycle_between_packages():
    assert _find_cycle(_unit_graph()) is None


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_the_plugin_never_imports_the_lab():
    offenders = {
        module: sorted(
            i for i in _imports(path, lazy=True) if i.startswith("adadsf_lab")
        )
        for module, path in _modules().items()
        if module.startswith("adadsf_modifier")
    }
    assert {m: i for m, i in offenders.items() if i} == {}


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_the_package(leaf):
    assert _imports(_modules()[leaf]) == set()


def test_importing_the_plugin_loads_neither_the_lab_nor_its_stack():
    code = (
        "import sys, adadsf_modifier, adadsf_modifier.cli\n"
        "print(sorted(m for m in ('adadsf_lab', 'matplotlib', 'lm_eval') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_plugin_wheel_holds_no_lab_code(tmp_path):
    # built from a copy of the tracked tree: setuptools writes build/ into the source
    source = tmp_path / "src"
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()  # fmt: skip
    for rel in listed:
        if (REPO / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, source / rel)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
         "--no-build-isolation", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, PIP_NO_INDEX="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("adadsf_modifier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("adadsf_modifier/routing/") for n in names)
    lab = [n for n in names if "adadsf_lab" in n or "/study/" in n or "report" in n]
    assert lab == [] and not [n for n in names if "plot" in n]


def test_the_routed_model_imports_nothing_that_builds_it():
    """What a loaded checkpoint runs (``routing``) stands apart from what builds it:
    the fits, alignment, FTP's training and the modifiers."""
    builders = ("fitting", "alignment", "ftp", "modifier", "recalibration")
    offenders = {
        module: sorted(
            i
            for i in _imports(path, lazy=True)
            if i.split(".")[:2][-1] in builders and i.startswith("adadsf_modifier.")
        )
        for module, path in _modules().items()
        if module.startswith("adadsf_modifier.routing")
    }
    assert {m: i for m, i in offenders.items() if i} == {}
