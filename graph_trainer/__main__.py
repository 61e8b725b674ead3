"""Command-line entry point: `python -m graph_trainer --config llama3_debug.toml [--section.key VALUE ...]`.

This is the one place where errors become a message and an exit code: library
code raises, `main` reports. Exit codes:

- 0: done (also a resume of a run that is already complete: nothing is written);
- 2: a mistake in the input (`UserError`): one line naming the cause and the fix;
- 3: training diverged (`TrainingDiverged`): one line naming the last good checkpoint;
- 74: a write failed (`WriteFailed`: a full disk, a quota, an I/O error; 74 is sysexits' EX_IOERR): one line
  naming the folder, the cause and the checkpoint to continue from; nothing half-written is left, and
  `summary.json` records `status = "write_failed"` (or the line says that it could not);
- 130 / 143: stopped by SIGINT / SIGTERM (128 + the signal) after saving, see `graph_trainer.runtime.interrupts`.
"""

import signal
import sys

from graph_trainer.errors import TrainingDiverged, UserError, WriteFailed

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_WRITE_FAILED = 74


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code (see the module doc)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Imported inside the try: torchrun may stop a rank (SIGTERM) while it is still importing, because another
        # rank has already refused a bad launch, and that stop is one line too, not a traceback.
        from graph_trainer.job_config.cli import help_family, help_text, load_config
        from graph_trainer.job_config.load import config_to_toml

        cfg, opts = load_config(argv)
        if opts.help:
            print(help_text(opts.config, help_family(opts)), end="")
            return 0
        if opts.print_config:
            print(config_to_toml(cfg), end="")
            return 0
        # Imported here: the trainer pulls in torch and the models, which --help and config errors don't need.
        if opts.dry_run:
            from graph_trainer.plan.dry_run import dry_run

            dry_run(cfg)
            return 0
        from graph_trainer.distributed.launch import destroy, init_distributed

        # The launch is checked before the trainer's heavy imports, so that a bad launch is refused in seconds. A rank
        # still importing when another has refused it is stopped by torchrun, in one line (see above).
        mesh = init_distributed(cfg)  # one rank of torchrun's launch, or the only process
        from graph_trainer.trainer import Trainer

        finished = False
        try:
            Trainer(cfg, mesh=mesh).train()
            finished = True
        finally:
            destroy(mesh, wait_for_all=finished)
        return 0
    except UserError as e:
        return _report(e, EXIT_USER_ERROR)
    except TrainingDiverged as e:
        return _report(e, EXIT_DIVERGED)
    except WriteFailed as e:
        return _report(e, EXIT_WRITE_FAILED)
    except KeyboardInterrupt as e:  # graph_trainer.runtime.interrupts.Interrupted, or Ctrl-C before the training loop
        from graph_trainer.runtime.interrupts import exit_code

        print(getattr(e, "message", "interrupted"), file=sys.stderr)
        return exit_code(getattr(e, "signum", signal.SIGINT))


def _report(error: Exception, code: int) -> int:
    message = " ".join(str(error).split("\n"))
    # One write, newline included: the ranks of a launch share stderr, and separate writes would interleave.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    from graph_trainer.runtime.interrupts import unwind_on_sigterm

    unwind_on_sigterm()
    sys.exit(main())
