"""Who may import whom (docs/architecture.md, Rooms; the rules are the rooms' "May import:" lines), checked from the source with ``ast``.

Every ``import rankctl.X...`` / ``from rankctl.X... import`` counts, at module level or inside a
function (a lazy import is still a dependency between packages). ``TYPE_CHECKING`` blocks count for
cycles (a cycle hidden behind them is still one design knot) and not for the rules about what may run
where. Rules about import *time* (no torch when ``ctl`` or a kind's declaration loads) look at module
level only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {"contract", "proto", "parallel", "models", "coordinator", "worker", "runtime", "kinds", "cli", "security"}
# modules that run in a rank (torch): the coordinator and ctl never import them, not even lazily
KIND_RANK_MODULES = ("rankctl.kinds.train.loop", "rankctl.kinds.train.trainer", "rankctl.kinds.train.optim", "rankctl.kinds.train.checkpoint",
                     "rankctl.kinds.train.train_state", "rankctl.kinds.train.resume", "rankctl.kinds.train.reshard",
                     "rankctl.kinds.train.initfrom", "rankctl.kinds.train.intact",
                     "rankctl.kinds.comm_check.run")


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, lazy: bool = True, type_checking: bool = False) -> set[str]:
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node) and not type_checking:
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


def package_imports(package: str, lazy: bool = True, type_checking: bool = False) -> dict[str, set[str]]:
    """module file -> the rankctl modules (and torch/grpc) it imports (``lazy=False``: at import time;
    ``type_checking``: ``TYPE_CHECKING`` imports too)."""
    return {str(p.relative_to(ROOT)): _imports(ast.parse(p.read_text(), str(p)), lazy, type_checking)
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


def _room_offenders(package: str, room: str, allowed_rooms: set[str], banned: tuple[str, ...]) -> list[str]:
    """Imports of ``package/room`` that reach another room of ``package`` outside ``allowed_rooms``, or a banned
    module (``grpc``, ``rankctl.proto``)."""
    prefix = f"rankctl.{package}."
    rooms = {d.name for d in (ROOT / package).iterdir() if (d / "__init__.py").is_file()}
    out = []
    for f, mods in package_imports(f"{package}/{room}").items():
        for m in sorted(mods):
            other = m[len(prefix):].split(".")[0] if m.startswith(prefix) else None
            if (other in rooms and other != room and other not in allowed_rooms) or m.split(".")[0] in banned \
                    or m.startswith(banned):
                out.append(f"{f} imports {m}")
    return out


def test_the_domain_model_imports_no_other_room_and_no_wire() -> None:
    """``coordinator/model`` (records, states, typed failures, errors) is plain data: no grpc, no protobuf, no
    other room of the coordinator (the api maps its errors to status codes: ``coordinator.api.grpcstatus``)."""
    assert _room_offenders("coordinator", "model", set(), ("grpc", "rankctl.proto")) == []


def test_the_launcher_process_loads_no_grpc_and_no_daemon_uplink() -> None:
    """The warm launcher is its own process: it forks ranks and never talks to the coordinator."""
    assert _room_offenders("worker", "launcher", {"files", "runs", "daemon"}, ("grpc", "rankctl.proto")) == []


def _declared(doc: str) -> tuple[set[str], tuple[str, ...]]:
    """A room docstring's "May import:" line -> (the rooms it may import, the wire modules it may not)."""
    line = " ".join(doc.split("May import:", 1)[1].split())
    rooms = set() if line.startswith("no other room") else \
        {r.strip() for r in line.removeprefix("the rooms ").split(" of ``")[0].split(",")}
    wire = line.split(";", 1)[1]
    banned = tuple(m for m, word in (("grpc", "grpc"), ("rankctl.proto", "protobuf")) if word not in wire
                   or "no " + word in wire)
    return rooms, banned


def test_every_room_imports_only_what_its_docstring_declares() -> None:
    """Each room's ``__init__`` says what it may import ("May import: the rooms ... ; grpc and protobuf stubs"):
    that line is the rule."""
    found = []
    for pkg in ("coordinator", "worker", "cli", "contract"):
        for d in sorted((ROOT / pkg).iterdir()):
            if (d / "__init__.py").is_file():
                rooms, banned = _declared(ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or "")
                found += _room_offenders(pkg, d.name, rooms, banned)
    assert found == []


def test_the_declared_rules_read_as_meant() -> None:
    assert _declared("X.\n\nMay import: no other room of ``coordinator``; no grpc, no protobuf (``t``).") == \
        (set(), ("grpc", "rankctl.proto"))
    assert _declared("X.\n\nMay import: the rooms fleet, model of ``coordinator``; protobuf stubs (``t``).") == \
        ({"fleet", "model"}, ("grpc",))


def test_every_room_says_what_it_owns() -> None:
    rooms = [p for pkg in ("coordinator", "worker", "cli", "contract") for p in sorted((ROOT / pkg).iterdir())
             if (p / "__init__.py").is_file()]
    assert len(rooms) >= 20
    empty = [str(p.relative_to(ROOT)) for p in rooms
             if "May import:" not in (ast.get_docstring(ast.parse((p / "__init__.py").read_text())) or "")]
    assert empty == []


def test_no_package_folder_holds_more_than_15_modules() -> None:
    crowded = {str(d.relative_to(ROOT)): n for pkg in PACKAGES | {"api", "integrations"} for d in [ROOT / pkg,
               *(p for p in (ROOT / pkg).rglob("*") if p.is_dir())]
               if (d / "__init__.py").is_file() and (n := len(list(d.glob("*.py")))) > 15}
    assert crowded == {}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        deps = {_top(m) for mods in package_imports(package, type_checking=True).values() for m in mods}
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


def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return "rankctl." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """module -> the rankctl modules it imports, ``TYPE_CHECKING`` and lazy imports included (``from P import
    m`` counts as importing module ``P.m`` when that is a module, else ``P``)."""
    files = {_module_name(f): mods for package in PACKAGES
             for f, mods in package_imports(package, type_checking=True).items() if "_pb2" not in f}
    return {m: {d for d in deps if d in files and d != m} for m, deps in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles_between_modules() -> None:
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_finds_a_hidden_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_package_is_installed(package: str) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"rankctl.{package}" = "{package}"' in text


def test_modules_that_decide_restarts_read_no_english() -> None:
    """What follows a failure is decided over typed faults (``coordinator.model.faults``); a rank's words are read
    once, by ``coordinator.model.errortext``, and nothing that decides imports ``re``."""
    deciders = [*sorted((ROOT / "coordinator" / "recovery").glob("*.py")), ROOT / "coordinator/model/faults.py"]
    readers = [str(p.relative_to(ROOT)) for p in deciders if "re" in _plain_imports(p)]
    assert readers == []


def _plain_imports(path: Path) -> set[str]:
    return {a.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
            for a in node.names} | {node.module for node in ast.walk(ast.parse(path.read_text()))
                                    if isinstance(node, ast.ImportFrom) and node.module}


def test_job_records_are_written_in_one_module() -> None:
    """Every assignment to a ``JobRecord`` field (``job.state = ...``, ``job.attempt += 1``) is in the job book."""
    from dataclasses import fields

    from rankctl.coordinator.model.records import JobRecord

    names = {f.name for f in fields(JobRecord)}
    writers = []
    for p in sorted((ROOT / "coordinator").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if isinstance(t, ast.Attribute) and t.attr in names and isinstance(t.value, ast.Name) \
                        and t.value.id in ("job", "j", "rec", "record"):
                    writers.append(f"{p.relative_to(ROOT)}:{node.lineno} {t.value.id}.{t.attr}")
    assert {w.split(":")[0] for w in writers} <= {"coordinator/jobs/book.py"}, writers
