"""Train your own nn.Module with graph_trainer's traced step.

    python examples/bring_your_own_model.py

A small GPT-style model nobody in graph_trainer wrote: its blocks live in
`blocks`, its embedding is frozen, the whole step (forward, loss, backward,
clipping and the AdamW update) is one graph, and `full` activation
checkpointing recomputes each block's activations in the backward.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.optimizer import GraphAdamW
from graph_trainer.passes import memory_policy_transform
from graph_trainer.tracer import GraphStep


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, n_layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """Forward + loss; everything in here is traced (no .item(), no data-dependent Python branches)."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 256, (4, 33), generator=g)
        yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def build() -> tuple[TinyLM, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TinyLM()
    model.embed.weight.requires_grad_(False)  # frozen: gets no gradient and is never updated
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, adamw


def main() -> None:
    model, adamw = build()
    step = GraphStep(
        model,
        loss_fn=loss_fn,
        max_norm=1.0,
        optimizer=GraphAdamW(adamw),  # the update runs inside the graph
        layers="blocks",  # the container of the transformer blocks
        transform=memory_policy_transform("full"),
    )  # AC: none | selective | full | budget
    for i, batch in enumerate(batches(5)):
        loss, grad_norm = step(batch)
        print(f"step {i + 1}: loss {loss.item():.4f}  grad_norm {grad_norm.item():.4f}")
    plan = step.memory_estimate  # the static estimate of the transformed graph, made before it ran
    print(f"planned peak {plan.peak_bytes / 2**20:.2f} MiB, saved for backward {plan.saved_bytes / 2**20:.2f} MiB")
    print(f"traced {step.stats.count} time(s)")


if __name__ == "__main__":
    main()
