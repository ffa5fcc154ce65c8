"""``hybridflow-lab``: the command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _demo(args: argparse.Namespace) -> None:
    from hybridflow_lab.demos import controller_demo

    controller_demo.main(backend=args.backend)


def _init_model(args: argparse.Namespace) -> None:
    from hybridflow_lab.models import create_model_dir, describe, load_causal_lm

    path = create_model_dir(args.path, args.size, args.arch, args.seed)
    print(json.dumps({"path": str(path), "size": args.size, "arch": args.arch, **describe(load_causal_lm(path))}))


QUICK_BENCH = {
    "dispatch": {"workers": (1, 2), "payloads": (0, 1 << 20), "repeats": 3},
    "rollout": {"size": "tiny", "prompts": 8, "new_tokens": 8, "repeats": 1},
    "train": {"size": "tiny", "rows": 4, "response": 8, "steps": 1},
}


def _bench(args: argparse.Namespace) -> None:
    module = importlib.import_module(f"hybridflow_lab.bench.{args.what}")
    report = module.run(**(QUICK_BENCH[args.what] if args.quick else {}))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow-lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the controller demo: two worker groups and one dataflow")
    demo.add_argument("--backend", choices=["ray", "local"], default="ray")
    demo.set_defaults(run=_demo)

    init = commands.add_parser("init-model", help="write a new tiny model directory (HF format) with its tokenizer")
    init.add_argument("path")
    init.add_argument("--size", default="tiny", choices=["tiny", "standard", "small"])
    init.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(run=_init_model)

    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    bench.add_argument("what", choices=sorted(QUICK_BENCH))
    bench.add_argument("--quick", action="store_true", help="a small, fast configuration (for smoke tests)")
    bench.add_argument("--out", help="also write the JSON to this file")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
