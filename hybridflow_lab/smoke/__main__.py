"""``python -m hybridflow_lab.smoke [--device cuda|cpu] [--checks ...]``: run the smoke checks, print one JSON."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow_lab.smoke import checks

CHECKS: dict[str, Callable[[checks.SmokeSetup], dict[str, Any]]] = {
    "placement": checks.placement, "engines": checks.engines, "reshard": checks.reshard,
    "compiled": checks.compiled, "vllm": checks.vllm, "ppo": checks.ppo,
}


def run(device: str, names: list[str], engines: tuple[tuple[str, int], ...] = checks.ENGINES,
        out: Path | None = None) -> dict[str, Any]:
    """The versions, then each named check (a failing one is reported with its error, the rest still run).
    With ``out``, the summary so far is written there after every check, so a run stopped by a time limit keeps
    what it found."""
    import ray

    from hybridflow_lab.controller import init_cluster, shutdown_cluster

    summary: dict[str, Any] = {"device": device, "versions": checks.versions(), "checks": {}}
    start = time.perf_counter()
    own_cluster = not ray.is_initialized()  # a notebook's or a test session's cluster stays up
    init_cluster(logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory(prefix="hybridflow-smoke-") as work:
            setup = checks.make_setup(device, Path(work), engines)
            summary["ranks"] = setup.ranks
            for name in names:
                began = time.perf_counter()
                try:
                    result = CHECKS[name](setup)
                except Exception as exc:  # one broken check must not hide the others' findings
                    result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                              "traceback": traceback.format_exc()[-4000:]}
                summary["checks"][name] = {**result, "seconds": round(time.perf_counter() - began, 1)}
                if out:
                    write_summary(summary, out)
    finally:
        if own_cluster:
            shutdown_cluster()
    summary["ok"] = all(c["ok"] for c in summary["checks"].values())
    summary["seconds"] = round(time.perf_counter() - start, 1)
    if out:
        write_summary(summary, out)
    return summary


def summary_json(summary: dict[str, Any]) -> str:
    """``summary`` as the indented JSON the script prints and writes."""
    return json.dumps(summary, indent=1, default=str)


def write_summary(summary: dict[str, Any], path: Path) -> None:
    path.write_text(summary_json(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow_lab.smoke", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of: {', '.join(CHECKS)}")
    parser.add_argument("--engines", default="", help="e.g. torch,deepspeed3 (default: all four)")
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args(argv)
    names = [n for n in args.checks.split(",") if n]
    unknown = sorted(set(names) - CHECKS.keys())
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    engines = tuple(e for e in checks.ENGINES if not args.engines or f"{e[0]}{e[1] or ''}" in args.engines.split(","))
    summary = run(args.device, names, engines, Path(args.out) if args.out else None)
    print(summary_json(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
