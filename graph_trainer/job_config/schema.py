"""Job configuration schema: one dataclass per TOML section, and `JobConfig` holding them all.

Each field carries its default, its one-line meaning and its declarative limits
(`choices`, `ge`/`gt`/`le`/`lt`) in one place; the command-line help
(`graph_trainer.job_config.cli`), type checks and range checks (`graph_trainer.job_config.values`)
are generated from them. Loading TOML files, applying overrides and the checks
that involve more than one field live in `graph_trainer.job_config.load`.

Precedence, lowest first: dataclass defaults, the `--config` TOML file, then
`--section.key VALUE` overrides.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str, alias: str | None = None, **limits: Any) -> Any:
    """A dataclass field with its meaning and limits kept next to its default.

    limits: `choices` (allowed values), `ge`, `gt`, `le`, `lt` (numeric bounds,
    applied to each element for list fields); see `config_values.check_limits`.
    alias: a second name for the same key (torchtitan's, where it names the option differently), accepted in
    TOML files and on the command line; the field's own name stays canonical (`--print-config` writes it).
    """
    meta = {"help": help, **limits}
    if alias is not None:
        meta["alias"] = alias
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSection:
    dump_folder: str = _opt("./outputs", "folder for logs, TensorBoard events, checkpoints and the resolved config")
    description: str = _opt("", "free-text description of the run")
    overwrite: bool = _opt(False, "allow reusing a non-empty dump folder")


def _family_options() -> dict[str, tuple[Any, dict[str, Any]]]:
    """Every model family's args fields as `[model]` options: name -> (type | None, metadata). Their types, limits
    and help are declared next to the args (models/<family>/model.py, `models.common.spec.arg`); None keeps the
    flavor's value. `families` in the metadata: the families that have the field (--help lists the configured
    one's), and `help_by_family` each one's own words."""
    from models import MODELS
    from models.common.spec import arg_fields

    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    for family, spec in MODELS.items():
        for name, (tp, meta) in arg_fields(spec.args_cls).items():
            optional = tp | None
            if name in out and out[name][0] != optional:
                raise TypeError(f"model field {name} is {out[name][0]} in one family and {optional} in {family}")
            _, known = out.setdefault(name, (optional, {**meta, "families": (), "help_by_family": {}}))
            known["families"] += (family,)
            known["help_by_family"][family] = meta["help"]
    return out


def _model_overrides(self: Any) -> dict[str, Any]:
    """The model-arg overrides that are set (not None), keyed by ModelArgs field name."""
    return {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(self)
        if f.name not in ("name", "flavor") and getattr(self, f.name) is not None
    }


# [model]: the family, its size preset, and then every family's args fields, each an override of the flavor's value.
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [
        ("name", str, _opt("llama3", "model family in the models registry")),
        ("flavor", str, _opt("debugmodel", "size preset of the model family")),
        *[
            (name, tp, field(default=None, metadata={**meta, "help": f"override: {meta['help']}"}))
            for name, (tp, meta) in _family_options().items()
        ],
    ],
    namespace={"overrides": _model_overrides, "__module__": __name__},
)


@dataclass
class TrainingConfig:
    steps: int = _opt(20, "number of optimizer steps", ge=0)
    local_batch_size: int = _opt(8, "sequences per micro-batch on each data-parallel rank", ge=1)
    global_batch_size: int = _opt(
        -1,
        "sequences per optimizer step over all ranks: local_batch_size x data-parallel degree x gradient "
        "accumulation steps; -1 = local_batch_size x data-parallel degree (no accumulation)",
        ge=-1,
    )
    seq_len: int = _opt(256, "tokens per sequence (at most the model's max_seq_len)", ge=1)
    seed: int = _opt(0, "random seed for initialization, data order and dropout")
    deterministic: bool = _opt(False, "use deterministic algorithms (bitwise reproducible runs)")
    max_norm: float = _opt(1.0, "gradient clipping max norm; <= 0 disables clipping (the norm is still logged)")
    dtype: str = _opt(
        "auto",
        "compute dtype: bfloat16 = autocast over float32 weights; auto = float32 on CPU, bfloat16 on CUDA",
        choices=("auto", "float32", "bfloat16"),
    )
    device: str = _opt("auto", "device to train on; auto = cuda when available", choices=("auto", "cpu", "cuda"))
    loss_chunk_size: int = _opt(
        0,
        "tokens per chunk of the output projection + loss (logits recomputed in the backward); 0 = all tokens at once",
        ge=0,
    )
    # FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype), under torchtitan's names.
    mixed_precision_param: str = _opt(
        "float32",
        "dp_shard: dtype the parameters are all-gathered and computed in (FSDP2's param_dtype); the "
        "shards, gradients and AdamW state stay float32",
        choices=("float32", "bfloat16"),
    )
    mixed_precision_reduce: str = _opt(
        "float32",
        "dp_shard: dtype the gradients are reduce-scattered in (FSDP2's reduce_dtype), then cast to float32",
        choices=("float32", "bfloat16"),
    )


@dataclass
class OptimizerConfig:
    name: str = _opt("AdamW", "optimizer", choices=("AdamW",))
    lr: float = _opt(8e-4, "peak learning rate", gt=0)
    betas: list[float] = _opt([0.9, 0.95], "AdamW beta1, beta2", ge=0, lt=1)
    eps: float = _opt(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = _opt(0.1, "decoupled weight decay", ge=0)
    implementation: str = _opt(
        "auto",
        "AdamW update outside the graph; auto = fused on CUDA, single_tensor on CPU",
        choices=("auto", "single_tensor", "foreach", "fused"),
    )


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = _opt(2, "steps of linear warmup from ~0 to optimizer.lr", ge=0)
    decay_type: str = _opt("linear", "decay after warmup", choices=("linear", "cosine", "none"))
    min_lr_factor: float = _opt(0.0, "final lr as a fraction of optimizer.lr", ge=0, le=1)


@dataclass
class DataConfig:
    source: str = _opt(
        "embedded",
        "training text: embedded corpus, a text file, a jsonl file, instruction or chat rows (jsonl/json/parquet: "
        "only the answers count in the loss), random tokens, or parquet/json/arrow files read with Hugging Face "
        "datasets",
        choices=("embedded", "text", "jsonl", "chat", "synthetic", "hf_datasets"),
    )
    path: str = _opt(
        "",
        "input file or folder (required for source text|jsonl|chat|hf_datasets); given without data.source, the "
        "source is the one its files need: instruction rows (messages, or prompt and completion) are 'chat'",
    )
    tokenizer: str = _opt("byte", "'byte' (256 bytes + BOS/EOS) or a path to a HF tokenizer.json")
    text_column: str = _opt("text", "hf_datasets: the column that holds the text")
    streaming: bool = _opt(False, "hf_datasets: stream the files (IterableDataset) instead of loading them")
    shuffle: bool = _opt(
        False,
        "hf_datasets: visit the rows in an order drawn from training.seed anew each pass (the other sources always "
        "shuffle their windows)",
    )
    shuffle_buffer: int = _opt(10_000, "hf_datasets with data.streaming: rows a stream is shuffled within", ge=1)
    chat_template: str = _opt(
        "",
        "chat: a Jinja chat template file for rows of messages; empty: the tokenizer folder's (chat_template.jinja, "
        "or chat_template in tokenizer_config.json)",
    )
    # torchtitan has no job option for this: its models choose `attn_mask_type = "block_causal"` in their own
    # arguments (documents cut at the EOS id), so there is no alias to declare here.
    document_masking: bool = _opt(
        False,
        "packed documents do not see each other: each attends only within itself and its RoPE positions restart at 0 "
        "(each batch carries its rows' document ids, so moving boundaries never retrace the step); on by default for "
        "data.source chat",
    )


@dataclass
class ValidationConfig:
    enable: bool = _opt(False, "evaluate the loss on held-out data every validation.freq steps")
    freq: int = _opt(10, "evaluate every N training steps, and after the last", ge=1)
    steps: int = _opt(4, "batches per evaluation on each data-parallel rank", ge=1)
    path: str = _opt(
        "",
        "held-out data, read as data.source reads data.path; empty: hold out every "
        "validation.holdout_every-th document of the training data",
        alias="dataset_path",
    )
    holdout_every: int = _opt(
        8, "with no validation.path: document i is held out of training when i % N == N - 1", ge=2
    )


@dataclass
class ActivationCheckpointConfig:
    mode: str = _opt("none", "activation checkpointing", choices=("none", "selective", "full", "budget"))
    selective_ac_option: str | int = _opt(
        "op", "selective: 'op' = save compute-heavy ops, N = checkpoint every N-th layer"
    )
    memory_budget: str | float = _opt(
        0.5,
        "budget: a fraction in (0, 1] of the no-AC activation memory, or the whole step's per-rank peak with its "
        "unit, e.g. '40GiB' (graph_trainer/job_config/memory_budget.py); under pp a fraction only, of one process's "
        "micro-batch (docs/pipeline.md)",
    )
    save_list: list[str] = _opt([], "ops always saved, e.g. 'aten.mm' or 'layers.*.attention::aten.mm'")
    recompute_list: list[str] = _opt([], "ops always recomputed, same syntax as save_list")


@dataclass
class CompileConfig:
    mode: str = _opt(
        "trace", "trace = whole step as one FX graph; eager = plain PyTorch baseline", choices=("trace", "eager")
    )
    trace_optimizer: bool = _opt(False, "include the optimizer update in the traced graph")
    on_shape_change: str = _opt("retrace", "what to do when a batch has a new shape", choices=("retrace", "error"))
    dump_graphs: bool = _opt(False, "write the traced graphs (before/after passes) to the dump folder")
    disable_passes: list[str] = _opt([], "graph passes to skip, by registry name")
    log_saved_activations: bool = _opt(False, "log which activations the step graph keeps for backward")
    backend: str = _opt(
        "none",
        "none = run the traced graph op by op (bitwise with eager); inductor = compile "
        "the final graph with Inductor (faster, not bitwise)",
        choices=("none", "inductor"),
    )
    cudagraphs: bool = _opt(
        False, "CUDA only, with backend inductor and regional = false: replay the whole step as one CUDA graph"
    )
    regional: bool = _opt(
        True,
        "with backend inductor: compile each layer's forward, backward and update once and "
        "reuse it for identical layers (compile time independent of depth); false = the whole step "
        "as one graph",
    )


@dataclass
class MetricsConfig:
    log_freq: int = _opt(1, "console line every N steps (every step is recorded)", ge=1)
    enable_tensorboard: bool = _opt(True, "write TensorBoard events under the dump folder")
    track_memory: bool = _opt(True, "exact CPU live-tensor peak memory (CUDA allocator stats are always read)")


@dataclass
class CheckpointConfig:
    enable: bool = _opt(False, "save checkpoints")
    interval: int = _opt(10, "save every N steps (and at the last step)", ge=1)
    folder: str = _opt("checkpoint", "checkpoint folder, relative to job.dump_folder")
    resume: bool = _opt(False, "resume from the latest checkpoint in the folder")
    keep_latest_k: int = _opt(2, "checkpoints to keep", ge=1)
    initial_load_path: str = _opt(
        "",
        "start from these pretrained weights instead of random ones: a Hugging Face folder (config.json + "
        "safetensors), which is the model: its config.json sets [model], its tokenizer.json data.tokenizer (unless "
        "given); a resumed checkpoint's weights (checkpoint.resume) win over its weights",
    )
    initial_load_in_hf: bool = _opt(
        True, "initial_load_path is in Hugging Face format (the only format it reads; torchtitan's option)"
    )


@dataclass
class ParallelismConfig:
    dp_shard: int = _opt(
        1,
        "FSDP degree (processes): parameters, gradients and optimizer state sharded",
        alias="data_parallel_shard_degree",
        ge=1,
    )
    fsdp_reshard_after_forward: str = _opt(
        "default",
        "dp_shard: re-gather parameters in the backward (always), keep the forward's gather (never), "
        "or re-gather the layers and keep the root (default)",
        choices=("default", "always", "never"),
    )
    fsdp_prefetch: bool = _opt(
        False,
        "dp_shard: issue each layer's all-gather while the previous layer "
        "computes (overlap; one more layer's parameters alive)",
    )
    fsdp_grad_sync: str = _opt(
        "micro_batch",
        "dp_shard with gradient accumulation: reduce-scatter every micro-batch's gradients and accumulate the "
        "shards (micro_batch), or accumulate whole gradients and reduce-scatter once per step (step: less "
        "communication, one unsharded gradient per parameter held between micro-batches)",
        choices=("micro_batch", "step"),
    )
    dp_replicate: int = _opt(
        1,
        "replicated data-parallel degree (processes): full copies, gradients all-reduced",
        alias="data_parallel_replicate_degree",
        ge=1,
    )
    tp: int = _opt(
        1,
        "tensor-parallel degree (processes): attention heads, FFN width and vocabulary split, the norms and the "
        "residual stream sharded along the sequence (sequence parallelism); peers read the same batch",
        alias="tensor_parallel_degree",
        ge=1,
    )
    ep: int = _opt(
        1,
        "expert-parallel degree, carved out of dp_shard (not extra processes): each rank runs n_routed_experts / ep "
        "routed experts (FSDP-sharded over dp_shard / ep ranks) and tokens travel to them by all-to-all; must divide "
        "dp_shard and n_routed_experts (below dp_shard, dp_shard must divide n_routed_experts too)",
        alias="expert_parallel_degree",
        ge=1,
    )
    pp: int = _opt(
        1,
        "pipeline-parallel degree (processes): the traced micro-step cut into pp stages of model.n_layers / pp "
        "blocks each (the embedding and output counted as a block each when pp does not divide them), run under "
        "torch's pipeline schedules (docs/pipeline.md); stage peers read the same batch; combines with "
        "dp_replicate, dp_shard (FSDP within each stage), tp and ep",
        alias="pipeline_parallel_degree",
        ge=1,
    )
    pp_schedule: str = _opt(
        "1F1B",
        "pp > 1: torch's schedule (torchtitan's names); Interleaved1F1B and InterleavedZeroBubble run "
        "pp_stages_per_rank stages a rank, ZBVZeroBubble two (a V); the zero-bubble ones run each stage's weight "
        "gradients apart from its input gradients, later",
        alias="pipeline_parallel_schedule",
        choices=("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"),
    )
    pp_stages_per_rank: int = _opt(
        2,
        "pp > 1 with Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble (2): stages each rank runs (rank r "
        "runs stages r, r + pp, ...; r and 2 pp - 1 - r under ZBVZeroBubble); the pp x this stages split "
        "model.n_layers, evenly when they divide it",
        ge=1,
    )
    pp_microbatch_size: int = _opt(
        1,
        "pp > 1: sequences per micro-batch; the local batch is cut into local_batch_size / pp_microbatch_size "
        "micro-batches (1F1B needs at least pp of them)",
        alias="pipeline_parallel_microbatch_size",
        ge=1,
    )
    ep_capacity_factor: float = _opt(
        1.25,
        "ep > 1: rows each rank may send to each other rank, as a multiple of an even share "
        "(tokens x top_k / ep); rows over it are dropped (counted, logged); a factor of ep never drops",
        gt=0,
    )

    @property
    def shards_parameters(self) -> bool:
        """Whether FSDP shards the parameters (dp_shard > 1): what the passes ask to know whether the FSDP passes
        run, without naming a parallelism outside option validation."""
        return self.dp_shard > 1


@dataclass
class ProfilingConfig:
    enable_profiling: bool = _opt(
        False, "write a torch.profiler Chrome trace of every profile_freq-th step under job.dump_folder"
    )
    save_traces_folder: str = _opt("profile_traces", "folder of the profiler traces, relative to job.dump_folder")
    profile_freq: int = _opt(10, "profile (and snapshot) every N-th step", ge=1)
    enable_memory_snapshot: bool = _opt(
        False,
        "CUDA: record the allocator's history and dump a snapshot every profile_freq steps; CPU: plot the "
        "step's live bytes per graph node, estimate against measured (PNG + JSON; needs matplotlib)",
    )
    save_memory_snapshot_folder: str = _opt(
        "memory_snapshot", "folder of the memory snapshots and timelines, relative to job.dump_folder"
    )


@dataclass
class PlanConfig:
    require_depth_free: bool = _opt(
        False,
        "the dry run, the preflight and python -m graph_trainer.plan refuse (exit 2) to plan a deep model by "
        "tracing its whole depth (where the short traces do not prove its blocks identical, or the step "
        "accumulates) instead of saying so and going on; a whole trace takes minutes a mode at 70B",
    )


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in JobConfig order."""
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}


def section_fields(section_cls: type) -> dict[str, dataclasses.Field]:
    """Field name -> dataclass field of one section class."""
    return {f.name: f for f in dataclasses.fields(section_cls)}


def field_aliases(section_cls: type) -> dict[str, str]:
    """Alias -> canonical field name, for the fields of one section class that declare one."""
    return {f.metadata["alias"]: f.name for f in dataclasses.fields(section_cls) if "alias" in f.metadata}
