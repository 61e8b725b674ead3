"""Command-line entry point: `python -m graph_trainer --config llama3_debug.toml [--section.key VALUE ...]`.

This is the one place where a `UserError` becomes a message and an exit code:
library code raises, `main` reports.
"""

import sys

from graph_trainer.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code (0 ok, 2 user error, 130 interrupted)."""
    from graph_trainer.cli import help_text, load_config
    from graph_trainer.config_load import config_to_toml

    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, opts = load_config(argv)
        if opts.help:
            print(help_text(), end="")
            return 0
        if opts.print_config:
            print(config_to_toml(cfg), end="")
            return 0
        # Imported here: the trainer pulls in torch and the models, which --help and config errors don't need.
        if opts.dry_run:
            from graph_trainer.planner import dry_run

            dry_run(cfg)
            return 0
        from graph_trainer.distributed import destroy, init_distributed
        from graph_trainer.trainer import Trainer

        dist = init_distributed(cfg)  # one rank of torchrun's launch, or the only process
        finished = False
        try:
            Trainer(cfg, dist=dist).train()
            finished = True
        finally:
            destroy(dist, wait_for_all=finished)
        return 0
    except UserError as e:
        message = " ".join(str(e).split("\n"))
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
