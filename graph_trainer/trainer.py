"""The training loop: wires config, model, data, step (eager or traced), metrics and checkpoints.

Data flows one way: config -> model + data -> step (tracer + passes, or eager)
-> metrics -> checkpoint. The trainer holds the loop and no graph logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.checkpoint import (CheckpointManager, capture_rng_state, load_model_state,
                                      restore_rng_state)
from graph_trainer.config import JobConfig
from graph_trainer.config_load import config_to_toml
from graph_trainer.data import build_dataloader
from graph_trainer.device import peak_flops, resolve_dtype, set_determinism
from graph_trainer.digest import tensors_digest
from graph_trainer.distributed import DistInfo, single_process
from graph_trainer.eager import EagerStep
from graph_trainer.errors import UserError
from graph_trainer.log import configure_console, get_logger
from graph_trainer.loss import build_lm_loss
from graph_trainer.memory import MemoryMonitor
from graph_trainer.units import to_gib
from graph_trainer.fsutil import atomic_write_text
from graph_trainer.metrics import SUMMARY_FILE, TB_SUBDIR, MetricsLogger
from graph_trainer.optimizer import (GraphAdamW, build_lr_scheduler, build_optimizer, choose_adamw_implementation,
                                     init_adamw_state, resync_lr)
from graph_trainer.planner import EagerUpdate, optimizer_in_graph, preflight, whole_step_peak
from graph_trainer.run_folder import CONFIG_FILE, RunFolder, inspect
from graph_trainer.tokenizer import build_tokenizer
from graph_trainer.tracer.capture import TraceError
from graph_trainer.tracer.executor import GraphStep
from models import build_model_args, get_model_spec
from models.llama3.model import flops_per_token, num_params

logger = get_logger(__name__)


class TrainingDiverged(UserError):
    """The loss became NaN or inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class TrainResult:
    """What a finished run returns to its caller (tests, benchmarks)."""

    losses: list[float]
    final_step: int
    params_sha256: str
    grads_sha256: str
    trace_count: int
    records: list[dict[str, Any]]  # every step's metrics record, as logged


def autocast_loss(dtype: torch.dtype, device: torch.device, chunk_size: int = 0):
    """The LM loss (chunked when `chunk_size` > 0), under bf16 autocast when the compute dtype asks for it."""
    base = build_lm_loss(chunk_size)
    if dtype == torch.float32:
        return base

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return base(model, batch)
    return loss_fn


def inspect_run_folder(cfg: JobConfig) -> RunFolder:
    """Check job.dump_folder and checkpoint.folder without writing anything (see `graph_trainer.run_folder`)."""
    return inspect(cfg.job.dump_folder, cfg.checkpoint.folder, resume=cfg.checkpoint.resume,
                   overwrite=cfg.job.overwrite, checkpoint_enable=cfg.checkpoint.enable)


@contextlib.contextmanager
def cli_trace_errors():
    """Give a trace failure the command line's way out instead of the tracer API's."""
    try:
        yield
    except TraceError as e:
        if e.fix != TraceError.API_FIX:
            raise
        raise TraceError(e.problem, fix="fix the code or run with --compile.mode eager") from e


def build_model(cfg: JobConfig, device: torch.device, vocab_needed: int) -> nn.Module:
    """Build on the meta device (nothing allocated), then materialize on `device` and initialize."""
    args = build_model_args(cfg.model.name, cfg.model.flavor, cfg.model.overrides())
    if vocab_needed > args.vocab_size:
        raise UserError(f"the tokenizer has {vocab_needed} ids but model.vocab_size is {args.vocab_size}; "
                        "set model.vocab_size >= the tokenizer's vocabulary")
    # training.seq_len <= max_seq_len is checked once, when the config is validated (config_load).
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).model_cls(args)
    model.to_empty(device=device)
    torch.manual_seed(cfg.training.seed)
    model.init_weights()
    return model


def _then(first, second):
    """Apply `first`, then `second` (the pass pipeline, then the compile stage)."""
    return lambda traced: second(first(traced))


class Trainer:
    """One training job, from a validated `JobConfig`.

    `train()` runs `training.steps` steps (continuing from a checkpoint with
    `checkpoint.resume`) and returns a `TrainResult`.

    With `dist` from `graph_trainer.distributed.init_distributed`, this is one rank
    of a data-parallel job: it trains on its slice of the data, the step averages
    gradients over the ranks, and only rank 0 logs and saves. Without it, the job
    must be a single process.
    """

    def __init__(self, cfg: JobConfig, *, dist: DistInfo | None = None):
        self.cfg = cfg
        self.dist = dist if dist is not None else single_process(cfg)
        rank, world_size = self.dist.rank, self.dist.world_size
        self.rank, self.world_size = rank, world_size
        configure_console(rank)  # rank 0 prints progress; the others only warnings and errors
        self.device = self.dist.device
        self.dtype = resolve_dtype(cfg.training.dtype, self.device)
        # Everything is validated before the first write: folders (read only), data, tokenizer, preflight,
        # model and checkpoint. Only then is a replaced run's folder cleared (`_prepare_run_folder`).
        self.run_folder = inspect_run_folder(cfg)
        self.dump_folder = self.run_folder.dump_folder
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.dataloader = build_dataloader(cfg.data.source, cfg.data.path, tokenizer,
                                           batch_size=cfg.training.local_batch_size,
                                           seq_len=cfg.training.seq_len, seed=cfg.training.seed,
                                           rank=rank, world_size=world_size)
        set_determinism(cfg.training.seed, cfg.training.deterministic, self.device)

        loss_fn = autocast_loss(self.dtype, self.device, cfg.training.loss_chunk_size)
        with cli_trace_errors():
            plan = preflight(cfg, self.device, loss_fn=loss_fn)
        logger.info(f"preflight: predicted step peak {to_gib(plan.peak_bytes):.3f} GiB "
                 f"(activations saved for backward {to_gib(plan.saved_bytes):.3f} GiB)")
        self.model = build_model(cfg, self.device, tokenizer.vocab_size)
        self.model.train()
        self.model_args = self.model.args
        self.num_params = num_params(self.model)
        logger.info(f"model {cfg.model.name}/{cfg.model.flavor}: {self.num_params:,} parameters, "
                 f"device {self.device}, compute dtype {str(self.dtype).removeprefix('torch.')}, "
                 f"mode {cfg.compile.mode}")

        o = cfg.optimizer
        # Chosen explicitly per device (fused on CUDA, single-tensor on CPU): the preflight modelled this one.
        implementation = choose_adamw_implementation(o.implementation, self.device,
                                                     trace_optimizer=optimizer_in_graph(cfg))
        self.optimizer = build_optimizer(self.model, name=o.name, lr=o.lr, betas=tuple(o.betas),
                                         eps=o.eps, weight_decay=o.weight_decay, implementation=implementation)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                init_adamw_state(self.optimizer, p)
        s = cfg.lr_scheduler
        self.scheduler = build_lr_scheduler(self.optimizer, warmup_steps=s.warmup_steps,
                                            total_steps=cfg.training.steps, decay_type=s.decay_type,
                                            min_lr_factor=s.min_lr_factor)
        self.step_fn, self.graph_step = self._build_step()
        self._eager_update = None if optimizer_in_graph(cfg) else EagerUpdate.of(self.optimizer, implementation,
                                                                                 self.device)
        self.memory = MemoryMonitor(self.device, track=cfg.metrics.track_memory)
        self.checkpointer = CheckpointManager(self.run_folder.checkpoint_folder,
                                              enable=cfg.checkpoint.enable and rank == 0,
                                              interval=cfg.checkpoint.interval,
                                              keep_latest_k=cfg.checkpoint.keep_latest_k)
        self.step = 0
        if cfg.checkpoint.resume:
            self._resume()
        self._prepare_run_folder()
        self.flops_per_token = flops_per_token(self.model_args, cfg.training.seq_len)
        self.peak_flops = peak_flops(self.device, self.dtype)

    def _prepare_run_folder(self) -> None:
        """The first write: clear a replaced run (its recorded files only), start the manifest, write config.toml.

        Rank 0 writes; every rank has finished its checks (barrier) before anything is deleted.
        """
        self.dist.barrier()
        if self.rank == 0:
            manifest = self.run_folder.prepare()
            self.checkpointer.record, self.checkpointer.owns = manifest.record, manifest.owns
            for name in (CONFIG_FILE, SUMMARY_FILE):
                manifest.record(self.dump_folder / name)
            atomic_write_text(self.dump_folder / CONFIG_FILE, config_to_toml(self.cfg))
            # Files that later appear here (TensorBoard events, graph dumps) are adopted as ours.
            self._preexisting = {p for d in (TB_SUBDIR, "graphs") for p in (self.dump_folder / d).rglob("*")}
        self.dist.barrier()

    def _adopt_new_files(self) -> None:
        if self.rank == 0:
            for d in (TB_SUBDIR, "graphs"):
                self.run_folder.adopt_new_files(self.dump_folder / d, self._preexisting)

    def _build_step(self):
        cfg = self.cfg
        from graph_trainer.tracer.compiled import check_compile_config

        check_compile_config(cfg.compile.backend, cfg.compile.cudagraphs, cfg.compile.mode, self.device)
        self.inductor = None
        loss_fn = autocast_loss(self.dtype, self.device, cfg.training.loss_chunk_size)
        if cfg.compile.mode == "eager":
            from graph_trainer.eager_checkpoint import apply_eager_checkpointing

            apply_eager_checkpointing(self.model, cfg.activation_checkpoint)
            return EagerStep(self.model, loss_fn=loss_fn, max_norm=cfg.training.max_norm,
                             grad_reduce=self.dist.grad_reduce()), None
        from graph_trainer.passes import build_pipeline

        # Every rank traces the same graph; one copy of the dumps is enough.
        dump_dir = self.dump_folder / "graphs" if self.rank == 0 else None
        transform = build_pipeline(cfg, dump_dir=dump_dir)
        self.inductor = None
        if cfg.compile.backend == "inductor":
            from graph_trainer.tracer.compiled import InductorStage

            self.inductor = InductorStage(cudagraphs=cfg.compile.cudagraphs)
            transform = _then(transform, self.inductor)
        graph_optimizer = GraphAdamW(self.optimizer) if cfg.compile.trace_optimizer else None
        graph_step = GraphStep(self.model, loss_fn=loss_fn, max_norm=cfg.training.max_norm,
                               optimizer=graph_optimizer, on_shape_change=cfg.compile.on_shape_change,
                               transform=transform, device=self.device,
                               failure_dir=self.dump_folder / "graphs",
                               grad_reduce=self.dist.grad_reduce())
        return graph_step, graph_step

    def _resume(self) -> None:
        latest = self.checkpointer.latest_step()
        if latest is None:
            raise UserError(f"checkpoint.resume is set but {self.checkpointer.folder} holds no checkpoint; "
                            "drop --checkpoint.resume to start a new run")
        state = self.checkpointer.load(latest)
        load_model_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        resync_lr(self.scheduler)
        self.dataloader.load_state_dict(state["data"])
        restore_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        logger.info(f"resumed from {self.checkpointer.path(latest)} at step {self.step}")

    def _state(self) -> dict[str, Any]:
        # Saved by rank 0 only: weights are replicated, and every rank has taken the same number of
        # batches, so rank 0's data position is every rank's (each maps it to its own slice on load).
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict(), "data": self.dataloader.state_dict(),
                "rng": capture_rng_state(self.device), "step": self.step}

    def _live_tensors(self, batch: Any) -> list[torch.Tensor]:
        """Tensors alive when a step starts: what the CPU memory figure counts besides the step's own."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *batch.values(), *state]

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One optimizer step on `batch`; returns the step's metrics record."""
        lr = self.optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        with self.memory.measure_step(self._live_tensors(batch)) as mem:
            with cli_trace_errors():
                loss, grad_norm = self.step_fn(batch)
            if self.graph_step is None or self.graph_step.optimizer is None:
                self.optimizer.step()
        self.scheduler.step()
        # The logged loss is the mean over ranks (equal-sized local batches), all-reduced outside the graph.
        loss_value = self.dist.global_average(loss).item()  # syncs the device, so the step time below is real
        step_time = time.perf_counter() - start
        tokens = batch["input"].numel() * self.world_size
        record = {"loss": loss_value, "grad_norm": grad_norm.item(), "lr": lr,
                  "step_time_s": step_time, "tokens_per_s": tokens / step_time,
                  "tflops": self.flops_per_token * tokens / step_time / 1e12, **mem.as_record()}
        if self.peak_flops:
            record["mfu_pct"] = 100 * record["tflops"] * 1e12 / (self.peak_flops * self.world_size)
        if self.graph_step is not None:
            record["trace_count"] = self.graph_step.stats.count
            record["trace_time_s"] = self.graph_step.stats.total_time_s
            if self.inductor is not None:
                record["inductor_time_s"] = self.inductor.total_time_s
                if self.inductor.cudagraphs and "peak_reserved_bytes" in record:
                    # A CUDA-graph replay uses its private pool without allocator calls, so the active
                    # peak can miss it; the reserved peak includes the pool: report that upper bound.
                    record["peak_active_bytes"] = record["peak_reserved_bytes"]
            estimate = self.graph_step.traced.memory_estimate
            if estimate is not None:
                record["estimated_peak_bytes"] = self._estimated_step_peak(estimate)
                record["saved_activation_bytes"] = estimate.saved_bytes
                if record.get("peak_active_bytes"):
                    # (estimate - measured) / measured: 0 on CPU; on CUDA the allocator's active peak.
                    record["estimate_error_pct"] = (100 * (record["estimated_peak_bytes"] - record["peak_active_bytes"])
                                                    / record["peak_active_bytes"])
        return record

    def _estimated_step_peak(self, estimate) -> int:
        """The graph's estimated peak, widened to the whole step when the optimizer runs outside the graph."""
        return whole_step_peak(estimate, self._eager_update)[0]

    def train(self) -> TrainResult:
        """Run the loop to `training.steps`; checkpoints, logs, and stops on a non-finite loss."""
        cfg = self.cfg
        losses, records = [], []
        wall_start = time.perf_counter()
        metrics = MetricsLogger(self.dump_folder, enable_tensorboard=cfg.metrics.enable_tensorboard,
                                log_freq=cfg.metrics.log_freq, total_steps=cfg.training.steps,
                                rank=self.rank, config_toml=config_to_toml(cfg))
        with metrics, self._adopting_files():
            data = iter(self.dataloader)
            while self.step < cfg.training.steps:
                batch = {k: v.to(self.device, non_blocking=True) for k, v in next(data).items()}
                record = self.train_step(batch)
                self.step += 1
                losses.append(record["loss"])
                records.append(record)
                metrics.log_step(self.step, record)
                if not math.isfinite(record["loss"]):
                    metrics.set_final({"status": "diverged", "final_step": self.step})
                    raise TrainingDiverged(self._diverged_message(record["loss"]))
                if self.checkpointer.should_save(self.step, last_step=self.step == cfg.training.steps):
                    self.checkpointer.save(self.step, self._state())
                    self._adopt_new_files()
                elif len(losses) == 1:
                    self._adopt_new_files()  # the first step opened TensorBoard and dumped the graphs
            result = TrainResult(
                losses=losses, final_step=self.step,
                params_sha256=tensors_digest(self.model.state_dict(keep_vars=False)),
                grads_sha256=tensors_digest({n: p.grad for n, p in self.model.named_parameters()
                                             if p.grad is not None}),
                trace_count=self.graph_step.stats.count if self.graph_step else 0, records=records)
            metrics.set_final({"status": "ok", "final_step": self.step,
                               "final_loss": losses[-1] if losses else None,
                               "params_sha256": result.params_sha256, "grads_sha256": result.grads_sha256,
                               "trace_count": result.trace_count,
                               "retrace_reasons": self.graph_step.stats.reasons if self.graph_step else [],
                               "num_params": self.num_params,
                               "wall_time_s": time.perf_counter() - wall_start})
        logger.info(self._results_line())
        return result

    @contextlib.contextmanager
    def _adopting_files(self):
        """Record the files the run wrote under tb/ and graphs/ in the manifest, however the loop ends."""
        try:
            yield
        finally:
            self._adopt_new_files()

    def _results_line(self) -> str:
        latest = self.checkpointer.latest_step() if self.cfg.checkpoint.enable else None
        ckpt = f", checkpoint {self.checkpointer.path(latest)}" if latest is not None else ""
        return f"results in {self.dump_folder}: {SUMMARY_FILE}, {CONFIG_FILE}" + (
            f", {TB_SUBDIR}/" if self.cfg.metrics.enable_tensorboard else "") + ckpt

    def _diverged_message(self, loss: float) -> str:
        kept = self.checkpointer.latest_step()
        where = f"the last good checkpoint (step {kept}) is kept" if kept is not None else "no checkpoint was saved"
        return (f"the loss became {loss} at step {self.step}; {where}; lower optimizer.lr, "
                "raise lr_scheduler.warmup_steps or keep training.max_norm > 0")
