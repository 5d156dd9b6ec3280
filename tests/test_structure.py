"""The package's structure, read from its source with ``ast`` (nothing is imported): every import runs
down the layers below, there are no cycles, and each idea has one owner (budgets are built only by the
budget module, llama-cpp-python's internals are reached only through the upstream module)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ahakv_local"

# bottom to top; a module may import from its own layer or any layer below, never from one above
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundations",
        {
            "errors",
            "paths",
            "atomic",
            "extras",
            "budget",
            "fixture",
            "gguf_header",
            "models",
            "upstream",
            "words",
            "textfile",
            "stream_text",
        },  # fmt: skip
    ),
    ("native boundary", {"info", "native", "build", "rpc", "saved_chat"}),
    ("engine and policies", {"engine", "policies"}),
    ("controller", {"controller", "groups", "adaptive"}),
    ("bounded session", {"session"}),
    ("users of a session", {"llama", "evaluation", "needle", "longdoc", "parallel"}),
    ("front ends", {"bench", "chat", "server", "plots", "report", "__init__"}),
    ("commands", {"cli_options", "cli", "cli_eval", "__main__"}),
]
LAYER = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def unit(path: Path) -> str:
    """The layer unit of a module: its name, or its subpackage's."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def imported_units(path: str, tree: ast.Module) -> set[str]:
    """The package's units a module imports, at module level or inside functions (lazy imports count)."""
    here = Path(path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here.parent.parts[: len(here.parent.parts) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [target[0]] if target else [alias.name for alias in node.names]
            # `from . import x`: a module of the package, or a name the package's __init__ defines
            out.update(n if (PACKAGE / f"{n}.py").exists() or (PACKAGE / n).is_dir() else "__init__" for n in names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            for name in [mod] if mod else [a.name for a in node.names]:
                if name and name.startswith("ahakv_local."):
                    out.add(name.split(".")[1])
    return out - {unit(PACKAGE / path)}


def graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for path, tree in modules().items():
        g.setdefault(unit(PACKAGE / path), set()).update(imported_units(path, tree))
    return g


def test_every_module_has_a_layer():
    assert set(graph()) == set(LAYER)


def test_no_import_runs_up_the_layers():
    up = [(a, b) for a, deps in graph().items() for b in deps if LAYER[b] > LAYER[a]]
    assert up == [], "imports that run up: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_there_are_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [])


def calls_named(tree: ast.Module, name: str) -> list[int]:
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
    ]


def test_budgets_are_built_only_by_the_budget_module():
    # everyone else goes through Budget.parse (the one grammar) or NO_EVICTION (the one spelling)
    found = {path: lines for path, tree in modules().items() if (lines := calls_named(tree, "Budget"))}
    assert set(found) <= {"budget.py"}, found


def test_controllers_are_built_only_by_the_session_module():
    # every front end gets its bounded sequence from SessionSpec (one rule for cells and schedules)
    found = {path: lines for path, tree in modules().items() if (lines := calls_named(tree, "KVController"))}
    assert set(found) <= {"session.py"}, found


PRIVATE = ("_internals", "_lib", "_ctx", "_model", "_batch", "_n_ctx", "_input_ids")


def test_llama_cpp_python_internals_are_reached_only_through_the_upstream_module():
    """``llm._ctx`` and friends on a Llama, ``llama_cpp._internals``, ``llama_cpp.llama_cpp._lib``:
    only upstream.py names them (engine.py keeps its own ``self._ctx``, which is no Llama's)."""
    found = []
    for path, tree in modules().items():
        if path == "upstream.py":
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in PRIVATE:
                owner = n.value
                if isinstance(owner, ast.Name) and owner.id == "self" and path == "engine.py":
                    continue  # the Engine's own handles
                if isinstance(owner, ast.Name) and owner.id == "self" and n.attr in ("_n_ctx", "_input_ids"):
                    if path == "llama.py":
                        continue  # the drop-in's own (inherited) state, read as the subclass
                found.append(f"{path}:{n.lineno} .{n.attr}")
            if isinstance(n, ast.ImportFrom) and n.module and "_internals" in n.module:
                found.append(f"{path}:{n.lineno} import {n.module}")
    assert found == [], found


def test_the_readme_names_every_variable_the_commands_read():
    """The README's paragraph on variables against the commands' own ``envvar=``: every variable a command reads is
    named there (AHAKV_READING, AHAKV_LAYER_BUDGETS and AHAKV_PARALLEL were read and never named: a stale shell
    variable changed a layout unseen), and the list of those the measuring commands (eval, bench) read is exactly
    theirs. The commands' variables are read from click's own parameters (options shared by several commands are
    declared in cli_options)."""
    import re

    import click

    from ahakv_local.cli import main

    def read(command: click.Command) -> set[str]:
        names = {v for p in command.params for v in ([p.envvar] if isinstance(p.envvar, str) else p.envvar or [])}
        subs = command.commands.values() if isinstance(command, click.Group) else ()
        return names.union(*(read(sub) for sub in subs))

    readme = (PACKAGE.parent / "README.md").read_text()
    paragraph = readme[readme.index("Engine flags keep llama.cpp's names") : readme.index("An option given overrides")]
    all_named, measuring = paragraph.split("The measuring commands")
    assert read(main) == set(re.findall(r"AHAKV_\w+", all_named))
    assert read(main.commands["eval"]) | read(main.commands["bench"]) == set(re.findall(r"AHAKV_\w+", measuring))
