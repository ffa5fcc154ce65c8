"""``hybridflow-lab bench e2e``: end-to-end RL throughput, the paper's metric, beside TRL's in the same run.

Every workload is GRPO with 16 prompts x 4 samples, one optimizer step per batch (so the update's own
forward pass gives the old log-probs) and KL 0.04 to the reference:

- ``standard``: Qwen2 architecture (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 1024,
  float32, character tokenizer); ``a+b=`` prompts (a, b < 1000) left-padded to 16 tokens; every
  response exactly 64 tokens. Tokens per step = 64 x (16 + 64) = 5120 positions, padding included.
- ``natural``: the same model and prompts; each response ends with EOS after its length in a fixed
  per-row schedule (``NATURAL_LENGTHS``, 2 to 128 tokens) so that both sides do the same work; the
  tokens counted are the real ones, prompt and response (verl's ``attention_mask.sum()``).
- ``smollm2``: SmolLM2-135M-Instruct (``make models``), fully fine-tuned; ``a+b=`` prompts through its
  chat template; 64 forced response tokens; real tokens counted.
- ``standard-bf16``: the standard workload in each side's bfloat16 mixed precision: ours
  ``actor.engine.bf16`` (DeepSpeed's bf16 weights over float32 master weights), TRL's ``bf16=True`` (autocast
  over float32 weights); the matmul rate it is compared with is bfloat16's.

Ours generate with the built-in engine, where a C++ compiler exists with its decoding step in C++ over
oneDNN's pre-packed weights (``rollout.decoding=onednn``; compiled by ``torch.compile`` instead in bfloat16
or without oneDNN, ``rollout.decoding=compiled``), else eager (``decode_step`` in the report says which, and
why). There the training and scoring passes run each layer's work outside attention compiled too
(``actor.engine.torch_compile``; ``layers``), except under FSDP, which that option refuses.

Reported beside the tokens/s: each stage's median seconds, each stage's FLOPs over its time and this
machine's matmul rate (``stage_flop_fraction``), the step's share of that roofline, and with ``peer`` (a
virtualenv holding TRL, ``make trl-env``) TRL's ``GRPOTrainer`` on the same workload (``peer_tok_s``,
``ratio_vs_peer``). The two alternate in blocks of steps (``peer_block_steps``), each side idle while the other
runs, so that the machine's slow minutes hit both alike. Then each side runs as many steps again without
alternating: ours while TRL waits, then TRL's after our Lab has shut down (``alone_tok_s``, ``peer_alone_tok_s``,
``ratio_vs_peer_alone``). The two ratios differ: in the alternating blocks each side starts with the other's data
in the caches, and TRL's run beside our idle Lab, whose Ray processes still take some of the machine.
On ``smollm2``, whose TRL step needs 14 GB beside our Lab's, ours run first and all of TRL's after our Lab has
shut down, so the two ratios are the same.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow_lab.bench.peer import peer_command, peer_figures, started_peer
from hybridflow_lab.bench.roofline import matmul_gflops
from hybridflow_lab.config.rules import compiled_layers_refusal
from hybridflow_lab.config.schema import EngineConfig
from hybridflow_lab.models import create_model_dir, describe, load_causal_lm, load_config
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.families import model_impl as path_of
from hybridflow_lab.models.onednn_decode import missing_onednn, unmirrored_architecture
from hybridflow_lab.trainer.lab import Lab

STAGES = ("generate", "reward", "old_log_prob", "ref", "adv", "update_actor")
FORWARDS = {"generate": 1, "old_log_prob": 1, "ref": 1, "update_actor": 3}  # backward = two forwards
STANDARD_POSITIONS = 16 + 64  # per sequence: the padded prompt and the response
NATURAL_LENGTHS = (2, 3, 5, 8, 12, 17, 23, 30, 38, 47, 57, 68, 80, 94, 110, 128)  # mean 45.1; divides 32 rows


def standard_lab(tmp: str, ranks: int = 2, engine: str = "deepspeed", backend: str = "ray",
                 extra: tuple[str, ...] = (), model: Path | None = None) -> Lab:
    """A Lab running the standard workload (plus ``extra`` overrides) on ``model`` (default: the standard model),
    its run directory under ``tmp``."""
    model = model or standard_model(tmp)
    return Lab("arithmetic_grpo", overrides=(
        f"actor.model_path={model}", f"trainer.run_dir={tmp}/run", "trainer.progress=false",
        f"backend={backend}", f"actor.ranks={ranks}", f"actor.engine.backend={engine}", "task.digits=3",
        "task.eval_size=8",
        "rollout.max_prompt_tokens=16", "rollout.pad_prompts=true", "rollout.max_new_tokens=64",
        "rollout.ignore_eos=true", "batch.rollout_batch_prompts=16", "batch.samples_per_prompt=4",
        "batch.update_minibatch_sequences=64", f"batch.micro_batch_sequences_per_rank={64 // ranks}",
        "algorithm.kl_loss_coef=0.04", *extra,
    ))


def standard_model(tmp: str, arch: str = "qwen2") -> Path:
    """The standard-size model of family ``arch``, seeded, under ``tmp`` (made once)."""
    path = Path(tmp) / f"model-{arch}"
    return path if (path / "config.json").is_file() else create_model_dir(path, "standard", arch, seed=0)


def smollm2_dir(tmp: str) -> Path:
    """The packaged SmolLM2-135M-Instruct imported as an HF directory under ``tmp``."""
    from hybridflow_lab.models.gguf_import import import_gguf, packaged_model_file

    return import_gguf(packaged_model_file("smollm2"), Path(tmp) / "smollm2").path


@dataclass(frozen=True)
class Workload:
    """A workload's Lab settings beyond the standard ones, and how its tokens are counted."""

    overrides: tuple[str, ...] = ()
    model: Callable[[str], Path] | None = None  # None: the standard model
    real_tokens: bool = True  # count the real tokens (else the standard workload's fixed 5120 positions)
    steps: int = 8
    warmup: int = 2
    block: int | None = 2  # measured steps per block when alternating with the peer; None: ours all, then TRL's
    bf16: bool = False  # each side's bfloat16 mixed precision (ours: actor.engine.bf16)


WORKLOADS = {
    "standard": Workload(real_tokens=False),
    "standard-bf16": Workload(bf16=True, real_tokens=False),
    "natural": Workload(("rollout.ignore_eos=false", f"rollout.forced_lengths={list(NATURAL_LENGTHS)}",
                         f"rollout.max_new_tokens={max(NATURAL_LENGTHS)}")),
    "smollm2": Workload(("rollout.max_prompt_tokens=48", "rollout.pad_prompts=false", "task.chat_template=true"),
                        smollm2_dir, steps=3, warmup=1, block=None),  # TRL's step holds 14 GB
}


def step_tokens(metrics: dict[str, float], rows: int, real: bool) -> float:
    """Tokens one step counts: real prompt and response tokens, or the standard workload's positions."""
    if not real:
        return rows * STANDARD_POSITIONS
    return rows * (metrics["prompt_length/mean"] + metrics["response_length/mean"])


def run(steps: int | None = None, warmup: int | None = None, ranks: int = 2, engine: str = "deepspeed",
        backend: str = "ray", workload: str = "standard", peer: str | None = None, arch: str = "qwen2",
        model_impl: str = "auto") -> dict[str, Any]:
    """``steps`` measured RL steps of ``workload`` after ``warmup`` (default: the workload's), with ``peer``
    alternating with TRL's on the same workload; ``arch``: the standard model's family (TRL's side trains the same
    directory), ``model_impl``: the path ours runs it on. One JSON-ready report."""
    spec = WORKLOADS[workload]
    steps, warmup = steps or spec.steps, warmup if warmup is not None else spec.warmup
    lengths = NATURAL_LENGTHS if workload == "natural" else ()
    block = math.gcd(spec.block, steps) if spec.block else steps  # divides `steps`: TRL pauses where ours end
    peer_steps = steps + steps if spec.block else steps  # alternating, then alone
    if spec.model and arch != "qwen2":
        raise SystemExit(f"hybridflow-lab bench e2e: error: --arch is for the standard-size workloads; {workload} "
                         "brings its own model")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = spec.model(tmp) if spec.model else standard_model(tmp, arch)
        model_config = load_config(model)
        impl = path_of(model_config, model_impl)
        no_compiler = missing_cpp_compiler()
        compiled, compiled_report = compile_settings(engine, no_compiler, spec.bf16, impl, model_config.model_type)
        # TRL's trainer compiles its model too where ours compile (faster on this CPU: docs/performance.md)
        command = peer_command(peer, workload, peer_steps, warmup, block, lengths,
                               torch_compile=compiled_report["layers"] == "compiled") if peer else None
        theirs = None
        if command:  # set up before our Lab starts, so that neither side's setup overlaps the other's steps
            theirs = stack.enter_context(started_peer([*command, "--model", str(model)]))
        lab = standard_lab(tmp, ranks, engine, backend, (f"actor.model_impl={model_impl}", *spec.overrides,
                                                         *(["actor.engine.bf16=true"] if spec.bf16 else []),
                                                         *compiled), model)
        stack.callback(lab.shutdown)
        counts = describe(load_causal_lm(lab.config.actor.model_path))
        rows = lab.config.batch.step_sequences
        precision = torch.bfloat16 if lab.config.actor.engine.bf16 else torch.float32  # the roofline's too
        for _ in range(warmup):
            lab.step()
        history: list[dict[str, float]] = []
        for start in range(0, steps, block):
            history += [lab.step() for _ in range(min(block, steps - start))]
            if theirs and spec.block:
                theirs.next_block()  # TRL's block of steps, between two of ours
        # then each side's steps without alternating: ours while TRL waits, TRL's once our Lab has shut down
        alone = [lab.step() for _ in range(steps)] if theirs and spec.block else history
        peer_report = None
        if theirs:
            lab.shutdown()  # (on smollm2, before any of TRL's steps: the two do not fit in memory together)
            peer_report = theirs.run_to_end()
        rate = matmul_gflops(dtype=precision)
        figures = functools.partial(throughput, rows=rows, parameters=counts["non_embedding_parameters"],
                                    head=counts["head_parameters"], real_tokens=spec.real_tokens, rate=rate)
        report = {"bench": "e2e", "workload": workload, "arch": model_config.model_type, "model_impl": impl,
                  "actor_ranks": ranks, "engine": lab.config.actor.engine.backend,
                  "steps": steps, "precision": str(precision).removeprefix("torch."),
                  **compiled_report, **figures(history)}
        if peer_report:
            report.update(peer_comparison(report, figures(alone), peer_report, steps, block if spec.block else None))
    return report


def compile_settings(engine: str, no_compiler: str | None, bf16: bool, impl: str = "native",
                     model_type: str = "qwen2") -> tuple[tuple[str, ...], dict[str, str]]:
    """The overrides that speed up our decoding step and compile our training layers where they can (``no_compiler``:
    why inductor cannot here, if so; ``bf16``: the workload trains in bfloat16; ``impl``: the model's path, and the
    transformers path has neither), and the report's ``decode_step`` and ``layers``: how each ran, and why not
    faster. Decoding runs the oneDNN step (float32, the families it mirrors), else compiled."""
    if no_compiler or impl == "transformers":
        why = no_compiler or "the transformers path runs the family's own code"
        return (), {"decode_step": f"eager: {why}", "layers": f"eager: {why}"}
    no_onednn = "the oneDNN step runs float32 only" if bf16 else missing_onednn() or unmirrored_architecture(model_type)
    decode, decode_report = ((("rollout.decoding=compiled",), f"compiled ({no_onednn})") if no_onednn
                             else (("rollout.decoding=onednn",), "onednn"))
    refusal = compiled_layers_refusal("actor", EngineConfig(backend=engine))
    if refusal:
        return decode, {"decode_step": decode_report, "layers": f"eager: {refusal}"}
    return (*decode, "actor.engine.torch_compile=true"), {"decode_step": decode_report, "layers": "compiled"}


def peer_comparison(ours: dict[str, Any], ours_alone: dict[str, Any], peer: dict[str, Any], steps: int,
                    block: int | None) -> dict[str, Any]:
    """TRL's figures beside ours: over its first ``steps`` measured steps, which alternated with ours in blocks of
    ``block``, and over its last ``steps``, run alone after our Lab shut down, beside ``ours_alone`` (our steps
    run while TRL waited). On smollm2 (``block`` None) every step of each side ran alone."""
    tok_s, step_s = peer_figures(peer, slice(0, steps))
    alone_tok_s, alone_step_s = peer_figures(peer, slice(-steps, None))
    return {"peer_tok_s": tok_s, "peer_step_s": step_s, "ratio_vs_peer": round(ours["tokens_per_s_median"] / tok_s, 3),
            "alone_tok_s": ours_alone["tokens_per_s_median"], "alone_step_s": ours_alone["step_s_median"],
            "peer_alone_tok_s": alone_tok_s, "peer_alone_step_s": alone_step_s,
            "ratio_vs_peer_alone": round(ours_alone["tokens_per_s_median"] / alone_tok_s, 3),
            "peer_block_steps": block or "none: ours, then TRL's", "peer": peer}


def throughput(history: list[dict[str, float]], rows: int, parameters: int, head: int, real_tokens: bool,
               rate: float) -> dict[str, Any]:
    """Tokens/s, per-stage medians and FLOP fractions of measured steps; ``rate`` is the matmul GFLOP/s,
    ``parameters`` the non-embedding ones and ``head`` the lm_head's."""
    tokens = [step_tokens(m, rows, real_tokens) for m in history]
    step_s = statistics.median(m["timing_s/step"] for m in history)
    tokens_median = statistics.median(tokens)
    responses = rows * statistics.median(m["response_length/mean"] for m in history)
    stage_s = {s: statistics.median(m.get(f"timing_s/{s}", 0.0) for m in history) for s in STAGES}
    # a forward is 2 N flops per token, plus the head's at each response token (where logits are computed); the
    # old log-probs' pass counts only when that stage ran
    forward_gflop = 2 * (parameters * tokens_median + head * responses) / 1e9
    stage_gflop = {s: forward_gflop * n for s, n in FORWARDS.items() if stage_s[s] > 0}
    flops = sum(stage_gflop.values())
    return {
        "tokens_counted": "real prompt + response tokens" if real_tokens else "prompt positions + response tokens",
        "tokens_per_step": round(tokens_median, 1), "step_s_median": round(step_s, 3),
        "tokens_per_s_median": round(statistics.median(t / m["timing_s/step"] for t, m in zip(tokens, history,
                                                                                                strict=True)), 1),
        "stage_s_median": {s: round(v, 4) for s, v in stage_s.items()},
        "stage_flop_fraction": {s: round(g / stage_s[s] / rate, 3) for s, g in stage_gflop.items()},
        "matmul_gflops": round(rate, 1), "step_gflop": round(flops, 1),
        "roofline_fraction": round(flops / step_s / rate, 3),
        "roofline_tokens_per_s": round(tokens_median / (flops / rate), 1),
    }
