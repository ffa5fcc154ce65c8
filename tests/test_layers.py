"""Dependencies point down (ARCHITECTURE.md): each low layer imports only the layers beneath it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow_lab"
# a layer's own name is always allowed; a layer missing here is not constrained
MAY_IMPORT = {
    "algorithms": set(),  # pure torch functions
    "protocol": set(),
    "telemetry": set(),
    "controller": {"protocol", "telemetry", "exposure"},  # knows nothing of models
    "models": set(),
    "engines": {"models", "protocol"},
}
UI_IMPORTERS = {"ui", "trainer", "cli"}  # the Lab's dashboard() and the CLI open the UI; nothing below does
EXTERNAL_FOR = {"algorithms": {"torch"}}  # layers whose third-party imports are limited too


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_each_layer_imports_only_the_layers_beneath_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = layer_of(path)
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "hybridflow_lab" and len(parts) > 1:
                target = parts[1]
                if layer in MAY_IMPORT and target != layer and target not in MAY_IMPORT[layer]:
                    wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
                if target == "ui" and layer not in UI_IMPORTERS:
                    wrong.append(f"{path.relative_to(PACKAGE.parent)} imports the ui ({name})")
            elif layer in EXTERNAL_FOR and parts[0] not in sys.stdlib_module_names | EXTERNAL_FOR[layer]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert wrong == [], "\n".join(wrong)
