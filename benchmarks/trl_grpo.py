"""TRL ``GRPOTrainer`` throughput on ``hybridflow-lab bench e2e``'s workloads: its peer (``--peer``).

Standard workload, as close as TRL allows: Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads,
intermediate 1024, untied embeddings, float32) built from a config with seed 0; a character tokenizer
equivalent to ``hybridflow_lab.models.tokenizers.char_tokenizer``; ``a+b=`` prompts (a, b < 1000)
left-padded with ``<pad>`` (attention mask 0) to 16 positions (``pad_to_multiple_of=16``; every prompt
is at most 8 characters); GRPO with 16 prompts x 4 samples = 64 sequences and one optimizer step per
step; every completion exactly 64 tokens (``min_new_tokens=64`` masks EOS, ``max_completion_length=64``);
temperature 1.0; KL 0.04 to a reference model; plain ``transformers`` generate; 2 CPU threads.
Tokens per step = 64 x (16 + 64) = 5120.

``--workload natural``: the same, but row r of each generation ends with EOS after
``forced_lengths[r % len]`` tokens (a logits processor: EOS ruled out before, the only choice at it), up to
128; tokens counted are the real ones (prompt and completion masks summed). ``--workload smollm2``: the
model directory ``--model`` (SmolLM2-135M-Instruct) with its tokenizer, ``a+b=`` as a user turn through its
chat template, prompts padded to the batch's longest, 64 forced completion tokens, real tokens counted.
``--workload standard-bf16``: the standard workload in bfloat16 mixed precision (``bf16=True``: autocast over the
float32 weights). On the standard-size workloads ``--model`` replaces the built model with a directory of the same
size and tokenizer (``bench e2e --arch qwen3`` passes the one it built). Prints one JSON object.

``--pause-every K`` (``bench e2e --peer`` passes it): before its first step, and after the warmup and every K
measured steps, the script prints ``{"paused": <steps done>}`` and waits for a line on stdin, so that its blocks
of steps can alternate with another run's. Pauses are not timed.

``--torch-compile`` (``bench e2e --peer`` passes it where a C++ compiler exists, as its own side then compiles):
the trainer's ``torch_compile=True``, which runs the model through ``torch.compile``. On the standard and natural
workloads it made TRL's step 3-10% faster here.

Runs in its own virtualenv (see benchmarks/README.md), not the project's::

    .venv-trl/bin/python benchmarks/trl_grpo.py --steps 8 --warmup 2

On a machine where another process competes for the cores, set ``OMP_WAIT_POLICY=PASSIVE``: with
OpenMP's default spin-waiting, 2 threads sharing a busy core made ``generate`` ~20x slower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    PrinterCallback,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 16, 4, 16, 64
SEQUENCES = PROMPTS * SAMPLES
TOKENS_PER_STEP = SEQUENCES * (PROMPT_TOKENS + NEW_TOKENS)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character plus pad/bos/eos/unk (same vocabulary and order as the project's)."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *dict.fromkeys(CHARACTERS)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")


def save_model(path: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> None:
    """The standard model, seeded, saved with its tokenizer (TRL reloads the reference model from ``path``)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)


def arithmetic_dataset(size: int, seed: int = 0, chat: bool = False) -> Dataset:
    """``a+b=`` prompts, as plain text or as one user turn (TRL then applies the chat template)."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(1000), rng.randrange(1000)) for _ in range(size)]
    prompts = [f"{a}+{b}=" for a, b in pairs]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts] if chat else prompts,
                              "answer": [str(a + b) for a, b in pairs]})


def exact_sum(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion starts with the correct sum, else 0.0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(c.startswith(a)) for c, a in zip(texts, answer, strict=True)]


class ForcedLengths(LogitsProcessor):
    """Row r ends with EOS after ``lengths[r % len]`` generated tokens: EOS ruled out before, the only choice at it."""

    def __init__(self, lengths: list[int], eos_token_id: int) -> None:
        self.lengths, self.eos_token_id, self.start = torch.tensor(lengths), eos_token_id, -1

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.start < 0:
            self.start = input_ids.shape[1]
        generated = input_ids.shape[1] - self.start
        last = (self.lengths[torch.arange(scores.shape[0]) % len(self.lengths)] == generated + 1)[:, None]
        is_eos = torch.arange(scores.shape[1]) == self.eos_token_id
        return scores.masked_fill(last & ~is_eos | ~last & is_eos, float("-inf"))


def force_lengths(model: torch.nn.Module, lengths: list[int], eos_token_id: int) -> None:
    """Every ``model.generate`` call gets a fresh ``ForcedLengths`` processor."""
    generate = model.generate

    def forced(*args: Any, **kwargs: Any) -> Any:
        return generate(*args, logits_processor=LogitsProcessorList([ForcedLengths(lengths, eos_token_id)]), **kwargs)

    model.generate = forced


class ShapeCheckingGRPOTrainer(GRPOTrainer):
    """Records the batch each generation hands to the update: sequences, prompt positions, completion tokens (mean
    per row), and the real tokens (prompt and completion masks summed)."""

    shapes: list[tuple[int, int, float, int]]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        rows, prompt_len = out["prompt_ids"].shape
        real = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
        self.shapes.append((rows, prompt_len, out["completion_mask"].sum(1).float().mean().item(), real))
        return out


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (generate, reward, reference, update); before the steps numbered in
    ``pause_before`` it says so on stdout and waits for a line on stdin, untimed."""

    def __init__(self, pause_before: frozenset[int] = frozenset()) -> None:
        self.times: list[float] = []
        self.pause_before = pause_before
        self._start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if len(self.times) in self.pause_before:
            print(json.dumps({"paused": len(self.times)}), flush=True)
            sys.stdin.readline()
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def pauses(steps: int, warmup: int, every: int) -> frozenset[int]:
    """The steps to pause before: the first, then after the warmup and every ``every`` measured steps (none if 0)."""
    return frozenset([0, *range(warmup + every, warmup + steps, every)]) if every else frozenset()


def run(steps: int = 8, warmup: int = 2, threads: int = 2, workload: str = "standard",
        forced_lengths: list[int] | None = None, model: str | None = None, pause_every: int = 0,
        torch_compile: bool = False) -> dict[str, Any]:
    torch.set_num_threads(threads)
    bf16, workload = workload.endswith("-bf16"), workload.removesuffix("-bf16")
    natural, real_model = workload == "natural", workload == "smollm2"
    if natural and not forced_lengths:
        raise SystemExit("trl_grpo.py: --workload natural needs --forced-lengths")
    if real_model and not model:
        raise SystemExit("trl_grpo.py: --workload smollm2 needs --model DIR (the imported SmolLM2 directory)")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer: PreTrainedTokenizerBase
        if model:
            tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
        else:
            tokenizer, model = char_tokenizer(), f"{tmp}/model"
            save_model(model, tokenizer)
        new_tokens = max(forced_lengths) if natural and forced_lengths else NEW_TOKENS
        generation = {} if natural else {"min_new_tokens": NEW_TOKENS}
        config = GRPOConfig(
            output_dir=f"{tmp}/out", max_steps=warmup + steps, seed=0,
            per_device_train_batch_size=SEQUENCES, num_generations=SAMPLES, gradient_accumulation_steps=1,
            num_iterations=1, max_completion_length=new_tokens, generation_kwargs=generation,
            pad_to_multiple_of=None if real_model else PROMPT_TOKENS, temperature=1.0, beta=0.04, loss_type="dapo",
            epsilon_high=0.28, learning_rate=1e-6, gradient_checkpointing=False, bf16=bf16, fp16=False,
            use_vllm=False, use_cpu=True, dataloader_num_workers=0, logging_steps=1, save_strategy="no",
            eval_strategy="no", report_to="none", disable_tqdm=True, torch_compile=torch_compile,
        )
        timer = StepTimer(pauses(steps, warmup, pause_every))
        trainer = ShapeCheckingGRPOTrainer(
            model=model, reward_funcs=exact_sum, args=config, processing_class=tokenizer,
            train_dataset=arithmetic_dataset(PROMPTS * (warmup + steps), chat=real_model), callbacks=[timer],
        )
        trainer.remove_callback(PrinterCallback)  # per-step logs would break the one-JSON-object output
        trainer.shapes = []
        if natural and forced_lengths:
            force_lengths(trainer.model, forced_lengths, tokenizer.eos_token_id)
        trainer.train()
    rows, prompt_lens, completion_lens, real = zip(*trainer.shapes, strict=True)
    assert set(rows) == {SEQUENCES}, trainer.shapes
    if workload == "standard":
        assert set(prompt_lens) == {PROMPT_TOKENS}, trainer.shapes
    if natural and forced_lengths:
        expected = statistics.mean(forced_lengths[r % len(forced_lengths)] for r in range(SEQUENCES))
        assert set(completion_lens) == {expected}, trainer.shapes
    else:
        assert set(completion_lens) == {float(NEW_TOKENS)}, trainer.shapes
    tokens = [TOKENS_PER_STEP] * len(real) if workload == "standard" else list(real)
    measured, counted = timer.times[warmup:], tokens[warmup:]
    return {
        "bench": "trl_grpo", "workload": workload + ("-bf16" if bf16 else ""), "trl_version": trl.__version__,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__, "steps": len(measured),
        "warmup": warmup, "sequences_per_step": rows[0], "prompt_tokens": max(prompt_lens),
        "completion_tokens_mean": statistics.mean(completion_lens),
        "tokens_counted": "prompt positions + completion tokens" if workload == "standard"
        else "real prompt + completion tokens",
        "tokens_per_step": statistics.median(counted),
        "step_s_median": round(statistics.median(measured), 3),
        "tokens_per_s_median": round(statistics.median(n / t for n, t in zip(counted, measured, strict=True)), 1),
        "step_s": [round(t, 4) for t in measured], "step_tokens": counted,
        "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch_compile": torch_compile,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--workload", choices=["standard", "standard-bf16", "natural", "smollm2"],
                        default="standard")
    parser.add_argument("--forced-lengths", help="natural: comma-separated completion lengths, row r gets the "
                                                 "(r mod count)-th (bench e2e passes its schedule)")
    parser.add_argument("--model", help="smollm2: the imported SmolLM2-135M-Instruct directory; otherwise a model of "
                                        "the standard size and tokenizer to train instead of the built one")
    parser.add_argument("--pause-every", type=int, default=0, help="pause before the first step, then after the "
                                                                 "warmup and every N measured steps (see above)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="the trainer's torch_compile (torch.compile of the model; bench e2e passes it where ours "
                             "compile)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    lengths = [int(n) for n in args.forced_lengths.split(",")] if args.forced_lengths else None
    print(json.dumps(run(args.steps, args.warmup, args.threads, args.workload, lengths, args.model,
                         args.pause_every, args.torch_compile)))


if __name__ == "__main__":
    main()
