"""Bad inputs, table by table: each fails while a ``Lab`` is built with ``start=False`` (no worker exists), with
a message that names the key, file or row and says what to set instead. Dynamic sampling that keeps no group
can only fail during a step; its table drives ``informative_batch`` with scored batches made by hand.

Every row changes one thing in an input that works (``test_the_inputs_the_tables_break_work``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pytest
import torch

from hybridflow_lab.config import ConfigError
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.dataflows import informative_batch
from hybridflow_lab.hybrid import ParallelLayout
from hybridflow_lab.models import char_tokenizer, create_model_dir, load_causal_lm
from hybridflow_lab.models.lora import LoraConfig, apply_lora, save_adapters
from hybridflow_lab.models.tokenizers import CHARACTERS
from hybridflow_lab.placement import Placement
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.trainer.lab import Lab


class Case(NamedTuple):
    """One bad input: what the message must name (key, file, row) and the fix it must give."""

    id: str
    bad: Any
    error: type[Exception]
    names: tuple[str, ...]
    fix: str


class Dataset(NamedTuple):
    """A dataset file to write: text, bytes, parquet columns, or None for no file."""

    name: str
    content: str | bytes | dict[str, list[Any]] | None


# ---------------------------------------------------------------------------------------------- inputs

def copy_model(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def with_vocab_size(model: Path, vocab_size: int) -> Path:
    """``model`` with its config.json claiming ``vocab_size`` (the weights keep theirs)."""
    config_file = model / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "vocab_size": vocab_size}))
    return model


def without_tokenizer(model: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Model directories by name: ``tiny`` works (4 heads, 2 KV heads, 100 tokens); the others are broken or odd."""
    root = tmp_path_factory.mktemp("models")
    tiny = create_model_dir(root / "tiny", "tiny", "qwen2")
    with_vocab_size(copy_model(tiny, root / "vocab_50"), 50)
    char_tokenizer(CHARACTERS + "äöüß").save_pretrained(copy_model(tiny, root / "tokenizer_104"))
    without_tokenizer(copy_model(tiny, root / "no_tokenizer"))
    create_model_dir(root / "vocab_101", "tiny", "qwen2", tokenizer=char_tokenizer(CHARACTERS + "é"))
    (root / "not_a_model").mkdir()
    create_model_dir(root / "phi3", "tiny", "phi3")  # a family on the transformers path
    config_file = copy_model(tiny, root / "t5") / "config.json"  # a model_type no causal-LM path runs
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "t5"}))
    config_file = create_model_dir(root / "mistral_window_16", "tiny", "mistral") / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "sliding_window": 16}))
    create_model_dir(root / "qwen3_moe", "tiny", "qwen3_moe")
    config_file = copy_model(tiny, root / "tied") / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tie_word_embeddings": True}))
    adapters = LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    save_adapters(apply_lora(load_causal_lm(tiny), adapters), root / "adapters_r8")
    return {path.name: str(path) for path in root.iterdir()}


def base_overrides(models: dict[str, str], tmp_path: Path) -> tuple[str, ...]:
    """The settings every case starts from: a working config with the tiny model."""
    return f"actor.model_path={models['tiny']}", f"trainer.run_dir={tmp_path / 'run'}"


TORCH_ENGINE = ("actor.engine.backend=torch",)
PPO = ("algorithm.name=ppo",)
DYNAMIC = ("algorithm.dynamic_sampling=true",)
COMPILED_TP = (*TORCH_ENGINE, "actor.engine.tensor_parallel=2", "rollout.tensor_parallel=2")
PIPELINE = (*TORCH_ENGINE, "actor.engine.remove_padding=false", "actor.engine.pipeline_parallel=2")


GOOD_EXAMPLES = [{"question": f"{i} + {i} = ?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(1, 9)]
GOOD_ROWS = [json.dumps(example) for example in GOOD_EXAMPLES]
GOOD_COLUMNS = {key: [example[key] for example in GOOD_EXAMPLES] for key in ("question", "answer")}


def jsonl(bad_row: str | None = None, at: int = 3) -> str:
    """Eight good GSM8K rows, with ``bad_row`` as row ``at`` (1-based) when given."""
    rows = GOOD_ROWS[: at - 1] + ([bad_row] if bad_row is not None else []) + GOOD_ROWS[at - 1:]
    return "\n".join(rows) + "\n"


def write_dataset(directory: Path, dataset: Dataset) -> Path:
    path = directory / dataset.name
    if isinstance(dataset.content, dict):
        pd.DataFrame(dataset.content).to_parquet(path)
    elif isinstance(dataset.content, bytes):
        path.write_bytes(dataset.content)
    elif isinstance(dataset.content, str):
        path.write_text(dataset.content)
    return path


def dataset_overrides(path: Path) -> tuple[str, ...]:
    return "task.name=gsm8k", f"task.dataset_path={path}"


def expect(case: Case, build: Callable[[], object]) -> None:
    """``build()`` raises ``case.error`` with a message naming everything in ``case.names`` and the fix."""
    with pytest.raises(case.error) as info:
        build()
    message = str(info.value)
    for expected in (*case.names, case.fix):
        assert expected in message, f"{expected!r} not in {message!r}"


@pytest.mark.parametrize(("setting", "off"), [("rollout.decoding=compiled", "rollout.decoding=eager"),
                                              ("rollout.decoding=onednn", "rollout.decoding=eager"),
                                              ("actor.engine.torch_compile=true", "actor.engine.torch_compile=false")])
def test_compiling_without_a_cpp_compiler_fails_before_start(models, tmp_path, setting, off):
    import torch._inductor.config as inductor

    case = Case("no_cpp_compiler", None, ConfigError, (setting.split("=")[0], "needs a C++ compiler"),
                f"install one (g++) or set {off}")
    with inductor.patch({"cpp.cxx": ("no-such-c++",)}):
        expect(case, lambda: Lab(None, overrides=(*base_overrides(models, tmp_path), setting), start=False))


def test_the_inputs_the_tables_break_work(models, tmp_path):
    base = base_overrides(models, tmp_path)
    for extra in ((), PPO, DYNAMIC, (*TORCH_ENGINE, "actor.engine.tensor_parallel=2"), COMPILED_TP,
                  (f"actor.model_path={models['vocab_101']}",), ("rollout.decoding=compiled",),
                  (f"actor.model_path={models['phi3']}", "actor.lora.rank=4",
                   "actor.lora.target_modules=[qkv_proj, o_proj, gate_up_proj, down_proj]"),
                  ("rollout.decoding=onednn",),
                  ("actor.engine.torch_compile=true", "critic.engine.torch_compile=true", *PPO), PIPELINE,
                  (*PIPELINE, "actor.engine.pipeline_schedule=gpipe", "batch.micro_batch_sequences_per_rank=64")):
        assert Lab(None, overrides=(*base, *extra), start=False).groups == {}
    config_file = tmp_path / "run.yaml"
    config_file.write_text("actor:\n  optim:\n    lr: 1.0e-5\n")
    assert Lab(config_file, overrides=base, start=False).config.actor.optim.lr == 1e-5
    for dataset in (Dataset("rows.jsonl", jsonl()), Dataset("rows.parquet", GOOD_COLUMNS)):
        lab = Lab(None, overrides=(*base, *dataset_overrides(write_dataset(tmp_path, dataset))), start=False)
        assert len(lab.task.source.examples) + len(lab.task.eval_examples) == len(GOOD_ROWS)
    placement = Placement({"main": 2}, {"actor": "main"}, {"actor": ParallelLayout(t=2, tg=2)},
                          engines={"actor": "torch"})
    assert Lab(None, overrides=base, placement=placement, start=False).config.actor.engine.tensor_parallel == 2


# ------------------------------------------------------------------------------- dotted overrides

OVERRIDE_CASES = [
    # keys
    Case("unknown_top_level_key", ["seeds=1"], ConfigError, ("seeds",), "did you mean seed?"),
    Case("unknown_nested_key", ["actor.optim.lrr=1e-5"], ConfigError, ("actor.optim.lrr",),
         "did you mean actor.optim.lr?"),
    Case("misspelt_rollout_key", ["rollout.temprature=0.7"], ConfigError, ("rollout.temprature",),
         "did you mean rollout.temperature?"),
    Case("unknown_key_like_none", ["batch.foo=1"], ConfigError, ("batch.foo",),
         "valid keys here: micro_batch_sequences_per_rank, micro_batch_tokens_per_rank, rollout_batch_prompts"),
    Case("override_without_value", ["actor.ranks"], ConfigError, ("actor.ranks",), "looks like key.path=value"),
    Case("value_for_a_section", ["batch=64"], ConfigError, ("batch",),
         "set its keys instead, e.g. batch.rollout_batch_prompts="),
    # types
    Case("str_for_int", ["batch.samples_per_prompt=two"], ConfigError, ("batch.samples_per_prompt", "'two'"),
         "for example batch.samples_per_prompt=4"),
    Case("bool_for_int", ["actor.ranks=true"], ConfigError, ("actor.ranks",), "for example actor.ranks=1"),
    Case("float_for_int", ["batch.rollout_batch_prompts=2.5"], ConfigError, ("batch.rollout_batch_prompts", "2.5"),
         "for example batch.rollout_batch_prompts=16"),
    Case("str_for_float", ["actor.optim.lr=fast"], ConfigError, ("actor.optim.lr", "'fast'"),
         "for example actor.optim.lr=1e-05"),
    Case("bool_for_float", ["rollout.temperature=false"], ConfigError, ("rollout.temperature",),
         "for example rollout.temperature=1.0"),
    Case("int_for_bool", ["algorithm.dynamic_sampling=1"], ConfigError, ("algorithm.dynamic_sampling",),
         "for example algorithm.dynamic_sampling=false"),
    Case("int_for_str", ["rollout.engine=3"], ConfigError, ("rollout.engine",), 'for example rollout.engine="torch"'),
    Case("scalar_for_list", ["actor.optim.betas=0.9"], ConfigError, ("actor.optim.betas",),
         "for example actor.optim.betas=[0.9, 0.999]"),
    Case("list_too_short", ["actor.optim.betas=[0.9]"], ConfigError, ("actor.optim.betas", "expected a list of 2"),
         "for example actor.optim.betas=[0.9, 0.999]"),
    Case("list_for_int", ["rollout.top_k=[1, 2]"], ConfigError, ("rollout.top_k",), "for example rollout.top_k=0"),
    Case("cosine_without_total_steps", ["actor.optim.schedule=cosine"], ConfigError, ("actor.optim",),
         "needs optim.total_steps > 0"),
    # values out of range
    Case("negative_lr", ["actor.optim.lr=-1e-5"], ConfigError, ("actor.optim.lr", "-1e-05"), "use e.g. 1e-5"),
    Case("zero_prompts_per_step", ["batch.rollout_batch_prompts=0"], ConfigError, ("batch.rollout_batch_prompts",),
         "use a whole number >= 1"),
    Case("zero_clip_low", ["algorithm.clip_low=0"], ConfigError, ("algorithm.clip_low",), "use e.g. 0.2"),
    Case("negative_clip_high", ["algorithm.clip_high=-0.1"], ConfigError, ("algorithm.clip_high",), "use e.g. 0.2"),
    Case("dual_clip_below_one", ["algorithm.dual_clip=0.5"], ConfigError, ("algorithm.dual_clip",),
         "or 0 to turn dual clip off"),
    Case("zero_temperature", ["rollout.temperature=0"], ConfigError, ("rollout.temperature",), "greedy=True"),
    Case("top_p_above_one", ["rollout.top_p=1.5"], ConfigError, ("rollout.top_p", "in (0, 1]"),
         "use 1.0 to turn nucleus sampling off"),
    Case("negative_top_k", ["rollout.top_k=-1"], ConfigError, ("rollout.top_k",), "use 0 to turn top-k sampling off"),
    Case("gamma_above_one", ["algorithm.gamma=1.5"], ConfigError, ("algorithm.gamma",), "use 1.0"),
    Case("negative_kl_loss_coef", ["algorithm.kl_loss_coef=-0.1"], ConfigError, ("algorithm.kl_loss_coef",),
         "use 0 for no KL loss term"),
    Case("negative_kl_reward_coef", ["algorithm.kl_reward_coef=-0.1"], ConfigError, ("algorithm.kl_reward_coef",),
         "use 0 for no KL penalty in the rewards"),
    Case("renamed_kl_coef", ["algorithm.kl_coef=0.1"], ConfigError, ("algorithm.kl_coef", "was split in two"),
         "algorithm.kl_loss_coef"),
    Case("renamed_kl_in_reward", ["algorithm.kl_in_reward=true"], ConfigError, ("algorithm.kl_in_reward",),
         "algorithm.kl_reward_coef > 0"),
    Case("unknown_kl_loss_kind", ["algorithm.kl_loss_kind=full"], ConfigError, ("algorithm.kl_loss_kind", "full"),
         "low_var_kl=k3"),
    Case("unknown_kl_reward_kind", ["algorithm.kl_reward_kind=k4"], ConfigError, ("algorithm.kl_reward_kind", "k4"),
         "known: k1, k2, k3, abs"),
    Case("kl_target_without_reward_penalty", ["algorithm.kl_target=6.0"], ConfigError,
         ("algorithm.kl_target", "kl_reward_coef=0"), "set algorithm.kl_reward_coef > 0"),
    Case("gspo_clip_of_zero", ["algorithm.gspo_clip_low=0"], ConfigError, ("algorithm.gspo_clip_low",),
         "use the paper's 3e-4"),
    Case("cispo_clip_low_above_one", ["algorithm.cispo_clip_low=2"], ConfigError, ("algorithm.cispo_clip_low",),
         "use 1.0 for no lower bound"),
    Case("unknown_rollout_is_level", ["algorithm.rollout_is=tokens"], ConfigError, ("algorithm.rollout_is",
                                                                                    "tokens"),
         "'token' (TIS)"),
    Case("rollout_is_cap_below_one", ["algorithm.rollout_is_cap=0.5"], ConfigError, ("algorithm.rollout_is_cap",),
         "use e.g. 2.0"),
    Case("unknown_rollout_mask_level", ["algorithm.rollout_mask=geometric"], ConfigError,
         ("algorithm.rollout_mask", "geometric"), "'token' drops the tokens"),
    Case("rollout_mask_band_above_one", ["algorithm.rollout_mask_low=1.5"], ConfigError,
         ("algorithm.rollout_mask_low",), "use e.g. 0.5"),
    Case("norm_aggregation_of_a_typo", ["algorithm.loss_agg=seq-mean-token-sum-normal"], ConfigError,
         ("algorithm.loss_agg", "seq-mean-token-sum-normal"), "seq-mean-token-sum-norm"),
    Case("beta_of_one", ["actor.optim.betas=[0.9, 1.0]"], ConfigError, ("actor.optim.betas",),
         "use e.g. [0.9, 0.999]"),
    Case("vllm_memory_above_one", ["rollout.gpu_memory_utilization=1.5"], ConfigError,
         ("rollout.gpu_memory_utilization",), "use e.g. 0.5"),
    Case("vllm_kv_cache_of_zero", ["rollout.kv_cache_gib=0"], ConfigError, ("rollout.kv_cache_gib",),
         "use a whole number >= 1"),
    Case("vllm_dtype_unknown", ["rollout.dtype=fp8"], ConfigError, ("rollout.dtype", "'fp8'"),
         "leave it empty for the actor's training dtype"),
    Case("overlong_buffer_not_below_max_new_tokens", ["algorithm.overlong_buffer=32"], ConfigError,
         ("algorithm.overlong_buffer", "rollout.max_new_tokens=32"), "use less than 32"),
    Case("zero_eval_size", ["task.eval_size=0"], ConfigError, ("task.eval_size",), "use e.g. 64"),
    Case("unknown_nonfinite_policy", ["trainer.on_nonfinite=ignore"], ConfigError,
         ("trainer.on_nonfinite", "('stop', 'skip')", "ignore"), "nothing is applied either way"),
    Case("skip_nonfinite_with_deepspeed", ["trainer.on_nonfinite=skip", "actor.engine.backend=deepspeed"],
         ConfigError, ("trainer.on_nonfinite", "deepspeed"), "use stop, or actor.engine.backend=torch"),
    Case("unknown_reward_policy", ["task.reward_on_error=retry"], ConfigError,
         ("task.reward_on_error", "('fail', 'zero')", "retry"), "scores 0 and is counted"),
    Case("negative_reward_timeout", ["task.reward_timeout_s=-1"], ConfigError, ("task.reward_timeout_s", "-1"),
         "use 0 for no timeout"),
    # sizes that do not divide
    Case("minibatch_not_dividing_step", ["batch.update_minibatch_sequences=48"], ConfigError,
         ("batch.update_minibatch_sequences",), "use one of [1, 2, 4, 8, 16, 32, 64]"),
    Case("samples_per_prompt_breaking_minibatch", ["batch.samples_per_prompt=3"], ConfigError,
         ("batch.update_minibatch_sequences", "samples_per_prompt 3"), "use one of [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]"),
    Case("minibatch_not_divisible_by_ranks", ["actor.ranks=3", "batch.update_minibatch_sequences=32"], ConfigError,
         ("batch.update_minibatch_sequences", "3 data-parallel ranks"), "use a multiple of 3"),
    Case("micro_batch_not_dividing", ["batch.micro_batch_sequences_per_rank=12"], ConfigError,
         ("batch.micro_batch_sequences_per_rank",), "use one of [1, 2, 4, 8, 16, 32]"),
    Case("tp_not_dividing_heads", [*TORCH_ENGINE, "actor.ranks=3", "actor.engine.tensor_parallel=3"], ConfigError,
         ("actor.engine.tensor_parallel", "num_attention_heads (4)"), "use one of [1, 2]"),
    Case("tp_not_dividing_kv_heads", [*TORCH_ENGINE, "actor.ranks=4", "actor.engine.tensor_parallel=4"], ConfigError,
         ("actor.engine.tensor_parallel", "num_key_value_heads (2)"), "use one of [1, 2]"),
    Case("tp_not_dividing_vocab", [*TORCH_ENGINE, "actor.model_path={vocab_101}", "actor.engine.tensor_parallel=2"],
         ConfigError, ("actor.engine.tensor_parallel", "vocab_size (101)"), "use one of [1]"),
    Case("generation_tp_not_dividing_training_tp", ["rollout.tensor_parallel=2"], ConfigError,
         ("rollout.tensor_parallel", "training TP 1"), "raise actor.engine.tensor_parallel"),
    Case("tp_not_dividing_ranks", [*TORCH_ENGINE, "actor.ranks=3", "actor.engine.tensor_parallel=2"], ConfigError,
         ("actor.engine.tensor_parallel", "the 3 ranks"), "use one of [1, 3]"),
    Case("tp_above_ranks", [*TORCH_ENGINE, "actor.engine.tensor_parallel=4"], ConfigError,
         ("actor.engine.tensor_parallel", "the 2 ranks"), "set actor.ranks to a multiple of 4"),
    Case("tp_with_deepspeed", ["actor.engine.tensor_parallel=2"], ConfigError, ("actor.engine.tensor_parallel",),
         "set actor.engine.backend=torch"),
    Case("critic_tp", [*PPO, "critic.engine.backend=torch", "critic.engine.tensor_parallel=2"], ConfigError,
         ("critic.engine.tensor_parallel",), "use 1"),
    Case("pp_with_deepspeed", [*PIPELINE, "actor.engine.backend=deepspeed"], ConfigError,
         ("actor.engine.backend", "pipeline_parallel=2"), "set actor.engine.backend=torch"),
    Case("pp_with_remove_padding", [*PIPELINE, "actor.engine.remove_padding=true"], ConfigError,
         ("actor.engine.remove_padding", "padded shape"), "set actor.engine.remove_padding=false"),
    Case("pp_with_token_budget", [*PIPELINE, "batch.micro_batch_tokens_per_rank=256"], ConfigError,
         ("batch.micro_batch_tokens_per_rank",), "set it to 0"),
    Case("pp_with_lora", [*PIPELINE, "actor.lora.rank=4"], ConfigError, ("actor.lora.rank",),
         "or set actor.engine.pipeline_parallel=1"),
    Case("pp_not_dividing_ranks", [*PIPELINE, "actor.engine.pipeline_parallel=3"], ConfigError,
         ("actor.engine.pipeline_parallel", "the 2 ranks"), "use one of [1, 2]"),
    Case("pp_not_dividing_layers", [*PIPELINE, "actor.ranks=3", "actor.engine.pipeline_parallel=3"], ConfigError,
         ("actor.engine.pipeline_parallel", "4 layers", "they would take 2, 1, 1 layers"), "use one of [1, 2, 4]"),
    Case("pp_with_tied_embeddings", [*PIPELINE, "actor.model_path={tied}"], ConfigError,
         ("actor.engine.pipeline_parallel", "tie_word_embeddings"), "set actor.engine.pipeline_parallel=1"),
    Case("pp_on_the_transformers_path", [*PIPELINE, "actor.model_path={phi3}"], ConfigError,
         ("actor.engine.pipeline_parallel", "transformers path", "pipeline stages"), "set it to 1"),
    Case("pp_1f1b_with_fewer_micro_batches_than_stages", [*PIPELINE, "batch.micro_batch_sequences_per_rank=64"],
         ConfigError, ("batch.micro_batch_sequences_per_rank", "1 micro-batch(es)", "needs at least 2"),
         "use at most 32, or set actor.engine.pipeline_schedule=gpipe"),
    Case("pp_unknown_schedule", [*PIPELINE, "actor.engine.pipeline_schedule=interleaved"], ConfigError,
         ("actor.engine.pipeline_schedule", "'interleaved'"), "gpipe runs every forward"),
    Case("critic_pp", [*PPO, "critic.engine.backend=torch", "critic.engine.pipeline_parallel=2"], ConfigError,
         ("critic.engine.pipeline_parallel", "only the actor"), "use 1"),
    # more ranks than a pool has
    Case("colocated_ranks_differ", [*PPO, "critic.ranks=1"], ConfigError, ("critic.pool", "actor (2 ranks)"),
         "set critic.ranks=2, or critic.pool=critic"),
    Case("nodes_not_dividing_ranks", ["actor.nodes=3"], ConfigError, ("actor.nodes", "the 2 ranks of the actor"),
         "use one of [1, 2]"),
    Case("colocated_nodes_differ", [*PPO, "actor.nodes=2"], ConfigError, ("critic.nodes", "spans 2 node(s)"),
         "set critic.nodes=2, or critic.pool=critic"),
    Case("local_backend_with_two_ranks", ["backend=local"], ConfigError, ("actor.ranks",),
         "set it to 1 or use backend=ray"),
    # unknown names
    Case("unknown_backend", ["backend=slurm"], ConfigError, ("backend", "'slurm'", "('ray', 'local')"),
         "'local' runs every role in this process"),
    Case("unknown_algorithm", ["algorithm.name=a2c"], ConfigError, ("algorithm.name", "'a2c'"), "'grpo'"),
    Case("unknown_task", ["task.name=chess"], ConfigError, ("task.name", "'chess'"),
         "known tasks: arithmetic, calculator, countdown, gsm8k, reasoning_gym, sorting, word_problems"),
    Case("unknown_rollout_engine", ["rollout.engine=sglang"], ConfigError, ("rollout.engine", "'sglang'"),
         "('torch', 'vllm')"),
    Case("unknown_train_backend", ["actor.engine.backend=megatron"], ConfigError, ("actor.engine.backend",),
         "('torch', 'deepspeed', 'fsdp')"),
    Case("unknown_reshard", ["rollout.reshard=nccl"], ConfigError, ("rollout.reshard",), "'hybridflow'"),
    Case("forced_length_over_budget", ["rollout.forced_lengths=[2, 99]"], ConfigError, ("rollout.forced_lengths",),
         "rollout.max_new_tokens="),
    Case("forced_lengths_with_ignore_eos", ["rollout.forced_lengths=[2]", "rollout.ignore_eos=true"], ConfigError,
         ("rollout.forced_lengths",), "set rollout.ignore_eos=false"),
    Case("compiled_decoding_with_vllm", ["rollout.decoding=compiled", "rollout.engine=vllm"], ConfigError,
         ("rollout.decoding", "rollout.engine is 'vllm'"), "or rollout.decoding=eager"),
    Case("compiled_decoding_with_generation_tp", [*COMPILED_TP, "rollout.decoding=compiled"], ConfigError,
         ("rollout.decoding", "no collectives"), "set rollout.tensor_parallel=1"),
    Case("onednn_decoding_with_vllm", ["rollout.decoding=onednn", "rollout.engine=vllm"], ConfigError,
         ("rollout.decoding", "rollout.engine is 'vllm'"), "or rollout.decoding=eager"),
    Case("onednn_decoding_with_generation_tp", [*COMPILED_TP, "rollout.decoding=onednn"], ConfigError,
         ("rollout.decoding", "no collectives"), "set rollout.tensor_parallel=1"),
    Case("onednn_decoding_in_bf16", ["actor.engine.bf16=true", "rollout.decoding=onednn"], ConfigError,
         ("rollout.decoding", "float32", "actor.engine.bf16"), "set actor.engine.bf16=false"),
    Case("unknown_decoding", ["rollout.decoding=fast"], ConfigError, ("rollout.decoding", "'fast'",
                                                                      "('eager', 'compiled', 'onednn')"),
         "compiled runs it through torch.compile"),
    Case("old_compiled_decoding_key", ["rollout.torch_compile=true"], ConfigError, ("rollout.torch_compile",),
         "set rollout.decoding=compiled"),
    Case("old_onednn_decoding_key", ["rollout.onednn_decode=true"], ConfigError, ("rollout.onednn_decode",),
         "set rollout.decoding=onednn"),
    Case("lora_rank_of_zero", ["actor.lora.rank=0"], ConfigError, ("actor.lora.rank", "trains no adapters"),
         "remove the key, or set a rank >= 1"),
    Case("negative_keep_checkpoints", ["trainer.keep_checkpoints=-1"], ConfigError, ("trainer.keep_checkpoints",),
         "use 0 to keep every checkpoint"),
    Case("compiled_layers_with_fsdp", ["actor.engine.backend=fsdp", "actor.engine.torch_compile=true"], ConfigError,
         ("actor.engine.torch_compile", "FSDP gathers parameters in hooks"), "use actor.engine.backend=torch"),
    Case("compiled_layers_with_zero3", ["critic.engine.zero_stage=3", "critic.engine.torch_compile=true", *PPO],
         ConfigError, ("critic.engine.torch_compile", "ZeRO-3"), "deepspeed with critic.engine.zero_stage=1 or 2"),
    Case("compiled_layers_with_training_tp", [*TORCH_ENGINE, "actor.engine.tensor_parallel=2",
                                               "actor.engine.torch_compile=true"], ConfigError,
         ("actor.engine.torch_compile", "no collectives"), "set actor.engine.tensor_parallel=1"),
    Case("unknown_policy_loss", ["algorithm.policy_loss=trpo"], ConfigError, ("algorithm.policy_loss", "'trpo'"),
         "known: cispo, gspo, ppo"),
    Case("unknown_cost", ["task.cost=toxicity"], ConfigError, ("task.cost", "'toxicity'"), "['digit_cost']"),
    Case("safe_rlhf_without_cost", ["algorithm.name=safe_rlhf"], ConfigError, ("task.cost",),
         "set task.cost (e.g. digit_cost)"),
    # models and tokenizers
    Case("empty_model_path", ["actor.model_path=''"], ConfigError, ("actor.model_path",),
         "create one with `hybridflow-lab init-model`"),
    Case("missing_model_path", ["actor.model_path=/nonexistent/model"], ConfigError,
         ("actor.model_path", "does not exist"), "create one with hybridflow_lab.models.create_model_dir"),
    Case("model_path_not_a_model", ["actor.model_path={not_a_model}"], ConfigError,
         ("actor.model_path", "has no config.json"), "create one with hybridflow_lab.models.create_model_dir"),
    Case("model_without_tokenizer", ["actor.model_path={no_tokenizer}"], ConfigError,
         ("actor.model_path", "no_tokenizer has no tokenizer"), "tokenizer.save_pretrained("),
    Case("config_vocab_below_tokenizer", ["actor.model_path={vocab_50}"], ConfigError,
         ("actor.model_path", "vocab_size 50", "100 tokens"), "a model whose vocab_size is at least 100"),
    Case("tokenizer_above_vocab", ["actor.model_path={tokenizer_104}"], ConfigError,
         ("actor.model_path", "vocab_size 100", "104 tokens"), "use the tokenizer the model was built with"),
    Case("critic_vocab_below_tokenizer", [*PPO, "critic.model_path={vocab_50}"], ConfigError,
         ("critic.model_path", "vocab_size 50"), "a model whose vocab_size is at least 100"),
    Case("missing_reward_model", ["reward_model_path=/nonexistent/rm"], ConfigError,
         ("reward_model_path", "does not exist"), "create_model_dir"),
    Case("reward_model_without_a_scalar_head", ["reward_model_path={tiny}"], ConfigError,
         ("reward_model_path", "no scalar head (score.weight)", "would score every response 0"),
         "leave reward_model_path empty to score with the task's rule"),
    # tasks and prompts
    Case("gsm8k_without_dataset", ["task.name=gsm8k"], ConfigError, ("task.dataset_path",),
         "needs a .jsonl or .parquet file"),
    Case("dataset_for_a_bundled_task", ["task.dataset_path=data.jsonl"], ConfigError, ("task.dataset_path",),
         "set task.name=gsm8k to train on it"),
    Case("unknown_reasoning_gym_generator", ["task.name=reasoning_gym", "task.dataset=product"], ConfigError,
         ("task.dataset", "'product' is not a reasoning-gym generator"), "close names: products"),
    Case("reasoning_gym_options_the_generator_lacks", ["task.name=reasoning_gym", "task.dataset=products",
                                                       "task.dataset_options.min_digitz=2"], ConfigError,
         ("task.dataset_options", "products generator", "min_digitz"), "unexpected keyword argument"),
    Case("generator_for_another_task", ["task.dataset=products"], ConfigError, ("task.dataset", "arithmetic"),
         "set task.name=reasoning_gym to train on it"),
    Case("tool_workers_without_ray", ["backend=local", "actor.ranks=1", "agent.tool_workers=2"], ConfigError,
         ("agent.tool_workers", "Ray actors", "'local'"), "use backend=ray, or agent.tool_workers=0"),
    Case("feedback_for_a_task_with_tools", ["task.name=calculator", "agent.feedback=true"], ConfigError,
         ("agent.feedback", "calculator task has tools"), "set agent.feedback=false"),
    Case("retry_discount_of_zero", ["agent.retry_discount=0"], ConfigError, ("agent.retry_discount", "in (0, 1]"),
         "use 1 for no discount"),
    Case("unknown_bundled_tool", ["agent.tools=[calc, shell]"], ConfigError, ("agent.tools", "'shell'"),
         "bundled tools: calc, python"),
    Case("trajectories_past_the_models_positions", ["task.name=calculator", "agent.max_tokens=4096"], ConfigError,
         ("agent.max_tokens", "rollout.max_prompt_tokens + agent.max_tokens", "2048 positions"), "lower them to fit"),
    Case("task_prompts_too_long", ["task.digits=20"], ConfigError,
         ("rollout.max_prompt_tokens", "arithmetic task's held-out prompt"), "or lower task.digits"),
    Case("grpo_one_sample_per_prompt", ["batch.samples_per_prompt=1", "batch.update_minibatch_sequences=16"],
         ConfigError, ("batch.samples_per_prompt", "grpo scores each sample against"),
         "set batch.samples_per_prompt >= 2"),
    Case("rloo_one_sample_per_prompt", ["algorithm.name=rloo", "batch.samples_per_prompt=1",
                                        "batch.update_minibatch_sequences=16"],
         ConfigError, ("batch.samples_per_prompt", "rloo scores each sample against"),
         "set batch.samples_per_prompt >= 2"),
    # dynamic sampling
    Case("dynamic_sampling_one_sample", [*DYNAMIC, "batch.samples_per_prompt=1", "batch.update_minibatch_sequences=16"],
         ConfigError, ("batch.samples_per_prompt",), "set batch.samples_per_prompt >= 2"),
    Case("dynamic_sampling_zero_rounds", [*DYNAMIC, "algorithm.max_sampling_rounds=0"], ConfigError,
         ("algorithm.max_sampling_rounds",), "use e.g. 4"),
    Case("dynamic_sampling_without_groups", [*DYNAMIC, "algorithm.name=remax"], ConfigError,
         ("algorithm.dynamic_sampling", "remax"), "set algorithm.dynamic_sampling=false"),
    # a rollout group of its own, generation ahead of training
    Case("rollout_pool_of_a_trained_role", ["rollout.pool=main"], ConfigError,
         ("rollout.pool", "'main' holds the actor"), "leave rollout.pool empty"),
    Case("rollout_group_tensor_parallel", ["rollout.pool=rollout", "rollout.tensor_parallel=2"], ConfigError,
         ("rollout.tensor_parallel", "data parallel"), "set rollout.tensor_parallel=1"),
    Case("negative_staleness", ["rollout.max_staleness=-1"], ConfigError, ("rollout.max_staleness", ">= 0"),
         "use 0 (on-policy)"),
    Case("staleness_on_the_actors_ranks", ["rollout.max_staleness=1"], ConfigError,
         ("rollout.max_staleness", "waits for each update"), "rollout.pool=rollout"),
    Case("staleness_for_an_on_policy_algorithm", ["algorithm.name=remax", "rollout.pool=rollout",
                                                  "rollout.max_staleness=1"], ConfigError,
         ("rollout.max_staleness", "remax dataflow cannot take batches from an older policy"), "grpo"),
    Case("staleness_without_overlap", ["rollout.pool=rollout", "rollout.max_staleness=1", "trainer.overlap=false"],
         ConfigError, ("trainer.overlap",), "set backend=ray and trainer.overlap=true"),
    # captures
    Case("capture_of_no_stage", ["trainer.capture=reward,rewards"], ConfigError, ("trainer.capture", "'rewards'"),
         "or 'all'"),
    Case("negative_capture_steps", ["trainer.capture=reward", "trainer.capture_steps=-1"], ConfigError,
         ("trainer.capture_steps", ">= 0"), "use 0 to keep every step's captures"),
    # model families and the path that runs them
    Case("tensor_parallel_on_the_transformers_path", ["actor.model_path={phi3}", *TORCH_ENGINE,
                                                      "actor.engine.tensor_parallel=2"], ConfigError,
         ("actor.engine.tensor_parallel", "(phi3) runs on the transformers path"), "set it to 1"),
    Case("onednn_decoding_on_the_transformers_path", ["actor.model_path={phi3}", "rollout.decoding=onednn"],
         ConfigError, ("rollout.decoding", "(phi3)"), "set rollout.decoding=eager"),
    Case("mixture_of_experts_with_vllm_tensor_parallel", ["actor.model_path={qwen3_moe}", "rollout.engine=vllm",
                                                          "actor.ranks=2", "rollout.tensor_parallel=2"], ConfigError,
         ("rollout.tensor_parallel", "mixture of 4 experts"), "set rollout.tensor_parallel=1"),
    Case("adapters_of_other_lora_settings", ["actor.lora.rank=4", "actor.lora.adapter_path={adapters_r8}"],
         ConfigError, ("actor.lora.adapter_path", "rank 8 (this run: 4)", "target_modules [q_proj, v_proj]"),
         "set actor.lora.rank=8 actor.lora.target_modules=[q_proj, v_proj]"),
    Case("adapters_without_lora", ["actor.lora.adapter_path={adapters_r8}"], ConfigError,
         ("actor.lora.adapter_path", "actor.lora.rank is 0"), "set actor.lora.rank to their r"),
    Case("a_chat_template_the_tokenizer_lacks", ["task.chat_template=true"], ConfigError,
         ("task.chat_template", "has no chat template"), "set task.chat_template=false for raw prompts"),
    Case("native_forced_on_a_family_it_lacks", ["actor.model_path={phi3}", "actor.model_impl=native"], ConfigError,
         ("actor.model_impl", "model_type 'phi3'"), "model_impl=transformers"),
    Case("architecture_no_path_runs", ["actor.model_path={t5}"], ConfigError, ("actor.model_path", "'t5'"),
         "point at a causal LM's directory"),
    Case("lora_target_the_family_lacks", ["actor.model_path={phi3}", "actor.lora.rank=4"], ConfigError,
         ("actor.lora.target_modules", "q_proj", "qkv_proj"), "target those"),
    Case("sequences_past_the_sliding_window", ["actor.model_path={mistral_window_16}"], ConfigError,
         ("rollout.max_new_tokens", "sliding window (16)"), "lower rollout.max_prompt_tokens + "
                                                            "rollout.max_new_tokens"),
    Case("stage_timeout_of_zero", ["trainer.stage_timeout_s=0"], ConfigError, ("trainer.stage_timeout_s", "> 0"),
         "use e.g. 1800"),
    Case("staleness_on_the_local_backend", ["backend=local", "actor.ranks=1", "rollout.pool=rollout",
                                            "rollout.max_staleness=1"],
         ConfigError, ("backend",), "or rollout.max_staleness=0"),
]


@pytest.mark.parametrize("case", OVERRIDE_CASES, ids=lambda case: case.id)
def test_bad_overrides_fail_before_start(case, models, tmp_path):
    overrides = (*base_overrides(models, tmp_path), *(item.format(**models) for item in case.bad))
    expect(case, lambda: Lab(None, overrides=overrides, start=False))


# ---------------------------------------------------------------------------------------- YAML files

FILE_CASES = [
    Case("yaml_syntax_error", "actor:\n  ranks: [2\n", ConfigError, ("run.yaml", "line 2"), "fix the file"),
    Case("yaml_not_utf8", "actor:\n  model_path: café\n".encode("latin-1"), ConfigError,
         ("run.yaml", "invalid continuation byte"), "fix the file: UTF-8 text"),
    Case("yaml_list", "- actor\n- critic\n", ConfigError, ("run.yaml", "got a list"),
         "write 'section:' lines with indented 'key: value' lines"),
    Case("yaml_unknown_nested_key", "actor:\n  optim:\n    lrr: 1.0e-5\n", ConfigError, ("actor.optim.lrr",),
         "did you mean actor.optim.lr?"),
    Case("yaml_missing_file", None, ConfigError, ("run.yaml", "not found"), "check the path"),
    Case("yaml_duplicate_key", "actor:\n  optim:\n    lr: 1.0e-5\n    lr: 1.0e-3\n", ConfigError,
         ("run.yaml", "line 4", "'lr' is given twice", "first on line 3"), "keep one of them"),
    Case("yaml_duplicate_section", "batch:\n  samples_per_prompt: 8\nbatch:\n  samples_per_prompt: 4\n",
         ConfigError, ("run.yaml", "'batch' is given twice"), "keep one of them"),
    Case("yaml_old_decoding_key", "rollout:\n  onednn_decode: true\n", ConfigError, ("rollout.onednn_decode",),
         "set rollout.decoding=onednn"),
    Case("yaml_lora_rank_of_zero", "critic:\n  lora:\n    rank: 0\n", ConfigError, ("critic.lora.rank",),
         "remove the key, or set a rank >= 1"),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda case: case.id)
def test_bad_config_files_fail_before_start(case, models, tmp_path):
    path = tmp_path / "run.yaml"
    if case.bad is not None:
        path.write_bytes(case.bad.encode() if isinstance(case.bad, str) else case.bad)
    expect(case, lambda: Lab(path, overrides=base_overrides(models, tmp_path), start=False))


# ------------------------------------------------------------------------------------------- datasets

ROW_FIX = "each row needs a non-empty string 'question'"
LONG_QUESTION = json.dumps({"question": "+".join(["12"] * 16), "answer": "#### 192"})  # 47 characters and tokens
LATIN_1_ROW = json.dumps({"question": "café?", "answer": "#### 1"}, ensure_ascii=False).encode("latin-1")

DATASET_CASES = [
    Case("jsonl_bad_json", Dataset("rows.jsonl", jsonl('{"question": "1 + 1 = ?", "answer": "#### 2"')),
         ConfigError, ("task.dataset_path", "rows.jsonl, row 3", "invalid JSON"), ROW_FIX),
    Case("jsonl_missing_answer", Dataset("rows.jsonl", jsonl('{"question": "1 + 1 = ?"}')), ConfigError,
         ("rows.jsonl, row 3", "'answer' is missing"), ROW_FIX),
    Case("jsonl_question_not_a_string", Dataset("rows.jsonl", jsonl('{"question": 7, "answer": "#### 7"}', at=5)),
         ConfigError, ("rows.jsonl, row 5", "'question' is not a string (int)"), ROW_FIX),
    Case("jsonl_empty_question", Dataset("rows.jsonl", jsonl('{"question": " ", "answer": "#### 7"}')), ConfigError,
         ("rows.jsonl, row 3", "'question' is empty"), ROW_FIX),
    Case("jsonl_row_not_an_object", Dataset("rows.jsonl", jsonl('["1 + 1 = ?", "#### 2"]')), ConfigError,
         ("rows.jsonl, row 3", "got list"), ROW_FIX),
    Case("jsonl_answer_without_number", Dataset("rows.jsonl", jsonl('{"question": "q?", "answer": "two"}')),
         ConfigError, ("rows.jsonl, row 3", "no '#### <number>'"), ROW_FIX),
    Case("jsonl_not_utf8", Dataset("rows.jsonl", jsonl().encode() + LATIN_1_ROW), ConfigError,
         ("rows.jsonl, row 9", "not UTF-8"), "save the file as UTF-8"),
    Case("jsonl_empty_file", Dataset("rows.jsonl", ""), ConfigError, ("task.dataset_path", "rows.jsonl has 0 rows"),
         "give a file with at least 6"),
    Case("jsonl_too_few_rows", Dataset("rows.jsonl", "\n".join(GOOD_ROWS[:3])), ConfigError,
         ("rows.jsonl has 3 rows",), "give a file with at least 6"),
    Case("jsonl_prompt_too_long", Dataset("rows.jsonl", jsonl(LONG_QUESTION, at=4)), ConfigError,
         ("rollout.max_prompt_tokens", "rows.jsonl, row 4", "47 tokens"),
         "raise rollout.max_prompt_tokens to 47, or shorten or drop those rows"),
    Case("parquet_missing_column", Dataset("rows.parquet", {"question": ["1 + 1 = ?"] * 8}), ConfigError,
         ("rows.parquet, row 1", "'answer' is missing"), ROW_FIX),
    Case("parquet_wrong_type", Dataset("rows.parquet", {"question": list(range(8)), "answer": ["#### 1"] * 8}),
         ConfigError, ("rows.parquet, row 1", "'question' is not a string"), ROW_FIX),
    Case("parquet_unreadable", Dataset("rows.parquet", b"question,answer\n"), ConfigError,
         ("rows.parquet", "not a readable parquet file"), "write it with DataFrame.to_parquet"),
    Case("missing_file", Dataset("absent.jsonl", None), ConfigError, ("task.dataset_path", "absent.jsonl"),
         "give a .jsonl or .parquet file"),
    Case("unsupported_suffix", Dataset("rows.csv", "question,answer\n"), ConfigError,
         ("rows.csv", "unsupported file type"), "DataFrame.to_json(path, orient='records', lines=True)"),
]


@pytest.mark.parametrize("case", DATASET_CASES, ids=lambda case: case.id)
def test_bad_datasets_fail_before_start(case, models, tmp_path):
    path = write_dataset(tmp_path, case.bad)
    overrides = (*base_overrides(models, tmp_path), *dataset_overrides(path))
    expect(case, lambda: Lab(None, overrides=overrides, start=False))


# ----------------------------------------------------------------------------------------- placements

PLACEMENT_CASES = [
    Case("tp_above_pool_devices", Placement({"main": 2}, {"actor": "main"}, {"actor": ParallelLayout(t=4, tg=4)}),
         ConfigError, ("placement.actor", "the 2 devices of pool 'main'"), "use t*p in [1, 2]"),
    Case("pool_without_devices", Placement({"main": 2}, {"actor": "gpus"}), ConfigError,
         ("placement.actor", "pool 'gpus' has no devices", "pools: {'main': 2}"),
         "assign actor to one of ['main'] or give 'gpus' devices"),
]


@pytest.mark.parametrize("case", PLACEMENT_CASES, ids=lambda case: case.id)
def test_bad_placements_fail_before_start(case, models, tmp_path):
    expect(case, lambda: Lab(None, overrides=base_overrides(models, tmp_path), placement=case.bad, start=False))


# ----------------------------------------------------------------------------------- dynamic sampling

def scored_groups(first_uid: int, scores: list[list[float]]) -> DataBatch:
    """A scored batch: one group (a ``uid``) per list of sample scores."""
    uids = [first_uid + group for group, samples in enumerate(scores) for _ in samples]
    return DataBatch({"scores": torch.tensor([s for samples in scores for s in samples])}, {"uid": np.array(uids)})


def drawing(batches: list[DataBatch]) -> tuple[Callable[[], DataBatch], list[DataBatch]]:
    """A ``draw`` that hands out ``batches`` in order, and the list of what it handed out."""
    drawn: list[DataBatch] = []

    def draw() -> DataBatch:
        drawn.append(batches[len(drawn)])
        return drawn[-1]

    return draw, drawn


DYNAMIC_CONFIG = (*DYNAMIC, "batch.rollout_batch_prompts=2", "batch.samples_per_prompt=3",
                  "algorithm.max_sampling_rounds=2")

FILTERED_OUT_CASES = [
    Case("every_reward_zero", [[[0.0] * 3] * 2] * 2, RuntimeError, ("in 2 rounds", "all 3 samples"),
         "raise algorithm.max_sampling_rounds (now 2) or batch.samples_per_prompt (now 3)"),
    Case("each_group_constant", [[[1.0] * 3, [0.0] * 3]] * 2, RuntimeError, ("in 2 rounds",),
         "or set algorithm.dynamic_sampling=false"),
]


@pytest.mark.parametrize("case", FILTERED_OUT_CASES, ids=lambda case: case.id)
def test_dynamic_sampling_that_keeps_no_group_names_the_settings(case):
    draw, drawn = drawing([scored_groups(10 * i, scores) for i, scores in enumerate(case.bad)])
    expect(case, lambda: informative_batch(draw, resolve_config(None, DYNAMIC_CONFIG)))
    assert len(drawn) == 2  # every round was tried before giving up


def test_dynamic_sampling_keeps_groups_whose_rewards_differ_until_the_batch_is_full():
    draw, drawn = drawing([scored_groups(0, [[1.0, 0.0, 1.0], [1.0] * 3]),
                           scored_groups(10, [[0.0] * 3, [0.0, 0.0, 1.0]]),
                           scored_groups(20, [[1.0, 0.0, 0.0]] * 2)])
    batch = informative_batch(draw, resolve_config(None, (*DYNAMIC_CONFIG, "algorithm.max_sampling_rounds=3")))
    assert batch["uid"].tolist() == [0, 0, 0, 11, 11, 11] and len(drawn) == 2  # two groups were enough


@pytest.mark.parametrize(("model", "task", "fix"), [
    ("tiny", "products_calc", "needs a packaged model (--model smollm2); the tiny model's tasks are sorting"),
    ("smollm2", "sorting", "on --model smollm2 the tasks are word_problems, products_calc")])
def test_a_demo_task_for_another_model_is_refused_naming_the_models_tasks(model, task, fix, capsys, tmp_path):
    from hybridflow_lab.cli import main

    assert main(["demo", "--model", model, "--task", task, "--run-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hybridflow-lab demo: error: --task: {task} ") and fix in error
    assert not any(tmp_path.iterdir())  # refused before the model was imported or trained
