"""What one layer's attention holds for its backward, against the sequence length, and the document mask's share.

Read from the attention op itself: the job's model runs forward on fake tensors (no memory, no FLOPs) and the first
attention op that dispatches (`tracer.graph_utils.is_attention`: the SDPA kernel the device picks) is recorded. Its
backward keeps its query, key and value inputs and its outputs (the output and the log-sum-exp): all linear in
the sequence length. With `data.document_masking` the op also takes the additive [B, 1, S, S] document mask, built
once per step and shared by every layer and head: quadratic in the sequence length, but held once, not per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

from graph_trainer.builder import Job
from graph_trainer.plan.eager_baseline import materialize_fake
from graph_trainer.plan.step_plan import batch_names
from graph_trainer.tracer.graph_utils import is_attention


@dataclasses.dataclass(frozen=True)
class AttentionMemory:
    """One rank's attention bytes at one sequence length."""

    seq_len: int
    per_layer_bytes: int  # q, k, v and the op's outputs: what each layer's attention keeps for its backward
    mask_bytes: int  # the document mask, once for every layer (0 without data.document_masking)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_iter(tensors) if isinstance(t, torch.Tensor))


class _FirstAttention(TorchDispatchMode):
    """Records the first attention op's (q, k, v) + outputs bytes and its other tensor inputs' (the mask)."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.seen: AttentionMemory | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.seen is None and is_attention(func):
            qkv, rest = args[:3], (args[3:], kwargs)
            self.seen = AttentionMemory(self.seq_len, _bytes(qkv) + _bytes(out), _bytes(rest))
        return out


def attention_memory(job: Job, seq_lens: list[int]) -> list[AttentionMemory]:
    """`job`'s attention bytes per layer (and its document mask's) at each of `seq_lens` and its local batch, from
    forwards of its loss on fake tensors; empty when the model runs no attention op the planner knows.

    The job's (meta) model is given fake tensors in place: pass a job built for this (`build_job(materialize=False)`).
    """
    cfg, device = job.cfg, job.device
    found = []
    with FakeTensorMode(), torch.no_grad():
        materialize_fake(job.model, device)
        for seq_len in seq_lens:
            shape = (cfg.training.local_batch_size, seq_len)
            batch = {name: torch.zeros(shape, dtype=torch.long, device=device) for name in batch_names(cfg)}
            recorder = _FirstAttention(seq_len)
            with recorder:
                job.loss_fn(job.model, batch)
            if recorder.seen is None:
                return []
            found.append(recorder.seen)
    return found
