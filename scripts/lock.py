"""Re-resolve the project's one environment and write it as three layered lock files.

One resolve (torch 2.13.0's CPU wheel, the project's dependencies, its `lab` and `test` extras from pyproject.toml)
decides every version; the layers are the parts of it each make target installs:

- requirements/runtime.txt: what the package imports (``make demo``);
- requirements/lab.txt: JupyterLab, ipykernel and vLLM's CPU build on top (``make lab``);
- requirements/test.txt: the test tools on top (``make test``).

Each layer is re-resolved under the full resolve's pins as constraints, so the three files never disagree on a
version. A few packages that others name stay out (``LEFT_OUT`` says why); the installs use ``--no-deps``, so
nothing brings them back. Needs the package registries:

    python3 scripts/lock.py [-c constraints.txt]    # -c: keep these versions where the resolve allows
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
CUDA_ONLY = "vLLM's metadata names PyPI's CUDA build, which replaces the CPU torch; vLLM's CPU backend does not use it"
LEFT_OUT = {
    "torchvision": CUDA_ONLY, "torchaudio": CUDA_ONLY, "torchcodec": CUDA_ONLY, "triton": CUDA_ONLY,
    # jsonschema imports it whenever it is installed, and it compiles a grammar on import: 1.1 s in every process
    # that imports Ray (each rank of each group, 1.6 s -> 0.4 s for `import ray`); JupyterLab's event schemas
    # validate without it (jsonschema then skips the IRI formats)
    "rfc3987-syntax": "its import costs 1.1 s in every Ray process",
}
LAYERS = {
    "runtime": "What the package imports (make demo)",
    "lab": "JupyterLab, ipykernel and vLLM's CPU build, on top of runtime.txt (make lab)",
    "test": "The test and lint tools, on top of lab.txt (make test)",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(pip: list[str], roots: list[str], constraints: list[str]) -> dict[str, tuple[str, str]]:
    """{canonical name: (display name, version)} of everything pip would install for ``roots``."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pinned = Path(scratch) / "constraints.txt"
        pinned.write_text("\n".join(constraints) + "\n")
        subprocess.run([*pip, "install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report),
                        "-c", str(pinned), *roots], check=True)
        found = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): (item["metadata"]["name"], item["metadata"]["version"])
            for item in found}


def write_layer(name: str, resolved: dict[str, tuple[str, str]], below: str | None) -> None:
    lines = [f"# {LAYERS[name]}.", "# One resolve with the other layers (make lock); install with pip install "
             "--no-deps:", "# every dependency is listed.", *([f"-r {below}.txt"] if below else [])]
    lines += [f"{display}=={version.removesuffix('+cpu')}"
              for _, (display, version) in sorted(resolved.items())]
    (ROOT / "requirements" / f"{name}.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--constraint", help="versions to keep where the resolve allows (a pip constraints file)")
    args = parser.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = {"runtime": [TORCH, *project["dependencies"]]}
    roots["lab"] = [*roots["runtime"], *project["optional-dependencies"]["lab"]]
    roots["test"] = [*roots["lab"], *project["optional-dependencies"]["test"]]
    kept = Path(args.constraint).read_text().splitlines() if args.constraint else []
    with tempfile.TemporaryDirectory() as scratch:
        venv.create(scratch, with_pip=True)
        pip = [str(Path(scratch) / "bin" / "python"), "-m", "pip"]
        everything = resolve(pip, roots["test"], kept)
        pins = [f"{display}=={version}" for _, (display, version) in everything.items()]
        layers, below = {}, {}
        for name in LAYERS:
            layers[name] = {key: pin for key, pin in resolve(pip, roots[name], pins).items()
                            if key not in below and key not in LEFT_OUT}
            below |= layers[name]
    for lower, name in zip([None, *LAYERS], LAYERS, strict=False):
        write_layer(name, layers[name], lower)
    print(f"wrote {', '.join(f'{name}.txt ({len(layers[name])})' for name in LAYERS)}", file=sys.stderr)


if __name__ == "__main__":
    main()
