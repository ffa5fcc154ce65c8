"""One decoding step of the built-in engine, eager or compiled with ``torch.compile``.

Eager, a step runs some 200 small operations for one token per row, and on a CPU their dispatch costs
about as much as the matrix products. Compiled, inductor fuses the elementwise work between the products
into a few C++ loops. The compiled step attends over every slot of the cache under a mask (a
``SlotCache``), so that its shapes do not change from one step to the next.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.kv_cache import KVCache, SlotCache


def decode_step(model: DecoderLM, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Next-token logits ``[batch, vocab]`` for one new token per row (eager: over the filled slots only)."""
    return model(tokens[:, None], cache=cache, keep_last=1)[:, 0]


def _hookless_decode_step(model: DecoderLM, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
    # ``forward``, not ``__call__``: hooks on the model itself are a training engine's bookkeeping (DeepSpeed's
    # start a throughput timer, with ``time.time``, which dynamo cannot trace); its layers' hooks still run
    return model.forward(tokens[:, None], cache=cache, keep_last=1)[:, 0]


@functools.cache
def _compiled_decode_step(cpu: bool) -> Callable[..., torch.Tensor]:
    # made on first use: importing dynamo takes 0.6 s. On the CPU the graph's wrapper, which calls its ~100 kernels
    # and GEMMs, is C++ rather than Python: a tenth of a step's time on the standard model.
    return torch.compile(_hookless_decode_step, fullgraph=True, options={"cpp_wrapper": True} if cpu else None)


def compiled_decode_step(model: DecoderLM, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """``decode_step``'s logits, compiled. It compiles on first use, and again when the batch or the cache's size
    changes, after which those sizes are symbolic."""
    return _compiled_decode_step(tokens.device.type == "cpu")(model, tokens, cache.next_slot())


def missing_cpp_compiler() -> str | None:
    """Why inductor cannot compile for the CPU here (it builds C++), or None when it can."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        return "torch.compile's CPU backend needs a C++ compiler and finds none (it looks for $CXX, else g++)"
    return None
