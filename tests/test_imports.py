"""The package's import graph: no cycles between modules, no module importing another module's private
names, and layers that import only downwards (issue 21). Read from the source with `ast` (function-level imports included), so a cycle hidden
behind a lazy import counts too."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ulorl_jax"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, str | None]]]:
    """module -> [(imported module, imported name or None)] for every ulorl_jax import in it."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ulorl_jax"):
                found += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, None) for a in node.names if a.name.startswith("ulorl_jax")]
        out[_module_name(path)] = found
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    imports = _imports()
    graph = {}
    for module, found in imports.items():
        deps = set()
        for target, name in found:
            if name and f"{target}.{name}" in imports:  # `from pkg import submodule`
                deps.add(f"{target}.{name}")
            elif target in imports:
                deps.add(target)
        graph[module] = deps - {module}
    return graph


def test_no_import_cycles_between_modules():
    graph = _graph()
    assert len(graph) > 50, "the package was not found"
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names():
    private = [f"{module} imports {target}.{name}" for module, found in _imports().items()
               for target, name in found if name and name.startswith("_") and not name.startswith("__")]
    assert private == []


# Layering (issue 21, item 1): package -> packages it must not import (models < decode < rollout < rl). The one exception is the data
# cleaning step, which runs the policy to drop prompts it always solves.
FORBIDDEN = {"models": {"decode", "rollout", "rl", "rewards", "data"},
             "decode": {"rollout", "rl", "rewards", "data"},  # a generic engine: no segments, no learning
             "rollout": {"rl"}, "data": {"decode", "rollout"}, "sharding": {"models"}}
ALLOWED = {("ulorl_jax.data.clean", "decode")}
FACE = {"ulorl_jax.cli", "ulorl_jax.commands"}  # the CLI: the only modules besides bench/ that import bench/
# ... and `ulorl plan`, which reports full-size projections from bench/'s cost models (the segment rollout's
# length shape, decode concurrency) beside its compiled memory figures.
BENCH_USERS = FACE | {"ulorl_jax.plan"}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            forbidden = _part(dep) in FORBIDDEN.get(_part(module), ()) and (module, _part(dep)) not in ALLOWED
            upward = dep in FACE and module not in FACE
            bench = _part(dep) == "bench" and _part(module) != "bench" and module not in BENCH_USERS
            if forbidden or upward or bench:
                bad.append(f"{module} -> {dep}")
    return bad


def test_layers_import_only_downwards():
    assert _layer_violations(_graph()) == []


def test_layer_check_finds_a_wrong_arrow():
    graph = {"ulorl_jax.models.qwen3": {"ulorl_jax.rl.learner"}, "ulorl_jax.memory": {"ulorl_jax.bench.harness"},
             "ulorl_jax.data.clean": {"ulorl_jax.decode.engine"}, "ulorl_jax.rl.trainer": {"ulorl_jax.commands"}}
    assert _layer_violations(graph) == ["ulorl_jax.memory -> ulorl_jax.bench.harness",
                                        "ulorl_jax.models.qwen3 -> ulorl_jax.rl.learner",
                                        "ulorl_jax.rl.trainer -> ulorl_jax.commands"]
