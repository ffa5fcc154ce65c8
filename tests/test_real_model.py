"""A real pretrained model from a package: SmolLM2-135M-Instruct's GGUF file imported as an HF directory."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridflow_lab.models import load_causal_lm, load_config
from hybridflow_lab.models.families import model_impl
from hybridflow_lab.models.gguf_import import ImportReport, import_gguf, packaged_model_file
from hybridflow_lab.models.tokenizers import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real_model")]  # one import of the model for the module


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """SmolLM2-135M-Instruct imported once by the one-line command (``make models`` installs the package that ships
    it): the directory and what the command printed."""
    out = tmp_path_factory.mktemp("real") / "smollm2"
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "init-model", str(out), "--from-package",
                           "smollm2"], capture_output=True, text=True, timeout=600, check=True)
    return out, done


@pytest.fixture(scope="module")
def smollm2(imported):
    out, done = imported
    return out, ImportReport(**json.loads(done.stdout))


def test_the_import_prints_its_report_alone(imported):
    _, done = imported
    assert len(done.stdout.splitlines()) == 1 and json.loads(done.stdout)["architecture"] == "llama"
    assert "it/s" not in done.stderr and "%|" not in done.stderr, done.stderr[-300:]  # no progress bars


def test_the_packaged_smollm2_imports_with_the_logits_of_the_gguf_model(smollm2):
    out, report = smollm2
    assert report.architecture == "llama" and "Q4_1" in report.quantization and report.dtype == "float32"
    assert report.tied_embeddings and 134e6 < report.parameters < 135e6
    # the decoder and transformers run the same float32 maths on the same weights: equal up to rounding
    assert report.max_logit_diff_decoder < 1e-3 and report.max_logit_diff_transformers < 1e-3
    json.dumps(report.as_dict())
    config = load_config(out)
    assert not hasattr(config, "quantization_config") and config.tie_word_embeddings
    assert config.architectures == ["LlamaForCausalLM"]  # vLLM picks its model class by this
    assert load_causal_lm(out).lm_head.weight is not None


def test_the_imported_tokenizer_keeps_its_chat_template_and_pads_with_eos(smollm2):
    out, _ = smollm2
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token == "<|im_end|>"  # the end of a chat turn: where a response stops
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                             add_generation_prompt=True)
    assert "2+2?" in rendered and rendered.rstrip().endswith("assistant")


def write_gguf(path, architecture: str, quantization: str = "F32"):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    qtype = GGMLQuantizationType[quantization]
    if quantization == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor("token_embd.weight", np.zeros((4, block_bytes), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("architecture", "quantization", "message"), [
    ("rwkv6", "F32", "GGUF architecture 'rwkv6' is not one transformers' GGUF reader dequantises; it reads bloom, "),
    ("llama", "Q8_1", "tensors quantised as Q8_1 cannot be dequantised"),
])
def test_a_gguf_file_that_cannot_be_imported_is_refused_naming_it(tmp_path, architecture, quantization, message):
    path = write_gguf(tmp_path / "bad.gguf", architecture, quantization)
    with pytest.raises(ValueError, match=message) as info:
        import_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value) and not (tmp_path / "out").exists()


def test_an_unknown_packaged_model_is_named():
    with pytest.raises(ValueError, match="no packaged model 'gpt5'; packaged models: smollm2, gemma3-270m"):
        packaged_model_file("gpt5")


def test_the_decoder_generates_greedily_like_transformers_on_the_real_model(smollm2):
    from transformers import AutoModelForCausalLM

    from hybridflow_lab.engines import SamplingParams
    from hybridflow_lab.engines.torch_rollout import TorchRollout

    out, _ = smollm2
    tokenizer = load_tokenizer(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    reference = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        expected = reference.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
    rollout = TorchRollout(load_causal_lm(out).eval(), SamplingParams(max_new_tokens=12, greedy=True),
                           tokenizer.eos_token_id, tokenizer.pad_token_id)
    ours = rollout.generate(ids["input_ids"], ids["attention_mask"])
    length = int(ours["response_mask"].sum())
    assert ours["responses"][0, :length].tolist() == expected[:length].tolist()


def test_the_command_line_refuses_an_unsupported_gguf_file_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", "rwkv6")
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "import-model", "gguf", str(path),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"hybridflow-lab import-model: error: {path}: GGUF architecture 'rwkv6' is not one" in done.stderr


def test_a_lora_grpo_step_on_the_real_model_prompts_through_its_chat_template(smollm2, tmp_path):
    from hybridflow_lab.trainer.lab import Lab

    out, _ = smollm2
    lab = Lab(overrides=(
        "backend=local", f"actor.model_path={out}", "actor.ranks=1", "actor.engine.backend=torch", "actor.lora.rank=8",
        "algorithm.kl_loss_coef=0.01", "task.name=word_problems", "task.system_prompt=Solve it.", "task.eval_size=4",
        "rollout.max_prompt_tokens=128", "rollout.max_new_tokens=8", "batch.rollout_batch_prompts=2",
        "batch.samples_per_prompt=2", "batch.update_minibatch_sequences=4", "batch.micro_batch_sequences_per_rank=4",
        f"trainer.run_dir={tmp_path}", "trainer.progress=false"))
    try:
        metrics = lab.step()
        assert all(np.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"))
        batch = lab.last_batch
        shown = lab.show(batch, special_tokens=True)["prompt"][0]
        assert shown.startswith("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n")
        assert shown.endswith("<|im_start|>assistant\n") and batch["prompt_text"][0] in shown
        assert "<|im_start|>" not in lab.show(batch)["prompt"][0]
        assert not any("<|im_" in text for text in batch["response_text"])  # rewards see the response alone
    finally:
        lab.shutdown()


def test_the_packaged_gemma3_imports_onto_the_transformers_path_with_the_logits_of_the_gguf_model(tmp_path):
    """Gemma 3 270M, assembled from its four chunk packages: K-quants dequantised, the 262k-token vocabulary tied,
    the written directory run by the transformers path with the GGUF model's logits."""
    report = import_gguf(packaged_model_file("gemma3-270m"), tmp_path / "gemma3")
    assert report.architecture == "gemma3" and {"Q4_K", "Q6_K"} <= set(report.quantization)
    assert report.tied_embeddings and 268e6 < report.parameters < 269e6
    assert report.max_logit_diff_decoder < 1e-3 and report.max_logit_diff_transformers < 1e-3
    assert model_impl(load_config(report.path)) == "transformers"
