"""Checkpoints and run folders: what a run writes to disk, and how it is read back.

- `single_file`: one `step-*.pt` per checkpoint (one process, or replicated ranks), atomic, `weights_only`.
- `sharded`: one `step-*.dcp` folder per checkpoint, every rank writing its shards through torch's DCP.
- `run_folder`: the dump folder's manifest: which files a run wrote, and what it may remove.
- `export`: a sharded checkpoint's full weights as one file (`python -m graph_trainer.export`).
"""
