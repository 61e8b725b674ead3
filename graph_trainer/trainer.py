"""The training loop: wires config, model, data, step (eager or traced), metrics and checkpoints.

Data flows one way: config -> model + data -> step (tracer + passes, or eager)
-> metrics -> checkpoint. The trainer holds the loop and no graph logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graph_trainer.builder import build_data, build_job, cli_trace_errors
from graph_trainer.checkpoint.checkpointer import build_checkpointer
from graph_trainer.checkpoint.run_folder import CONFIG_FILE, RunFolder, inspect
from graph_trainer.checkpoint.single_file import capture_rng_state, restore_rng_state
from graph_trainer.data.loader import CHAT_SOURCE
from graph_trainer.distributed.launch import single_process
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.errors import UserError, WriteFailed
from graph_trainer.job_config.load import config_to_toml
from graph_trainer.job_config.pretrained import model_name
from graph_trainer.job_config.resume import compare_on_resume, load_optimizer_state, stored_config
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.loss import IGNORE_INDEX
from graph_trainer.observability.digest import tensors_digest
from graph_trainer.observability.divergence import DivergenceGuard, TrainingDiverged
from graph_trainer.observability.log import configure_console, get_logger
from graph_trainer.observability.memory import MemoryMonitor
from graph_trainer.observability.memory_timeline import require_matplotlib, write_timeline
from graph_trainer.observability.metrics import SUMMARY_FILE, TB_SUBDIR, MetricsLogger
from graph_trainer.observability.outcome import diverged_line, interrupted_line, kept_line, write_failed_line
from graph_trainer.observability.profiling import StepProfiler
from graph_trainer.observability.units import to_gib
from graph_trainer.optimizer.lr_schedule import resync_lr
from graph_trainer.plan.preflight import preflight
from graph_trainer.plan.stage_plan import StagePlan
from graph_trainer.plan.step_plan import StepPlan
from graph_trainer.runtime.device import compute_dtype, peak_flops, resolve_dtype, set_determinism
from graph_trainer.runtime.folder_lock import in_use_message, lock_folder, release_folder
from graph_trainer.runtime.fsutil import WriteError, atomic_write_text
from graph_trainer.runtime.interrupts import Interrupted, StopRequest
from graph_trainer.validation import Validator

logger = get_logger(__name__)


@dataclasses.dataclass
class TrainResult:
    """What a finished run returns to its caller (tests, benchmarks)."""

    losses: list[float]
    final_step: int
    params_sha256: str
    grads_sha256: str
    trace_count: int
    records: list[dict[str, Any]]  # every step's metrics record, as logged


def inspect_run_folder(cfg: JobConfig) -> RunFolder:
    """Check job.dump_folder and checkpoint.folder without writing anything (see
    `graph_trainer.checkpoint.run_folder`)."""
    return inspect(
        cfg.job.dump_folder,
        cfg.checkpoint.folder,
        resume=cfg.checkpoint.resume,
        overwrite=cfg.job.overwrite,
        checkpoint_enable=cfg.checkpoint.enable,
    )


class Trainer:
    """One training job, from a validated `JobConfig`.

    `train()` runs `training.steps` steps (continuing from a checkpoint with
    `checkpoint.resume`) and returns a `TrainResult`.

    With `mesh` from `graph_trainer.distributed.launch.init_distributed`, this is one rank
    of a parallel job: it trains on its data-parallel slice of the data, the step's
    parallelisms (`graph_trainer.distributed`) reduce what they must, and only rank 0
    logs (checkpoints: rank 0 for replicated weights, every rank its own shards for
    sharded ones, see `graph_trainer.checkpoint`). Without it, the job must be a single
    process.
    """

    def __init__(self, cfg: JobConfig, *, mesh: Mesh | None = None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else single_process(cfg)
        self.rank, self.world_size = self.mesh.rank, self.mesh.world_size
        configure_console(self.rank)  # rank 0 prints progress; the others only warnings and errors
        # Before any check of the folder's contents: a run still writing there must not be told "pass --resume".
        self._lock_run_folder(Path(cfg.job.dump_folder).absolute())
        try:
            self._build(cfg)
        except BaseException:
            self._release_run_folder()
            raise

    def _build(self, cfg: JobConfig) -> None:
        self.device = self.mesh.device
        if cfg.profiling.enable_memory_snapshot and self.device.type != "cuda":
            require_matplotlib("profiling.enable_memory_snapshot")  # the CPU timeline is a plot
        self.compute_dtype = compute_dtype(cfg.training.dtype, self.device, cfg.training.mixed_precision_param)
        self.autocast_dtype = resolve_dtype(cfg.training.dtype, self.device, cfg.training.mixed_precision_param)
        # Everything is validated before the first write: folders (read only), data, tokenizer, preflight,
        # model and checkpoint. Only then is a replaced run's folder cleared (`_prepare_run_folder`).
        self.run_folder = inspect_run_folder(cfg)
        self.dump_folder = self.run_folder.dump_folder
        data = build_data(cfg, self.mesh)
        self.dataloader = data.loader
        set_determinism(cfg.training.seed, cfg.training.deterministic, self.device)
        with cli_trace_errors():
            plan = preflight(cfg, self.mesh)
        self.preflight = plan
        self.steps_run = 0  # by this process (a resumed run's first step is its first too)
        if isinstance(plan, StepPlan):  # a stage plan said its own line
            logger.info(
                f"preflight: predicted step peak {to_gib(plan.peak_bytes):.3f} GiB "
                f"(activations saved for backward {to_gib(plan.saved_bytes):.3f} GiB)"
            )
        # The job the preflight planned, materialized: from here on a sharded parameter is this rank's part of it.
        job = build_job(cfg, self.mesh, vocab_needed=data.tokenizer.vocab_size)
        job = job.with_budget_choice(plan.budget_choice)  # the step applies the choice the preflight planned
        self.model, self.parallel = job.model, job.parallel
        self.optimizer, self.scheduler = job.optimizer, job.scheduler
        self.model_args = self.model.args
        self.num_params = job.num_params()
        self.flops_per_token = job.flops_per_token()
        self.step_metrics = job.spec.step_metrics  # the family's own per-step figures (MoE: expert load)
        logger.info(
            f"model {model_name(cfg)}: {self.num_params:,} parameters, "
            f"device {self.device}, compute dtype {str(self.compute_dtype).removeprefix('torch.')}, "
            f"mode {cfg.compile.mode}, {self.parallel.describe()}"
        )
        # Every rank traces the same graph; one copy of the dumps is enough.
        self.step_fn = job.build_step(
            dump_dir=self.dump_folder / "graphs" if self.rank == 0 else None,
            failure_dir=self.dump_folder / "graphs",
            planned_graph=plan.step_graph,  # the preflight's trace (a stage plan's: its micro-step's)
        )
        self.memory = MemoryMonitor(self.device, track=cfg.metrics.track_memory)
        self.validator = None
        if data.validation is not None:
            step = job.build_eval_step(failure_dir=self.dump_folder / "graphs")
            v = cfg.validation
            self.validator = Validator(
                data.validation, step, self.mesh, self.memory, model=self.model, optimizer=self.optimizer,
                steps=v.steps, freq=v.freq,
            )  # fmt: skip
        c = cfg.checkpoint
        self.checkpointer = build_checkpointer(
            self.run_folder.checkpoint_folder,
            self.parallel,
            self.optimizer,
            enable=c.enable,
            interval=c.interval,
            keep_latest_k=c.keep_latest_k,
        )
        self.step = 0
        if cfg.checkpoint.resume:
            self._resume()
        # A finished run resumed with the same training.steps has nothing to do: write nothing at all.
        self.already_complete = cfg.checkpoint.resume and self.step >= cfg.training.steps
        if not self.already_complete:
            try:
                self._prepare_run_folder()
            except WriteError as e:
                raise WriteFailed(self._write_failed(e, None)) from None
        self.peak_flops = peak_flops(self.device, self.compute_dtype)

    def _lock_run_folder(self, folder: Path, *, create: bool = False) -> None:
        """Rank 0 locks `folder` (creating it with `create`, else only if it exists); every rank learns in one
        collective whether another run holds it, and refuses with the same line (see `runtime.folder_lock`)."""
        self._locked = folder
        holder = -1  # -1: not refused; else the holder's pid
        if self.rank == 0:
            if create:
                self.run_folder.create_dump_folder()
            if folder.is_dir():
                pid = lock_folder(folder)
                holder = -1 if pid is None else pid
        holder = self.mesh.max_over_ranks(holder)
        if holder >= 0:
            raise UserError(in_use_message(folder, holder))

    def _release_run_folder(self) -> None:
        if self.rank == 0:
            release_folder(self._locked)

    def _prepare_run_folder(self) -> None:
        """The first write: clear a replaced run (its recorded files only), start the manifest, write config.toml.

        Rank 0 writes; every rank has finished its checks (barrier) before anything is deleted.
        """
        self._lock_run_folder(self.dump_folder, create=True)  # a folder that did not exist at the start
        self.mesh.barrier()
        self._write_together(self._start_run_files)  # as a barrier, and every rank learns of a failed write

    def _start_run_files(self) -> None:
        """Rank 0: the manifest and config.toml (see `_prepare_run_folder`)."""
        if self.rank != 0:
            return
        manifest = self.run_folder.prepare()
        self.checkpointer.record, self.checkpointer.owns = manifest.record, manifest.owns
        self.checkpointer.forget = manifest.forget
        for name in (CONFIG_FILE, SUMMARY_FILE):
            manifest.record(self.dump_folder / name)
        atomic_write_text(self.dump_folder / CONFIG_FILE, config_to_toml(self.cfg))
        # Files that later appear here (TensorBoard events, graph dumps, profiles) are adopted as ours.
        self._preexisting = {p for d in self._adopted_folders() for p in (self.dump_folder / d).rglob("*")}

    def _adopted_folders(self) -> tuple[str, ...]:
        p = self.cfg.profiling
        return (TB_SUBDIR, "graphs", p.save_traces_folder, p.save_memory_snapshot_folder)

    def _adopt_new_files(self) -> None:
        if self.rank == 0:
            for d in self._adopted_folders():
                self.run_folder.adopt_new_files(self.dump_folder / d, self._preexisting)

    def _resume(self) -> None:
        latest = self.checkpointer.latest_step()
        if latest is None:
            self.checkpointer.refuse_other_format()
            if self.run_folder.holds_started_run():
                # Not "drop --checkpoint.resume": a plain rerun is refused too, and would send the user back here.
                raise UserError(
                    f"checkpoint.resume is set but the run in {self.dump_folder} saved no checkpoint "
                    f"in {self.checkpointer.folder}, so there is nothing to resume; pass "
                    "--job.overwrite true instead of --checkpoint.resume to start it again"
                )
            raise UserError(
                f"checkpoint.resume is set but {self.checkpointer.folder} holds no checkpoint; "
                "drop --checkpoint.resume to start a new run"
            )
        path = self.checkpointer.path(latest)
        state = self.checkpointer.restore(latest, self.model, functools.partial(self._compare_config, path=path))
        # This run's config sets the hyperparameters (a new optimizer.lr takes effect); the checkpoint the state.
        load_optimizer_state(self.optimizer, self.scheduler, state["optimizer"], state["lr_scheduler"])
        resync_lr(self.scheduler)
        self.dataloader.load_state_dict(state["data"])
        restore_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        logger.info(f"resumed from {self.checkpointer.path(latest)} at step {self.step}")
        if self.cfg.checkpoint.initial_load_path:
            logger.info(f"checkpoint.initial_load_path {self.cfg.checkpoint.initial_load_path} not read: a resume wins")

    def _compare_config(self, state: dict[str, Any], path: Path) -> None:
        """Log each honoured change of options against the checkpoint's config; UserError for a refused one."""
        if "config" not in state:
            logger.warning(
                f"{path} stores no config (written by an older version): changed options cannot be "
                "checked against it; resume with the options it was written with"
            )
            return
        for change in compare_on_resume(state["config"], self.cfg, path, reshardable=self.checkpointer.reshardable):
            logger.info(f"resume: {change}")

    def _state(self) -> dict[str, Any]:
        # Without FSDP, saved by rank 0 only: weights are replicated, and every rank has taken the same number
        # of batches, so rank 0's data state is every rank's (it holds, or implies, each rank's position).
        # With FSDP every rank saves its own (see graph_trainer.checkpoint.sharded).
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.dataloader.state_dict(),
            "rng": capture_rng_state(self.device),
            "step": self.step,
            "config": stored_config(self.cfg),
        }

    def _live_tensors(self, batch: Any) -> list[torch.Tensor]:
        """Tensors alive when a step starts: what the CPU memory figure counts besides the step's own."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *batch.values(), *state, *self.step_fn.held_tensors()]

    def train_step(self, batch: dict[str, torch.Tensor], *, record_ops: bool = False) -> dict[str, Any]:
        """One optimizer step on `batch`; returns the step's metrics record. `record_ops`: keep the live bytes
        after every op (`self.memory.last_ops`) for the memory timeline."""
        lr = self.optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        self.steps_run += 1
        with self.memory.measure_step(self._live_tensors(batch), record_ops=record_ops) as mem:
            with cli_trace_errors():
                loss, grad_norm = self.step_fn(batch)  # the optimizer update included
        self.scheduler.step()
        # The logged loss is the mean over ranks (equal-sized local batches), all-reduced outside the graph.
        loss_value = self.mesh.loss_average(loss).item()  # syncs the device, so the step time below is real
        step_time = time.perf_counter() - start
        tokens = batch["input"].numel() * self.mesh.data_size  # tensor-parallel peers share their batch
        record = {
            "loss": loss_value,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time,
            "tflops": self.flops_per_token * tokens / step_time / 1e12,
            **mem.as_record(),
        }
        if self.peak_flops:
            record["mfu_pct"] = 100 * record["tflops"] * 1e12 / (self.peak_flops * self.world_size)
        if self.cfg.data.source == CHAT_SOURCE:  # masked labels: the share of this rank's labels the loss counts
            record["counted_fraction"] = (batch["labels"] != IGNORE_INDEX).float().mean().item()
        if self.step_metrics is not None:
            record.update(self.step_metrics(self.model))
        record.update(self.parallel.step_metrics())  # its own figures (expert parallelism's dropped rows)
        report = self.step_fn.report()
        record.update(report.as_record())
        if isinstance(self.preflight, StagePlan) and self.steps_run > 1:
            # A pipeline stage's step has no graph estimate of its own: its preflight planned it, a step after the
            # first (which makes torch's receive buffers and prunes the other stages' state).
            record["estimated_peak_bytes"] = self.preflight.peak_bytes
        if report.cuda_graphs and "peak_reserved_bytes" in record:
            # A CUDA-graph replay uses its private pool without allocator calls, so the active
            # peak can miss it; the reserved peak includes the pool: report that upper bound.
            record["peak_active_bytes"] = record["peak_reserved_bytes"]
        if "estimated_peak_bytes" in record and record.get("peak_active_bytes"):
            # (estimate - measured) / measured: 0 on CPU; on CUDA the allocator's active peak.
            record["estimate_error_pct"] = (
                100 * (record["estimated_peak_bytes"] - record["peak_active_bytes"]) / record["peak_active_bytes"]
            )
        return record

    def train(self) -> TrainResult:
        """Run the loop to `training.steps`; checkpoints and logs. The dump folder's lock is released at the end.

        Raises TrainingDiverged when the run blows up (see `graph_trainer.observability.divergence`;
        nothing is saved for that step), `Interrupted` after SIGINT/SIGTERM, once
        the current step finished and (with checkpointing) was saved, and `WriteFailed` when a
        write failed (a full disk): on every rank, with summary.json's status `write_failed`.
        """
        try:
            return self._train()
        finally:
            self._release_run_folder()

    def _train(self) -> TrainResult:
        cfg = self.cfg
        losses, records = [], []
        if self.already_complete:
            logger.info(
                f"the run in {self.dump_folder} is already complete: its checkpoint is at step {self.step} "
                f"and training.steps is {cfg.training.steps}; nothing to do (raise --training.steps "
                "to train further)"
            )
            result = self._result(losses, records)
            self._write_together(self._complete_final_record, result)
            return result
        wall_start = time.perf_counter()
        metrics = MetricsLogger(
            self.dump_folder,
            enable_tensorboard=cfg.metrics.enable_tensorboard,
            log_freq=cfg.metrics.log_freq,
            total_steps=cfg.training.steps,
            rank=self.rank,
            config_toml=config_to_toml(cfg),
        )
        # Sharded parameters: each rank sees part of the norm; the ranks must stop (or save) together.
        guard = DivergenceGuard(self.parallel.shard_sum())
        guard.start(self.model.parameters(), self.step)
        p = cfg.profiling
        self.profiler = StepProfiler(
            self.dump_folder,
            enable_profiling=p.enable_profiling,
            traces_folder=p.save_traces_folder,
            profile_freq=p.profile_freq,
            enable_memory_snapshot=p.enable_memory_snapshot,
            snapshot_folder=p.save_memory_snapshot_folder,
            rank=self.rank,
            device=self.device,
        )
        try:
            with metrics, self._adopting_files(), self.profiler, StopRequest() as stop:
                result = self._loop(metrics, guard, stop, losses, records)
                self._write_together(metrics.set_final, self._final_ok(result, wall_start))
        except WriteError as e:
            raise WriteFailed(self._write_failed(e, metrics)) from None
        logger.info(self._results_line())
        return result

    def _loop(
        self,
        metrics: MetricsLogger,
        guard: DivergenceGuard,
        stop: StopRequest,
        losses: list[float],
        records: list[dict[str, Any]],
    ) -> TrainResult:
        """The steps, each logged, checked and (at the interval) saved; returns the result after the last."""
        cfg, group = self.cfg, self.mesh.world_group
        data = iter(self.dataloader)
        while self.step < cfg.training.steps:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in next(data).items()}
            self.profiler.before_step(self.step + 1)
            record = self.train_step(batch, record_ops=self.profiler.wants_timeline(self.step + 1))
            self.step += 1
            losses.append(record["loss"])
            records.append(record)
            self._write_together(self._step_written, metrics, record)  # one collective: did every write succeed?
            if self.validator is not None and self.validator.due(self.step, cfg.training.steps):
                self._write_together(metrics.log_validation, self.step, self.validator.run())
            signum = stop.agreed(group, self.device)  # every rank stops after the same step
            save = cfg.checkpoint.enable and (
                signum is not None or self.step == cfg.training.steps or self.step % cfg.checkpoint.interval == 0
            )
            try:
                # Checked on every rank (the values are replicated or summed), so all ranks stop together.
                guard.check_step(self.step, record["loss"], record["grad_norm"])
                if save:
                    guard.check_before_save(self.step, record["loss"], self.model.parameters())
            except TrainingDiverged as e:
                metrics.set_final({"status": "diverged", "final_step": self.step, "reason": str(e)})
                raise TrainingDiverged(diverged_line(str(e), *self._latest_checkpoint())) from None
            # Every rank builds the state: a data position may gather every rank's (data.hf_datasets).
            state = self._state() if save else None
            if save:  # every rank: the write check is a collective, even where only rank 0 writes the file
                self._write_together(self._save_checkpoint, state, metrics)
            elif len(losses) == 1:
                self._write_together(self._adopt_new_files)  # the first step opened TensorBoard, dumped the graphs
            if signum is not None:
                saved = self.checkpointer.path(self.step) if cfg.checkpoint.enable else None
                message = interrupted_line(signum, self.step, saved, cfg.checkpoint.resume)
                final = {"status": "interrupted", "final_step": self.step, "signal": signal.Signals(signum).name}
                self._write_together(metrics.set_final, {**final, "message": message})
                raise Interrupted(signum, message)
        return self._result(losses, records)

    def _complete_final_record(self, result: TrainResult) -> None:
        """Write the final record of a run killed after its last checkpoint but before it wrote that record
        (rank 0; nothing when summary.json already has it, so a finished run resumed again writes nothing).

        The hash is of the parameters the checkpoint restored; the loss is the last step's, which the summary
        holds since it is written before every checkpoint. No gradient hash: no step ran."""
        if self.rank != 0:
            return
        metrics = MetricsLogger(self.dump_folder, enable_tensorboard=False, log_freq=1, total_steps=self.step)
        final = metrics.previous_final()
        if final.get("status") == "ok" and final.get("final_step") == self.step:
            return
        steps = metrics.logged_steps()
        logger.warning(
            f"summary.json in {self.dump_folder} had no final record (the run was stopped after its last "
            f"checkpoint); written now from the checkpoint of step {self.step}"
        )
        metrics.set_final({
            "status": "ok",
            "final_step": self.step,
            "final_loss": steps[-1]["loss"] if steps and steps[-1]["step"] == self.step else None,
            "params_sha256": result.params_sha256,
            "num_params": self.num_params,
            "completed_on_resume": True,
        })  # fmt: skip

    def _final_ok(self, result: TrainResult, wall_start: float) -> dict[str, Any]:
        return {
            "status": "ok",
            "final_step": self.step,
            "final_loss": result.losses[-1] if result.losses else None,
            "params_sha256": result.params_sha256,
            "grads_sha256": result.grads_sha256,
            "trace_count": result.trace_count,
            "retrace_reasons": self.step_fn.report().retrace_reasons,
            "num_params": self.num_params,
            "wall_time_s": time.perf_counter() - wall_start,
        }

    def _step_written(self, metrics: MetricsLogger, record: dict[str, Any]) -> None:
        """After a step: its metrics (rank 0), its profiler trace and memory snapshot or CPU memory timeline
        (every rank its own, when the step is profiled)."""
        self.profiler.after_step(self.step)  # first: the trace ends with the step, before the logging
        metrics.log_step(self.step, record)
        if self.memory.last_ops is not None:
            folder = self.profiler.timeline_folder(self.step)
            nodes, ops = self.step_fn.graph_nodes(), self.memory.last_ops
            _, png = write_timeline(folder, self.step, self.rank, nodes, ops, self._outside_graph_bytes())
            logger.info(f"memory timeline of step {self.step}: {png} (and .json)")

    def _outside_graph_bytes(self) -> int:
        """Bytes the step's measurement counts (`_live_tensors`) that are no input of its graph: the AdamW
        state, when the update runs after the graph instead of in it."""
        if self.step_fn.report().updates_inside:
            return 0
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in state}.values())

    def _save_checkpoint(self, state: dict[str, Any], metrics: MetricsLogger) -> None:
        # The summary first: a run killed after this checkpoint resumes after it, so the summary must already hold
        # every step up to it, which log_freq alone does not write.
        metrics.write_summary()
        if self.checkpointer.enable:  # one file written by rank 0, or every rank's shards (DCP)
            self.checkpointer.save(self.step, state)
        self._adopt_new_files()

    def _write_together(self, write: Callable[..., Any], *args: Any) -> None:
        """Run `write` (rank 0's files, or every rank's); when it failed on any rank, raise `WriteError` on every
        rank (one collective), so that no rank walks alone into the next step's collectives."""
        failure: WriteError | None = None
        try:
            write(*args)
        except WriteError as e:
            failure = e
        failed_rank = self.mesh.max_over_ranks(self.rank if failure is not None else -1)
        if failed_rank >= 0:
            raise failure or WriteError(self.dump_folder, OSError(f"rank {failed_rank} could not write; it says why"))

    def _write_failed(self, error: WriteError, metrics: MetricsLogger | None) -> str:
        """The one line for a run stopped by a failed write, after marking summary.json (see `__main__`)."""
        message = write_failed_line(error, self.step, kept_line(*self._latest_checkpoint()))
        final = {"status": "write_failed", "final_step": self.step, "path": str(error.path), "message": message}
        metrics = metrics or self._summary_at_start()
        second = metrics.record_failure(final) if metrics is not None else None
        if metrics is None or second is not None:
            why = f" ({second.strerror or second.cause})" if second is not None else ": the manifest could not own it"
            message += f"; {SUMMARY_FILE} could not record this either{why}"
        return message

    def _summary_at_start(self) -> MetricsLogger | None:
        """summary.json for a run that failed before its first step, if the manifest owns it (an unrecorded one
        would block the rerun as a stranger's file)."""
        manifest = getattr(self.run_folder, "manifest", None)
        if self.rank == 0 and (manifest is None or not manifest.owns(self.dump_folder / SUMMARY_FILE)):
            return None
        return MetricsLogger(
            self.dump_folder,
            enable_tensorboard=False,
            log_freq=1,
            total_steps=self.cfg.training.steps,
            rank=self.rank,
            config_toml=config_to_toml(self.cfg),
        )

    def _latest_checkpoint(self) -> tuple[Path | None, int | None]:
        """(path, step) of the latest checkpoint this run can continue from, or (None, None)."""
        latest = self.checkpointer.latest_step() if self.cfg.checkpoint.enable else None
        return (None, None) if latest is None else (self.checkpointer.path(latest), latest)

    def _result(self, losses: list[float], records: list[dict[str, Any]]) -> TrainResult:
        return TrainResult(
            losses=losses,
            final_step=self.step,
            params_sha256=tensors_digest(self.model.state_dict(keep_vars=False)),
            grads_sha256=tensors_digest({n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}),
            trace_count=self.step_fn.report().trace_count or 0,
            records=records,
        )

    @contextlib.contextmanager
    def _adopting_files(self):
        """Record the files the run wrote under tb/ and graphs/ in the manifest, however the loop ends."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(WriteError):  # the run is already failing: a second failed write must not hide it
                self._adopt_new_files()
            raise
        self._adopt_new_files()

    def _results_line(self) -> str:
        latest, _ = self._latest_checkpoint()
        return (
            f"results in {self.dump_folder}: {SUMMARY_FILE}, {CONFIG_FILE}"
            + (f", {TB_SUBDIR}/" if self.cfg.metrics.enable_tensorboard else "")
            + (f", checkpoint {latest}" if latest is not None else "")
        )
