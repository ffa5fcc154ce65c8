"""Which experts a mixture-of-experts model routes each token to, and where the rollout engine and the trainer
disagree (the routing mismatch: a token whose experts differ between the two got its log-prob from another
network on each side, however close their weights).

transformers' mixture-of-experts families route through a ``*TopKRouter`` module per layer that returns
``(router logits, routing weights, chosen experts)``; ``RouteLog`` records the chosen experts of each forward pass
while it is open. The built-in engine records them while it generates (``engines.torch_rollout.generate``), the
actor's update pass while it scores the same tokens, and ``routing_mismatch`` compares the two per response token.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """Each mixture-of-experts layer's router in ``model``, in layer order (none for a dense model)."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


class RouteLog:
    """The experts ``model``'s routers choose in each forward pass run while the log is open."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.chosen: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles: list[Any] = []

    def __enter__(self) -> RouteLog:
        for layer, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(
                lambda _module, _inputs, output, layer=layer: self.chosen[layer].append(output[-1].detach())))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def passes(self) -> list[torch.Tensor]:
        """Each pass's chosen experts, ``[tokens, layers, top_k]`` (tokens in the row-major order of its batch)."""
        return [torch.stack(layers, dim=1) for layers in zip(*self.chosen, strict=True)]


def generation_routes(passes: list[torch.Tensor], rows_per_step: list[torch.Tensor], prompts: int, samples: int,
                      max_new_tokens: int) -> torch.Tensor:
    """The experts that produced each response token's distribution, ``[prompts * samples, max_new_tokens, layers,
    top_k]`` (-1 past a response's end), from a generation's passes: the prefill (its prompts' last positions give
    every sample's first token), then one decoding pass per later token over the rows still generating
    (``rows_per_step``)."""
    prefill = passes[0].view(prompts, -1, *passes[0].shape[1:])[:, -1].repeat_interleave(samples, dim=0)
    routes = torch.full((prompts * samples, max_new_tokens, *prefill.shape[1:]), -1, dtype=prefill.dtype,
                        device=prefill.device)
    routes[:, 0] = prefill
    for step, (chosen, rows) in enumerate(zip(passes[1:], rows_per_step, strict=True), start=1):
        routes[rows, step] = chosen
    return routes


def scored_routes(full_pass: torch.Tensor, rows: int, response_len: int) -> torch.Tensor:
    """The experts of a trainer's pass over ``rows`` prompt + response sequences at the positions whose outputs score
    the response tokens (the last prompt token's, then each response token's but the last), like
    ``generation_routes``."""
    chosen = full_pass.view(rows, -1, *full_pass.shape[1:])
    return chosen[:, -response_len - 1:-1]


def routing_mismatch(trained: torch.Tensor, rolled_out: torch.Tensor) -> torch.Tensor:
    """Per response token, ``[rows, length]``: 1.0 where any layer's set of chosen experts differs between the
    trainer and the rollout engine (the order within a token's top-k does not count), else 0.0."""
    return (trained.sort(dim=-1).values != rolled_out.sort(dim=-1).values).flatten(2).any(-1).float()
