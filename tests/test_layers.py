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
    ("telemetry",),  # spans, stage summaries (of batches)
    ("algorithms", "models", "tasks", "controller"),  # pure torch; models; tasks; controller knows no model
    ("config",),  # the run's settings and their checks
    ("engines", "dataflows"),  # training and rollout engines; declared algorithms and their dataflows
    ("hybrid",),  # the 3D-HybridEngine
    ("workers",),  # the roles
    ("placement",),  # plans, the auto-mapping search, the simulator
    ("trainer",),  # the Lab
    ("ui",),  # widgets and dashboards over the Lab and telemetry
    ("bench", "demos", "smoke", "cli", "lab_server", "__init__"),  # applications
)
APPLICATIONS = LAYERS[-1]
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}
EXTERNAL_FOR = {"algorithms": {"torch"}, "protocol": {"numpy", "pandas", "torch"}}  # third-party imports allowed


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
