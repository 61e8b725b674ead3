"""Planning a step before anything is allocated: the per-rank memory plan, the preflight and `--dry-run`."""
