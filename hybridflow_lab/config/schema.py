"""The run configuration: typed dataclasses, one per section, with the defaults of the CPU demo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

TrainBackend = Literal["torch", "deepspeed", "fsdp"]  # the training engines (hybridflow_lab.engines builds them)
ReshardStrategy = Literal["hybridflow", "hybridflow_v", "ds_chat"]  # training -> generation (hybridflow_lab.hybrid)
Decoding = Literal["eager", "compiled", "onednn"]  # how the built-in engine runs its decoding step
ModelImpl = Literal["auto", "native", "transformers"]  # which model code runs a role (models.families.model_impl)
TRAIN_BACKENDS: tuple[str, ...] = get_args(TrainBackend)
RESHARD_STRATEGIES: tuple[str, ...] = get_args(ReshardStrategy)


KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's KL names, as algorithms.kl reads them too
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoRA's targets


@dataclass(frozen=True)
class LoraConfig:
    """Adapters of ``rank`` (0: full fine-tuning) on the linear layers named in ``target_modules`` (the check that
    the model has them reads its config.json: ``dataflows.preflight``)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = PROJECTIONS
    adapter_path: str | None = None  # start from the adapters saved here (PEFT's format: PEFT's or a run's)

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be 0 (no adapters) or positive, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("target_modules is empty; name the linear layers to adapt, e.g. q_proj, v_proj")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, then constant or cosine decay; gradient clipping by global norm."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int = 0  # needed by "cosine"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.schedule == "cosine" and self.total_steps <= 0:
            raise ValueError("optim.schedule='cosine' needs optim.total_steps > 0")


@dataclass
class EngineConfig:
    """How a trained role shards its model: ``torch`` (DDP), ``deepspeed`` (ZeRO) or ``fsdp`` (FSDP2).

    ``tensor_parallel`` (the actor's training TP, the paper's t) splits every layer over that many
    ranks, and ``pipeline_parallel`` (the paper's p) the layers into that many stages, one per rank, run with
    ``pipeline_schedule`` over each optimizer step's micro-batches; the torch engine's DDP runs over the rest.
    ZeRO and FSDP shard over data parallel instead.
    """

    backend: TrainBackend = "deepspeed"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    zero_stage: Literal[1, 2, 3] = 2
    offload: bool = False
    bf16: bool = False
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    remove_padding: bool = True  # passes over the real tokens only (packed; verl's use_remove_padding)
    torch_compile: bool = False  # training and scoring passes run each layer's work outside attention compiled


@dataclass
class RoleConfig:
    """A model role: where its weights come from, which pool it runs on, how many data-parallel ranks, how it trains.

    Roles naming the same ``pool`` are colocated (rank i of each shares device slot i) and need the
    same ``ranks``; roles on different pools run on disjoint devices.
    """

    model_path: str = ""  # empty: the actor's model
    model_impl: ModelImpl = "auto"  # the project's decoder (native) or transformers' model; auto: native where it runs
    ranks: int = 1
    pool: str = "main"
    nodes: int = 1  # Ray nodes the ranks spread over, ranks/nodes on each (a joined multi-node cluster)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: train adapters, the base frozen


@dataclass
class RolloutConfig:
    """Generation: sampling and the engine (``torch`` built-in, or ``vllm``: docs/vllm.md)."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "torch_compile": "is gone: set rollout.decoding=compiled (rollout.decoding chooses the decoding step: "
                         "eager, compiled or onednn)",
        "onednn_decode": "is gone: set rollout.decoding=onednn (rollout.decoding chooses the decoding step: "
                         "eager, compiled or onednn)",
    }

    engine: Literal["torch", "vllm"] = "torch"
    max_prompt_tokens: int = 32
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    pad_prompts: bool = False  # left-pad every prompt to max_prompt_tokens (fixed shapes, benchmarks)
    forced_lengths: tuple[int, ...] = ()  # benchmarks: row i of a generation call ends with EOS after the
    #                                       (i mod len)-th of these many tokens (built-in engine; SamplingParams)
    # the built-in engine's decoding step (engines.torch_rollout.decoder): "eager"; "compiled" by torch.compile
    # (inductor; on a CPU it needs a C++ compiler), compiled on each rank's first generation; or "onednn", on the
    # CPU in float32, in C++ over weights packed for oneDNN at each generation (a second copy of them while it runs;
    # needs a C++ compiler, builds once per machine: docs/performance.md)
    decoding: Decoding = "eager"
    tensor_parallel: int = 1  # generation TP (tg): divides actor.engine.tensor_parallel; vllm: 1 or actor.ranks
    reshard: ReshardStrategy = "hybridflow"  # training -> generation transition
    gpu_memory_utilization: float = 0.5  # vllm on CUDA: its share of the GPU (weights and KV cache)
    kv_cache_gib: int = 1  # vllm on CPU: GiB of RAM each rank's engine reserves for its KV cache
    dtype: Literal["", "float32", "bfloat16", "float16"] = ""  # vllm's dtype; empty: the actor's training dtype
    verify_weight_sync: bool = True  # vllm: fingerprint every tensor after each weight sync, stop on a mismatch
    enforce_eager: bool | None = None  # vllm: no CUDA graphs or torch.compile; None: eager on the CPU, compiled on CUDA
    pool: str = ""  # empty: the actor's ranks generate (the hybrid engine); a name: a generation group of its own
    ranks: int = 1  # ranks of that group (data parallel, each with the whole policy)
    nodes: int = 1
    max_staleness: int = 0  # policy versions generation may run ahead of training: 0 on-policy, 1 one-step off


@dataclass
class BatchConfig:
    """Batch sizes, each named by what it counts (see docs/batch-sizes.md)."""

    rollout_batch_prompts: int = 16  # prompts drawn per RL step
    samples_per_prompt: int = 4  # responses generated per prompt (the GRPO group size)
    update_minibatch_sequences: int = 64  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_sequences_per_rank: int = 8  # sequences per forward/backward on one rank
    # > 0: actor/critic micro-batches are sized by real tokens instead, up to this many per rank (verl's
    # use_dynamic_bsz with ppo_max_token_len_per_gpu); micro_batch_sequences_per_rank then only sizes reward models
    micro_batch_tokens_per_rank: int = 0
    update_epochs: int = 1  # passes over the step's sequences

    @property
    def step_sequences(self) -> int:
        return self.rollout_batch_prompts * self.samples_per_prompt


@dataclass
class AlgorithmConfig:
    """Which dataflow runs and its knobs (see ``hybridflow_lab.dataflows``)."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "kl_coef": "was split in two: set algorithm.kl_loss_coef (the KL to the reference as a loss term, GRPO's "
                   "way) or algorithm.kl_reward_coef (the KL subtracted from the rewards, PPO's way)",
        "kl_kind": "was split in two: algorithm.kl_loss_kind (default k3) and algorithm.kl_reward_kind (default k1)",
        "kl_in_reward": "is gone: the KL enters the rewards when algorithm.kl_reward_coef > 0 and the loss when "
                        "algorithm.kl_loss_coef > 0 (both may be on); set those instead",
    }

    name: str = "grpo"  # ppo | grpo | dr_grpo | rloo | remax | reinforce_plus_plus | reinforce_plus_plus_baseline
    #                     | safe_rlhf
    gamma: float = 1.0
    lam: float = 1.0
    kl_loss_coef: float = 0.0  # > 0: the KL to the reference as a loss term of the actor update (GRPO's way)
    kl_loss_kind: str = "k3"  # k1 | k2 | k3 | abs, or verl's kl | mse | low_var_kl
    kl_reward_coef: float = 0.0  # > 0: the KL subtracted from the rewards before advantages (PPO's way)
    kl_reward_kind: str = "k1"
    kl_target: float = 0.0  # > 0: an adaptive controller steers kl_reward_coef towards this KL
    kl_horizon: int = 10000
    policy_loss: str = "ppo"  # ppo | gspo | cispo, or a registered one
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO's clip-higher
    dual_clip: float = 0.0  # > 1 enables dual clip
    gspo_clip_low: float = 3e-4  # GSPO clips its sequence-level ratio to [1 - low, 1 + high]
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0  # CISPO clips its importance weights to [1 - low, 1 + high] (ScaleRL: [0, 5])
    cispo_clip_high: float = 4.0
    loss_agg: str = "auto"  # auto | token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    entropy_coef: float = 0.0
    value_clip: float = 0.2
    # token | sequence: truncated IS against the rollout's log-probs; auto: token when stale
    rollout_is: Literal["auto", "", "token", "sequence"] = "auto"
    rollout_is_cap: float = 2.0
    # token | sequence: masked importance sampling, tokens (sequences) outside the band drop
    rollout_mask: Literal["", "token", "sequence"] = ""
    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, draw more
    max_sampling_rounds: int = 4
    overlong_buffer: int = 0  # DAPO overlong shaping: > 0 penalises the last tokens before max_new_tokens
    overlong_factor: float = 1.0
    cost_limit: float = 0.0  # Safe-RLHF: the expected cost to stay under
    lagrange_init: float = 1.0
    lagrange_lr: float = 0.1

    def __post_init__(self) -> None:
        self.kl_loss_kind = KL_ALIASES.get(self.kl_loss_kind, self.kl_loss_kind)
        self.kl_reward_kind = KL_ALIASES.get(self.kl_reward_kind, self.kl_reward_kind)

    @property
    def uses_reference(self) -> bool:
        """Whether a KL term (in the loss or in the rewards) needs the frozen reference policy."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0

    @property
    def aggregation(self) -> str:
        """``loss_agg``; with ``auto``, the aggregation the algorithm's paper prescribes: Dr. GRPO's constant
        normaliser, GSPO's per-sequence mean, otherwise the token mean."""
        if self.loss_agg != "auto":
            return self.loss_agg
        if self.policy_loss == "gspo":
            return "seq-mean-token-mean"
        return "seq-mean-token-sum-norm" if self.name == "dr_grpo" else "token-mean"


@dataclass
class TaskConfig:
    """Where prompts and rewards come from: a bundled task, or a GSM8K-format file."""

    name: str = "arithmetic"  # a bundled task (arithmetic, calculator, countdown, sorting, word_problems,
    # reasoning_gym), or "gsm8k"
    digits: int = 2  # arithmetic, calculator: digits per operand; countdown: digits per number
    operators: str = "+"  # arithmetic: drawn per prompt; countdown: those a puzzle's solution may use
    partial_credit: str = "format"  # arithmetic, calculator, sorting: "format" (well-formed answers) or "digits"
    length: int = 4  # sorting: characters per prompt; countdown: numbers per puzzle
    operations: int = 2  # word_problems: at most this many steps per story (1-3)
    max_value: int = 20  # word_problems: the largest starting count and step amount
    unformatted_credit: float = 0.0  # word_problems: score of the right number without '#### n' or \boxed{n}
    format_credit: float = 0.0  # word_problems: score of a wrong answer in one of those formats
    dataset_path: str = ""  # gsm8k: .jsonl or .parquet
    dataset: str = ""  # reasoning_gym: the generator's name (e.g. products, basic_arithmetic, countdown)
    dataset_options: dict[str, Any] = field(default_factory=dict)  # reasoning_gym: its config's fields
    chat_template: bool | None = None  # render prompts with the tokenizer's chat template; None: when it has one
    system_prompt: str = ""  # a system turn before each prompt (raw format: a line before it)
    few_shot: int = 0  # worked examples (the task's demonstrations) shown before each prompt; bundled tasks
    eval_size: int = 64
    cost: str = ""  # safe_rlhf: a rule cost ("digit_cost")
    reward_on_error: Literal["fail", "zero"] = "fail"  # a reward function raising or returning NaN/inf (zero: counted)
    reward_timeout_s: float = 0.0  # > 0: rule rewards run in a child process, killed after this many seconds


@dataclass
class AgentConfig:
    """Multi-turn rollouts, for a task with tools (e.g. ``calculator``): docs/agents.md."""

    tools: tuple[str, ...] = ()  # bundled tools (calc, python) added to the task's own: any task becomes multi-turn
    call_format: Literal["plain", "hermes"] = "plain"  # how calls are written: [name args] or <tool_call>{json}
    describe_tools: bool = True  # prompts describe the tools (the chat template's tools=, or the call format's text)
    max_turns: int = 4  # policy turns per trajectory
    max_tokens: int = 128  # tokens after the prompt: the policy's turns and the observations between them
    tool_timeout_s: float = 10.0  # a call with no result by then is a timeout (an error observation)
    max_result_chars: int = 2000  # a longer tool result is cut, saying so
    end_on_error: bool = False  # a tool error, timeout or malformed call ends the trajectory with reward 0
    tool_workers: int = 0  # > 0: environments and tools run on this many Ray actors, trajectories in parallel
    feedback: bool = False  # a wrong answer gets the task's feedback and another try, up to max_turns answers
    credit: Literal["episode", "turn"] = "episode"  # token rewards: the episode's score at its end, or each turn's
    # reward at that turn's end (per-turn credit through GAE)
    retry_discount: float = 1.0  # feedback: a solved episode's reward times this per extra try


@dataclass
class TrainerConfig:
    """The run loop: steps, run directory, checkpoints, logging."""

    steps: int = 20
    run_dir: str = "runs/lab"
    save_every: int = 0  # 0: only when asked
    keep_checkpoints: int = 2  # the newest checkpoints kept on disk; 0: every one
    eval_every: int = 0
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient norm: stop the run, or skip the step
    logged_samples: int = 8  # rows of each step's batch kept for the sample browser, samples.jsonl and wandb
    progress: bool = True
    overlap: bool = True  # lab.step() runs stages on different resource pools at the same time (lab.overlapped)
    stage_timeout_s: float = 1800.0  # a stage whose ranks have not all answered by then fails, naming them
    capture: str = ""  # stages whose output batch each step keeps on disk ("reward,ref" or "all"; lab.replay)
    capture_steps: int = 4  # the newest steps whose captures are kept (0: every step's)
    wandb: bool = False
    wandb_project: str = "hybridflow-lab"


@dataclass
class LabConfig:
    """Everything a run needs. ``actor.model_path`` is the policy (and the reference policy)."""

    REFUSED_IF_GIVEN: ClassVar[dict[str, tuple[object, str]]] = {
        f"{role}.lora.rank": (0, f"0 trains no adapters: LoRA is off while {role}.lora.rank is left unset (full "
                                 f"fine-tuning); remove the key, or set a rank >= 1 (e.g. 8) to train adapters")
        for role in ("actor", "critic")
    }

    backend: Literal["ray", "local"] = "ray"  # "local": every role in this process, one rank each
    device: Literal["auto", "cpu", "cuda"] = "auto"  # cuda: one GPU per rank; auto: cuda where the cluster has GPUs
    seed: int = 0
    actor: RoleConfig = field(default_factory=lambda: RoleConfig(ranks=2))
    critic: RoleConfig = field(default_factory=lambda: RoleConfig(ranks=2, optim=OptimConfig(lr=1e-5)))
    reward_model_path: str = ""  # empty: rule rewards only
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def model_source(self, role: str) -> tuple[str, str]:
        """The model directory ``role`` loads and the path that runs it (``model_impl``): its own, else the
        actor's (a critic starts from the policy by default)."""
        own = getattr(self, role)
        return (own.model_path, own.model_impl) if own.model_path else (self.actor.model_path, self.actor.model_impl)

    def pool_nodes(self, roles: tuple[str, ...]) -> dict[str, list[int]]:
        """Each pool named by ``roles`` as its slots on each node: the ranks of the first role placed on it,
        spread over that role's ``nodes``."""
        slots: dict[str, list[int]] = {}
        for name in roles:
            role = getattr(self, name)
            slots.setdefault(role.pool, [role.ranks // role.nodes] * role.nodes)
        return slots

    def pool_slots(self, roles: tuple[str, ...]) -> dict[str, int]:
        """Each pool named by ``roles``, sized by the ranks of the first role placed on it."""
        return {pool: sum(per_node) for pool, per_node in self.pool_nodes(roles).items()}
