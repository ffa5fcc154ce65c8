"""``hybridflow-lab``: the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _demo(args: argparse.Namespace) -> None:
    from hybridflow_lab.demos import controller_demo

    controller_demo.main(backend=args.backend)


def _bench(args: argparse.Namespace) -> None:
    if args.what == "dispatch":
        from hybridflow_lab.bench import dispatch

        quick = {"workers": (1, 2), "payloads": (0, 1 << 20), "repeats": 3} if args.quick else {}
        report = dispatch.run(**quick)
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

    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    bench.add_argument("what", choices=["dispatch"])
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
