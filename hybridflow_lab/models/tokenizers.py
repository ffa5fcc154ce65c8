"""Tokenizers built locally and saved as ordinary HF tokenizer directories."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """One token per character (digits, letters, punctuation, space, newline) plus the special tokens."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(characters)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` with the ``tokenizers`` library."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _wrap(tokenizer)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model directory.

    A tokenizer saved as a generic ``tokenizer.json`` (as this project writes them) loads exactly as
    written. ``AutoTokenizer`` would rebuild it as the tokenizer of the model's type: for ``qwen2`` a
    byte-level one that silently drops every character this vocabulary spells differently, spaces included.
    """
    path = Path(path)
    settings = path / "tokenizer_config.json"
    declared = json.loads(settings.read_text()).get("tokenizer_class") if settings.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
