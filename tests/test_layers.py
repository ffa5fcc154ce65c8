"""Dependencies point down (ARCHITECTURE.md): every package of the project imports only the layers beneath it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow_lab"
# bottom to top; a package imports its own modules and the packages of lower layers, never a sibling in its
# layer, except the applications, which use each other (the CLI runs the benches and demos)
LAYERS = (
    ("protocol", "exposure", "redact", "seeds"),  # foundations
    ("config",),  # the run's settings and the rules between them (no I/O: the probes are dataflows.preflight)
    ("telemetry",),  # spans, stage summaries (of batches)
    ("algorithms", "models", "tasks", "controller"),  # pure torch; models; tasks; controller knows no model
    ("engines", "dataflows", "agents"),  # training and rollout engines; declared algorithms and their dataflows; tools,
    # environments and the multi-turn loop over any generate function
    ("hybrid",),  # the 3D-HybridEngine
    ("workers",),  # the roles
    ("placement",),  # plans, the auto-mapping search, the simulator
    ("trainer",),  # the Lab
    ("ui",),  # widgets and dashboards over the Lab and telemetry
    ("bench", "demos", "smoke", "cli", "lab_server", "__init__"),  # applications
)
APPLICATIONS = LAYERS[-1]
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}
EXTERNAL_FOR = {"algorithms": {"torch"}, "config": {"yaml"}, "protocol": {"numpy", "pandas", "torch"}}  # allowed


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports included
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def package_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_every_package_has_a_layer():
    packages = {package_of(path) for path in PACKAGE.rglob("*.py")}
    placed = set(LAYER_OF)
    assert packages == placed, f"no layer: {sorted(packages - placed)}; no longer there: {sorted(placed - packages)}"


def test_each_package_imports_only_the_layers_beneath_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = package_of(path)
        for name in imports(path):
            parts = name.split(".")
            where = f"{path.relative_to(PACKAGE.parent)} imports {name}"
            if parts[0] == "hybridflow_lab" and len(parts) > 1:
                target = parts[1]
                below = LAYER_OF[target] < LAYER_OF[package]
                if target != package and not below and not (package in APPLICATIONS and target in APPLICATIONS):
                    wrong.append(where)
            elif package in EXTERNAL_FOR and parts[0] not in sys.stdlib_module_names | EXTERNAL_FOR[package]:
                wrong.append(where)
    assert wrong == [], "\n".join(wrong)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """The project modules ``path`` imports (``from package import module`` counts as the module alone), wherever
    the import statement is: at the top, in a function, under ``TYPE_CHECKING``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            found.update(submodules if len(submodules) == len(node.names) else {node.module, *submodules})
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in MODULES}


def test_no_package_has_an_import_circle():
    """Within a package, module A importing B which (through others) imports A is a circle: neither can be read,
    tested or changed alone."""
    graph = {name: {m for m in imported_modules(path) if m != name} for name, path in MODULES.items()}
    circles = []
    for start in sorted(graph):
        package = start.rsplit(".", 1)[0] if MODULES[start].name != "__init__.py" else start
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start and len(trail) > 1:
                    circles.append(" -> ".join([*trail, start]))
                elif nxt not in seen and nxt.startswith(package + ".") and MODULES[nxt].name != "__init__.py":
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert circles == [], "\n".join(circles)


def private_names(tree: ast.AST) -> set[str]:
    """The private names (``_x``, not dunders) a module defines: functions, classes, assignments, attributes set
    on ``self``, parameters."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # __slots__ entries
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_module_uses_a_private_name_of_another_module():
    """``obj._name`` or ``from module import _name`` where ``_name`` is private to another module of the project: the
    reader of that module cannot see who depends on it."""
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    defined = {name: private_names(tree) for name, tree in trees.items()}
    everywhere = set().union(*defined.values())
    wrong = []
    for name, tree in sorted(trees.items()):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                used = node.attr
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridflow_lab"):
                used = next((a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")),
                            None)
                if used is not None:
                    wrong.append(f"{name}:{node.lineno} imports {node.module}.{used}")
                continue
            else:
                continue
            if used in everywhere and used not in defined[name]:
                wrong.append(f"{name}:{node.lineno} uses .{used}, private to another module")
    assert wrong == [], "\n".join(wrong)
