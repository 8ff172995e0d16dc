"""Who may import whom (docs/architecture.md, Packages), checked from the source with ``ast``.

Every ``import rankctl.X...`` / ``from rankctl.X... import`` counts, at module level or inside a
function (a lazy import is still a dependency between packages); ``TYPE_CHECKING`` blocks do not.
Rules about import *time* (no torch when ``ctl`` or a kind's declaration loads) look at module level only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"contract", "proto", "parallel", "models", "coordinator", "worker", "runtime", "kinds", "cli", "security"}
# modules that run in a rank (torch): the coordinator and ctl never import them, not even lazily
KIND_RANK_MODULES = ("rankctl.kinds.train.loop", "rankctl.kinds.train.trainer", "rankctl.kinds.train.optim", "rankctl.kinds.train.checkpoint",
                     "rankctl.kinds.train.train_state", "rankctl.kinds.comm_check.run")


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, lazy: bool = True) -> set[str]:
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in out if m.startswith("rankctl.") or m.split(".")[0] in ("torch", "grpc")}


def package_imports(package: str, lazy: bool = True) -> dict[str, set[str]]:
    """module file -> the rankctl modules (and torch/grpc) it imports (``lazy=False``: at import time)."""
    return {str(p.relative_to(ROOT)): _imports(ast.parse(p.read_text(), str(p)), lazy)
            for p in sorted((ROOT / package).rglob("*.py"))}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "rankctl" and len(parts) > 1 else parts[0]


def _offenders(package: str, forbidden, lazy: bool = True) -> list[str]:
    return [f"{f} imports {m}" for f, mods in package_imports(package, lazy).items()
            for m in sorted(mods) if forbidden(m)]


def test_coordinator_imports_no_rank_side_code() -> None:
    bad = {"models", "runtime", "worker", "torch"}
    assert _offenders("coordinator", lambda m: _top(m) in bad or m.startswith(KIND_RANK_MODULES)) == []


def test_kinds_declarations_stay_pure() -> None:
    """What the coordinator and ctl import of a kind (its KIND, spec, checks, results, render) has no torch."""
    pure = [p for p in package_imports("kinds") if not any(p.endswith(m.split(".")[-1] + ".py")
                                                         for m in KIND_RANK_MODULES)]
    torchy = {f: mods for f, mods in package_imports("kinds", lazy=False).items() if f in pure and
              any(_top(m) in ("torch", "models", "runtime", "worker") for m in mods)}
    assert torchy == {}


def test_security_depends_on_the_contract_only() -> None:
    """Certificates and identities: shared by the coordinator, the worker and ctl, so it imports none of them."""
    assert _offenders("security", lambda m: m.startswith("rankctl.") and _top(m) not in ("security", "contract")) == []


def test_parallel_does_not_import_models() -> None:
    assert _offenders("parallel", lambda m: _top(m) == "models") == []


def test_contract_imports_nothing_of_rankctl_but_itself() -> None:
    assert _offenders("contract", lambda m: m.startswith("rankctl.") and _top(m) != "contract") == []


def test_cli_never_imports_the_rank_side_at_import_time() -> None:
    """``ctl --help``/``ctl plan`` stay torch-free; a command that needs torch (checkpoint export) imports it lazily."""
    forbidden = ("runtime", "torch")
    assert _offenders("cli", lambda m: _top(m) in forbidden or m.startswith(KIND_RANK_MODULES), lazy=False) == []
    assert _offenders("cli", lambda m: _top(m) == "runtime") == []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        deps = {_top(m) for mods in package_imports(package).values() for m in mods}
        graph[package] = {d for d in deps if d in PACKAGES and d != package}
    return graph


def test_no_import_cycles_between_packages() -> None:
    graph, cycles = _graph(), []

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph[node]:
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif len(path) < len(graph):
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert cycles == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_package_is_installed(package: str) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"rankctl.{package}" = "{package}"' in text
