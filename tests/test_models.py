"""Our decoder against transformers, HF-directory round trips, tokenizers, scalar heads, the KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hybridflow_lab.models import (
    KVCache,
    build_model,
    char_tokenizer,
    create_model_dir,
    describe,
    load_causal_lm,
    save_model_dir,
    tiny_config,
    train_bpe_tokenizer,
)
from hybridflow_lab.models.heads import last_token_scores, load_scalar_model
from hybridflow_lab.models.tokenizers import load_tokenizer


def padded_batch(rows: int = 3, length: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, 90, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_logits_equal_transformers_on_padded_batches(tmp_path, arch):
    path = create_model_dir(tmp_path / arch, "tiny", arch, seed=1)
    ours = load_causal_lm(path).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        mine = ours(ids, mask)
        hf = theirs(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(mine[mask.bool()], hf[mask.bool()], rtol=1e-5, atol=1e-5)


# what real checkpoints' configs carry and the tiny models' do not
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
REAL_CONFIG_FIELDS = {
    "llama3-rope+head-dim+tied+padded-vocab": ("llama", {"rope_parameters": LLAMA3_ROPE, "head_dim": 48,
                                                         "tie_word_embeddings": True, "vocab_size": 128}),
    "linear-rope+untied+padded-vocab": ("qwen2", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                                      "factor": 2.0}, "vocab_size": 112}),
}


@pytest.mark.parametrize("case", sorted(REAL_CONFIG_FIELDS))
def test_real_checkpoint_config_fields_give_transformers_logits(tmp_path, case):
    arch, fields = REAL_CONFIG_FIELDS[case]
    tokenizer = char_tokenizer()
    config = tiny_config("tiny", arch, tokenizer)
    config = type(config).from_dict({**config.to_dict(), **fields})
    assert config.vocab_size > len(tokenizer)  # rows past the tokenizer's, as vocabularies padded for TP have
    path = save_model_dir(build_model(config, seed=3), tmp_path / "m", tokenizer)
    ours = load_causal_lm(path).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    assert ours.model.layers[0].self_attn.head_dim == fields.get("head_dim", config.hidden_size // 4)  # 4 heads
    ids, mask = padded_batch(length=24)  # past original_max_position_embeddings: the scaled frequencies matter
    with torch.no_grad():
        mine = ours(ids, mask)
        hf = theirs(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(mine[mask.bool()], hf[mask.bool()], rtol=1e-5, atol=1e-5)


def test_tied_embeddings_save_once_and_reload(tmp_path):
    tokenizer = char_tokenizer()
    config = tiny_config("tiny", "qwen2", tokenizer)
    config.tie_word_embeddings = True
    model = build_model(config, seed=2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    path = save_model_dir(model, tmp_path / "tied", tokenizer)
    reloaded = load_causal_lm(path)
    ids, mask = padded_batch()
    torch.testing.assert_close(reloaded(ids, mask), model(ids, mask))


def test_sizes_and_seeds():
    tokenizer = char_tokenizer()
    counts = {size: describe(build_model(tiny_config(size, "qwen2", tokenizer)))["parameters"]
              for size in ("tiny", "standard", "small")}
    assert 0.5e6 < counts["tiny"] < 1.5e6 and 3e6 < counts["standard"] < 5e6 and 10e6 < counts["small"] < 30e6
    a, b = (build_model(tiny_config("tiny", "llama", tokenizer), seed=5) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_the_head_counts_its_flops_whether_or_not_it_is_tied_to_the_embeddings():
    tokenizer = char_tokenizer()
    config = tiny_config("tiny", "qwen2", tokenizer)
    untied = describe(build_model(config))
    config.tie_word_embeddings = True
    tied = describe(build_model(config))
    head = len(tokenizer) * config.hidden_size
    assert untied["head_parameters"] == tied["head_parameters"] == head
    assert untied["parameters"] - tied["parameters"] == head  # one weight matrix fewer when tied
    assert untied["non_embedding_parameters"] == tied["non_embedding_parameters"]


def test_missing_model_path_and_unsupported_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model path '.*nowhere' does not exist; create one"):
        load_causal_lm(tmp_path / "nowhere")
    path = create_model_dir(tmp_path / "m", "tiny", "qwen2")
    text = (path / "config.json").read_text().replace('"qwen2"', '"t5"')
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"model_type 't5' is neither a family the project's decoder runs"):
        load_causal_lm(path)


def test_a_sequence_longer_than_mistrals_sliding_window_is_refused_not_attended_in_full(tmp_path):
    tokenizer = char_tokenizer()
    config = tiny_config("tiny", "mistral", tokenizer)
    config.sliding_window = 8
    model = build_model(config).eval()
    ids, _ = padded_batch(length=10)
    with torch.no_grad():
        model(ids[:, :8])  # 8 positions fit
        with pytest.raises(ValueError, match=r"sequences of up to 10 tokens are longer than the model's sliding "
                                             r"window \(8\)"):
            model(ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kv_cache_prefill_and_decode_equal_the_full_forward(tmp_path, arch):
    model = load_causal_lm(create_model_dir(tmp_path / "m", "tiny", arch, seed=4)).eval()
    ids = torch.randint(4, 90, (3, 9))
    prompt_mask = torch.ones(3, 6, dtype=torch.long)
    prompt_mask[0, :2] = 0
    full_mask = torch.cat([prompt_mask, torch.ones(3, 3, dtype=torch.long)], 1)
    with torch.no_grad():
        full = model(ids, full_mask)
        cache = KVCache(model.config, 3, 12, torch.float32)
        steps = [model(ids[:, :6], prompt_mask, cache=cache)]
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(6, 9)]
    incremental = torch.cat(steps, 1)
    torch.testing.assert_close(incremental[full_mask.bool()], full[full_mask.bool()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_directorys_tokenizer_loads_as_written(tmp_path, arch):
    text = "What is 12 + 3?\nIt is 15."
    written = char_tokenizer()
    loaded = load_tokenizer(create_model_dir(tmp_path / arch, "tiny", arch, seed=0))
    assert loaded(text)["input_ids"] == written(text)["input_ids"] and loaded.decode(written(text)["input_ids"]) == text
    assert (loaded.padding_side, loaded.pad_token, loaded.eos_token) == ("left", "<pad>", "<eos>")


def test_char_tokenizer_round_trips_through_an_hf_directory(tmp_path):
    tokenizer = char_tokenizer()
    text = "123+45=168\nok"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert loaded(text)["input_ids"] == ids and loaded.padding_side == "left"
    batch = loaded(["1+1=", "12+30="], padding=True)
    assert batch["input_ids"][0][:2] == [loaded.pad_token_id] * 2


def test_bpe_tokenizer_learns_merges():
    corpus = ["the quick brown fox jumps over the lazy dog"] * 40
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=300)
    ids = tokenizer("the quick fox")["input_ids"]
    assert tokenizer.decode(ids) == "the quick fox" and len(ids) < len("the quick fox")


def test_scalar_head_from_a_causal_lm_and_as_hf_sequence_classifier(tmp_path):
    path = create_model_dir(tmp_path / "lm", "tiny", "qwen2", seed=6)
    critic = load_scalar_model(path)
    ids, mask = padded_batch()
    assert torch.equal(critic(ids, mask), torch.zeros(3, 10))  # the head starts at zero
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    saved = save_model_dir(critic, tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(saved, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        scores = last_token_scores(critic(ids, mask), mask)
        hf_scores = hf(input_ids=ids[2:], attention_mask=mask[2:]).logits.squeeze(-1)  # unpadded row
    torch.testing.assert_close(scores[2:], hf_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(load_scalar_model(saved).score.weight, critic.score.weight)
