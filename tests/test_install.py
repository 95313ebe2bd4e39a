"""The install front door (issues 41, 42): what `pip install -e .` declares covers what the package imports,
`ulorl --help` starts without jax, missing optional packages are named with their fix, and the test-run
settings CI relies on (jetstream selection, reproducible Hypothesis examples) hold.

The real check of `pip install -e .` alone is .ci/run's first leg (.ci/smoke_install.py in a venv with no
extras); these tests keep the pieces it relies on true between CI runs."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCES = [ROOT / "ulorl_jax", ROOT / "kernels" / "pallas"]

# Needed at run time though never imported by us: transformers imports jinja2 for apply_chat_template (which
# `ulorl train` / `generate` / `eval` call on every model folder with a chat template) but leaves it to an extra.
RUNTIME_ONLY = {"jinja2": "apply_chat_template on a chat-template model folder"}
# Imported by us, installed by a declared dependency that pins it: jax requires its own jaxlib.
COMES_WITH = {"jaxlib": "jax"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in requirements}


def third_party_imports(paths: list[Path]) -> dict[str, list[tuple[str, int, bool]]]:
    """top-level module -> [(file, line, inside a function)] for every import of a module that is neither the
    standard library nor ours, module level and lazy alike."""
    found: dict[str, list[tuple[str, int, bool]]] = {}

    def visit(node: ast.AST, path: Path, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "ulorl_jax":
                    found.setdefault(top, []).append((str(path.relative_to(ROOT)), child.lineno, lazy))
            visit(child, path, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for root in paths:
        for path in sorted(root.rglob("*.py")):
            visit(ast.parse(path.read_text(), str(path)), path, False)
    return found


def undeclared(imports: dict[str, list[tuple[str, int, bool]]], dependencies: list[str],
               extras: dict[str, list[str]], optional: dict[str, str]) -> list[str]:
    """What `pip install -e .` would miss: each problem names the module, where it is imported and the fix."""
    declared = _requirement_names(dependencies)
    dists = importlib.metadata.packages_distributions()
    problems = []
    for module, sites in sorted(imports.items()):
        where = ", ".join(f"{f}:{line}" for f, line, _ in sites[:3])
        if module in optional:  # left out on purpose: imported inside the functions that need it
            eager = [f"{f}:{line}" for f, line, lazy in sites if not lazy]
            if eager:
                problems.append(f"{module} (optional: {optional[module]}) is imported at module level in "
                                f"{', '.join(eager)}: import it inside the function that needs it")
            extra = re.search(r"\.\[(\w+)\]", optional[module])
            if extra and extra.group(1) not in extras:
                problems.append(f"{module}: the fix names the extra [{extra.group(1)}], which pyproject.toml's "
                                "[project.optional-dependencies] lacks")
            continue
        if module in COMES_WITH and _norm(COMES_WITH[module]) in declared:
            continue
        names = {_norm(d) for d in dists.get(module, [])}
        if not names:
            problems.append(f"{module} (imported at {where}) is installed by no distribution here: declare it in "
                            "pyproject.toml's dependencies, or list it in ulorl_jax/cli.py OPTIONAL_PACKAGES and "
                            "import it lazily")
        elif not names & declared:
            problems.append(f"{module} (imported at {where}; distribution {sorted(names)}) is not in pyproject.toml's "
                            "dependencies: `pip install -e .` does not promise it")
    for module, why in RUNTIME_ONLY.items():
        if _norm(module) not in declared:
            problems.append(f"{module} ({why}) is not in pyproject.toml's dependencies")
    return problems


def test_every_third_party_import_is_declared_or_optional_and_lazy():
    from ulorl_jax.cli import OPTIONAL_PACKAGES

    project = PYPROJECT["project"]
    imports = third_party_imports(SOURCES)
    assert {"jax", "transformers", "tokenizers", "torch"} <= set(imports), "the import scan found too little"
    assert undeclared(imports, project["dependencies"], project["optional-dependencies"], OPTIONAL_PACKAGES) == []


def test_the_declaration_check_finds_what_is_missing():
    """Without tokenizers and jinja2 (pyproject before issue 41) and with torch imported at module level."""
    from ulorl_jax.cli import OPTIONAL_PACKAGES

    deps = [d for d in PYPROJECT["project"]["dependencies"] if _norm(d.split(">")[0]) not in ("tokenizers", "jinja2")]
    imports = {"tokenizers": [("ulorl_jax/data/tokenizer.py", 1, True)],
               "torch": [("ulorl_jax/bench/x.py", 3, False)], "jax": [("ulorl_jax/a.py", 1, False)]}
    problems = undeclared(imports, deps, PYPROJECT["project"]["optional-dependencies"], OPTIONAL_PACKAGES)
    assert len(problems) == 3, problems
    assert "tokenizers (imported at ulorl_jax/data/tokenizer.py:1" in problems[0]
    assert "torch" in problems[1] and "module level in ulorl_jax/bench/x.py:3" in problems[1]
    assert problems[2].startswith("jinja2 (apply_chat_template")


_NO_JAX = """
import json, sys
from ulorl_jax.cli import build_parser, main
parser = build_parser()
after_build = "jax" in sys.modules
sub = parser._subparsers._group_actions[0]
results = {}
for argv in [[]] + [[name] for name in sub.choices if name not in sub.lazy] + [["data", "clean"]]:
    try:
        main([*argv, "--help"])
        code = None
    except SystemExit as exit:
        code = exit.code
    results[" ".join(argv) or "ulorl"] = {"code": code, "jax": "jax" in sys.modules}
print(json.dumps({"after_build": after_build, "help": results, "lazy": sorted(sub.lazy)}))
"""


def test_help_does_not_import_jax():
    """`ulorl --help`, `ulorl SUB --help` and `ulorl bench --help` print usage without importing jax; only the
    commands listed lazily in cli.py (their module imports jax) load it, when chosen."""
    proc = subprocess.run([sys.executable, "-c", _NO_JAX], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["after_build"] is False, "building the parser imported jax"
    assert {"ulorl", "train", "eval", "generate", "convert", "bench", "data clean"} <= set(out["help"])
    assert {cmd: r for cmd, r in out["help"].items() if r != {"code": 0, "jax": False}} == {}
    assert out["lazy"] == ["plan"]
    assert proc.stdout.count("usage: ulorl") == len(out["help"])


def test_lazy_commands_register_what_the_parser_lists(capsys):
    """Each lazily listed command's module registers the same name and one-line help as cli.py lists, and its
    --help shows its own options."""
    from ulorl_jax.cli import LAZY_BENCHES, LAZY_COMMANDS, build_parser, load_all, main

    parser = load_all(build_parser())
    top = parser._subparsers._group_actions[0]
    bench = top.choices["bench"]._subparsers._group_actions[0]
    assert top.loaded_help == {name: help for name, (_, help) in LAZY_COMMANDS.items()}
    assert bench.loaded_help == {name: help for name, (_, help) in LAZY_BENCHES.items()}
    for argv, option in ((["plan"], "--devices"), (["bench", "kv"], "--preemption")):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: ulorl {' '.join(argv)}") and option in out


def test_a_lazy_module_registering_another_name_is_named():
    import argparse

    from ulorl_jax.cli import LazySubcommands, _Into

    sub = argparse.ArgumentParser(prog="ulorl").add_subparsers(action=LazySubcommands)
    sub.add_lazy("plan", "ulorl_jax.plan", "help")
    with pytest.raises(ValueError, match=r"ulorl_jax.plan.add_parser registered 'plot' where ulorl_jax/cli.py "
                                         r"lists 'plan'"):
        _Into(sub, "plan", "ulorl_jax.plan").add_parser("plot")


def test_a_missing_optional_package_names_its_fix(monkeypatch, capsys):
    from ulorl_jax import cli

    def needs(name):
        def command(args):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return command

    monkeypatch.setattr(cli, "_convert", needs("torch"))
    assert cli.main(["convert", "hf-to-ulorl", "a", "b"]) == 2
    err = capsys.readouterr().err
    assert "ulorl convert: error: this command needs the `torch` package" in err and "'.[bench]'" in err
    monkeypatch.setattr(cli, "_convert", needs("not_a_dependency"))
    with pytest.raises(ModuleNotFoundError):  # a missing required package is a bug: its traceback stays
        cli.main(["convert", "hf-to-ulorl", "a", "b"])


def test_jetstream_tests_are_selected_on_the_jetstream_leg():
    """.ci/run's Python 3.11 leg runs `-m "not slow or jetstream"`: every test file that checks whether JetStream
    is installed has its tests marked `jetstream` (by tests/conftest.py), so its slow ones run there too."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "jetstream_available()" in p.read_text() and p != Path(__file__))
    assert files, "no test checks for JetStream"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "jetstream", *files], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    selected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert selected == set(files), f"files with unmarked JetStream tests: {sorted(set(files) - selected)}"


def test_ci_runs_the_declared_markers_and_readme_command_one():
    """.ci/run's -m expressions use registered markers only (pytest's --strict-markers does not check -m),
    its newest-jax leg has none (it runs every test), and its first leg installs README command 1's way."""
    ci = (ROOT / ".ci" / "run").read_text()
    registered = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    expressions = re.findall(r'-m "([^"]+)"', ci)
    assert expressions, ".ci/run selects no markers"
    used = {w for e in expressions for w in re.findall(r"\w+", e) if w not in ("not", "and", "or")}
    assert used <= registered, f"unregistered markers in .ci/run: {used - registered}"
    newest = [line for line in ci.splitlines() if line.startswith('leg "$newest"')]
    assert len(newest) == 1 and " -m " not in newest[0], newest
    readme = (ROOT / "README.md").read_text()
    assert "&& pip install -e . && ulorl demo" in readme, "README command 1 changed: update .ci/run's first leg"
    assert 'pip install -q -e . ' in ci and ".ci/smoke_install.py" in ci


def test_hypothesis_examples_reproduce():
    """The profile tests/conftest.py loads: examples drawn from each test's source, no database."""
    from hypothesis import settings

    if os.environ.get("HYPOTHESIS_PROFILE"):
        pytest.skip(f"HYPOTHESIS_PROFILE={os.environ['HYPOTHESIS_PROFILE']} chosen for this run")
    assert settings.default.derandomize is True and settings.default.database is None
