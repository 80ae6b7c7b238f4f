"""The package's shape: a short root, no import cycles between its modules, and layers
whose dependencies point one way.

The import graph is read from the sources (every ``import`` and ``from`` statement, at
module level, inside a function, or under ``if TYPE_CHECKING:``), not from
``sys.modules``: a cycle through a function's import, or through a type's, is a cycle in
the design even when Python tolerates it at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autoprec"

# `__init__.py` included: the root holds at most this many `.py` files.
MAX_ROOT_MODULES = 15


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is its ``__init__.py``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (``autoprec.x.y.f``
    names the module ``autoprec.x.y``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its source (at module
    level, in a function, under ``if TYPE_CHECKING:``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from autoprec.x import y``: y is a submodule, or a name in autoprec.x.
            names = [f"{origin}.{alias.name}" for alias in node.names] or [origin]
        else:
            continue
        for name in names:
            if name == "autoprec" or name.startswith("autoprec."):
                target = _resolve(name, modules)
                # ``from autoprec import Policy``: the root's lazy names are not edges.
                if target is not None and target not in (module, "autoprec"):
                    found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted:
    modules that all reach each other through their imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [sorted(component) for component in components]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    return [_one_cycle(graph, set(component)) for component in tangles(graph)]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path back to the component's first module, through the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    next_frontier.append(target)
        frontier = next_frontier
    return sorted(component)


def test_the_root_is_short() -> None:
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]


def test_the_graph_sees_function_level_and_type_checking_imports() -> None:
    graph = import_graph()
    # A function-level import (the MLflow loader builds the task's model), and a module-level one.
    assert "autoprec.tasks" in graph["autoprec.serving.mlflow_rebuilt"]
    assert "autoprec.policy" in graph["autoprec.serving.conversion"]
    # Under ``if TYPE_CHECKING:`` (landing types the policy it is given).
    assert "autoprec.precision.view" in graph["autoprec.precision.landing"]
    # ``from autoprec.precision import landing``, in a method: the submodule is the edge.
    assert "autoprec.precision.landing" in graph["autoprec.policy"]


def stale_imports(paths: list[Path]) -> list[str]:
    """``file:line module`` for each import of an ``autoprec`` module that does not exist
    (a path from before a move)."""
    modules = _modules()
    stale = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.startswith("autoprec.") and name not in modules:
                    stale.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return stale


def test_every_import_of_autoprec_names_a_module_that_exists() -> None:
    root = PACKAGE.parent
    paths = [*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py")]
    paths += [*(root / "benchmarks").rglob("*.py"), *(root / "docs").rglob("*.py")]
    assert stale_imports(sorted(paths)) == []


def test_no_import_cycles() -> None:
    """Function-level and ``TYPE_CHECKING`` imports included: the code that acts on a
    policy or a space types it by what is below both (`autoprec.precision.view`,
    `autoprec.space.fields`), never by the class whose methods call it."""
    graph = import_graph()
    found = [
        f"{len(component)} modules ({', '.join(component)}), one cycle: "
        + " -> ".join(_one_cycle(graph, set(component)))
        for component in tangles(graph)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_errors_import_nothing_of_the_package() -> None:
    """Every module may raise autoprec's errors, so `autoprec.errors` sits below them all."""
    path = PACKAGE / "errors.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "autoprec"]
        elif isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] == "autoprec"
        ):
            found.append("." * node.level + (node.module or ""))
    assert found == []


# The layers above the trials (`autoprec.trials`), as DESIGN.md's data flow has them: the
# search that runs trials and what it leaves behind. Each is a module or a package.
ABOVE_THE_TRIALS = (
    "autoprec.cli",  # the command
    "autoprec.settings",  # every search setting, the modes' sections among them
    "autoprec.study",  # the search: session, loop, workers, summary, confirmation
    "autoprec.tracking",  # the Tracker, which records the trials' Results
    "autoprec.report",  # a study's report: each mode's view
    "autoprec.exports",  # what a finished study is exported as
    # Trials launched across devices: the launch wraps any mode's trial, and each rank runs
    # the training trial's loop (DESIGN.md: the modes' launch.py).
    "autoprec.distributed.launch",
    "autoprec.distributed.rank",
    # The serving mode's measurement and its result type, built on the trials' results.
    "autoprec.serving.measure",
    # The zoo's calibration: it runs trials exactly as a search does, to measure every
    # automatic judgement on tasks with known ground truth.
    "autoprec.tasks.zoo",
)


def trials_importers_below(graph: dict[str, set[str]]) -> list[str]:
    """``module -> trials module`` for each import of `autoprec.trials` (any of its
    modules, in any way) by a module neither in it nor above it (`ABOVE_THE_TRIALS`, and
    the facade, `autoprec`)."""

    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    found = []
    for module, targets in sorted(graph.items()):
        if module == "autoprec" or within(module, "autoprec.trials"):
            continue
        if any(within(module, above) for above in ABOVE_THE_TRIALS):
            continue
        found += [f"{module} -> {t}" for t in sorted(targets) if within(t, "autoprec.trials")]
    return found


def test_nothing_below_the_trials_imports_them() -> None:
    """A trial runs on what is below it (the policy, precision, numerics, profile, space,
    serving's conversion, tasks, devices) and what is below never asks the trials: the
    modes it needs are declared in `autoprec.modes`, below the policy and the space, and
    their trials are loaded by name (``Mode.trials``). Only the layers above the trials
    (`ABOVE_THE_TRIALS`: the search and what it leaves behind, the launch across devices,
    the serving mode's measurement, the zoo's calibration) import `autoprec.trials`."""
    assert trials_importers_below(import_graph()) == []


def test_precision_numerics_and_formats_never_import_serving() -> None:
    """Serving converts weights by what is below it (the formats, their methods and
    torchao's quiet import, `autoprec.formats.methods`); what lands a policy, watches the
    numbers or declares a format never asks serving."""
    below = ("autoprec.precision", "autoprec.numerics", "autoprec.formats")
    found = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items())
        if module.startswith(below)
        for target in sorted(targets)
        if target.startswith("autoprec.serving")
    ]
    assert found == []


def test_the_policy_is_read_without_torch() -> None:
    """`autoprec.policy` is plain data at the bottom: reading, checking and writing a
    policy imports no torch (its methods on a model import what acts on it when called)."""
    code = (
        "import sys, autoprec.policy\n"
        "policy = autoprec.policy.Policy.from_yaml('default: bf16\\nrules: []\\n')\n"
        "assert autoprec.policy.Policy.from_yaml(policy.to_yaml()) == policy\n"
        "assert 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_sub_package_ships_in_the_wheel() -> None:
    """pyproject lists the packages a wheel holds: a sub-package left out imports in an
    editable install and is missing from a real one."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {
        ".".join(path.parent.relative_to(PACKAGE.parent).parts)
        for path in PACKAGE.rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)


if __name__ == "__main__":
    # The tangles of modules that import each other, by size, with one cycle through each.
    graph = import_graph()
    for component in sorted(tangles(graph), key=len, reverse=True):
        print(len(component), " -> ".join(_one_cycle(graph, set(component))))


def test_no_module_imports_through_the_public_facade() -> None:
    """Inside the package, names come from the module that defines them: ``from autoprec
    import Policy`` (the facade's lazy table) hides the real dependency from this graph."""
    through = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            facade = isinstance(node, ast.ImportFrom) and node.module == "autoprec"
            if facade or "autoprec" in names:
                through.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert through == []


def test_no_module_imports_another_modules_private_names() -> None:
    """A name starting with ``_`` is its module's own: another module that needs it needs
    a public name (a private module of the package itself, ``_util``, is imported whole)."""
    private = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoprec"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        private.append(
                            f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {alias.name}"
                        )
    assert private == []


# What a branch on the mode looks like: a mode's name, a serving flag, a result type.
MODE_NAMES = {"training", "serving", "inference"}
MODE_FLAGS = {"inference", "serving", "is_inference", "is_serving"}
RESULT_TYPES = {"TrialResult", "ServingResult"}


def _asks_the_mode(test: ast.AST) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Constant) and node.value in MODE_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in MODE_FLAGS:
            return True
        if isinstance(node, ast.Name) and node.id in MODE_FLAGS:
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and any(isinstance(n, ast.Name) and n.id in RESULT_TYPES for n in ast.walk(node))
        ):
            return True
    return False


def mode_branches(root: Path = PACKAGE) -> list[str]:
    """``file:line`` of every ``if``, ternary, ``while``, assert and comprehension
    condition outside the modes' own modules (``autoprec/trials/``) that asks which mode
    it is in: by a mode's name, a serving flag, or ``isinstance`` on a result type."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "trials" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            tests: list[ast.AST] = []
            if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
                tests = [node.test]
            elif isinstance(node, ast.comprehension):
                tests = list(node.ifs)
            found += [
                f"{path.relative_to(root.parent)}:{t.lineno}" for t in tests if _asks_the_mode(t)
            ]
    return found


def test_the_scan_finds_branches_on_the_mode(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "x = 1 if mode == 'serving' else 2\n"
        "if space.inference:\n    pass\n"
        "assert isinstance(r, TrialResult)\n"
        "y = [m for m in ms if m.trains]\n"
    )
    assert sorted(mode_branches(package)) == ["pkg/a.py:1", "pkg/a.py:2", "pkg/a.py:4"]


def test_no_branch_on_the_mode_outside_the_modes() -> None:
    """The generic code asks the mode object (`autoprec.trials.Mode`); only the modes'
    own modules (`autoprec/trials/`) know which mode they are."""
    assert mode_branches() == []
