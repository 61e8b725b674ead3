"""DeepSeek-V3 on 2 data-parallel ranks (FSDP, gloo on CPU): the balancing counts are all-reduced in the graph, so
the bias is equal on every rank, and the traced step equals our eager FSDP step bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from graph_trainer.tracer import node_meta
from tests.multiprocess import free_port, spawn_ranks, step_graph_nodes, train_runs
from tests.tiny import DETERMINISTIC, TINY_BATCH

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 2 runs of 3 steps on 2 ranks
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

TINY = ["--config", "deepseek_v3_debug", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"]
TINY += [*TINY_BATCH, *DETERMINISTIC, "--training.steps", "3", "--parallelism.dp_shard", "2"]
RUNS = {"eager": ["--compile.mode", "eager"], "trace": ["--compile.mode", "trace"]}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    for name, trainer, result in train_runs(rank, world, port, RUNS, TINY, out):
        routers = trainer.model.routers()
        record = {
            "losses": result.losses,
            "params": result.params_sha256,
            "bias": [r.expert_bias.tolist() for r in routers],
            "counts": [r.tokens_per_expert.tolist() for r in routers],
            "count_reduces": [
                str(n.target)
                for n in step_graph_nodes(trainer)
                if (node_meta.collective(n) or {}).get("role") == node_meta.EXPERT_COUNT_REDUCE
                and "all_reduce" in str(n.target)
            ],
        }
        Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("moe_dp")
    spawn_ranks(_worker, 2, (2, free_port(), str(folder)), 600)
    return folder


def _record(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def test_bias_is_equal_on_every_rank_and_moved(out):
    for name in RUNS:
        a, b = _record(out, name, 0), _record(out, name, 1)
        assert a["bias"] == b["bias"] and any(v != 0 for layer in a["bias"] for v in layer)
        # the counts the bias moved by are summed over the ranks: equal on both, every (token, choice) of the
        # 2 ranks x 2 x 32 tokens x top-2 counted once
        assert a["counts"] == b["counts"] and sum(a["counts"][0]) == 2 * 2 * 32 * 2


def test_traced_equals_eager_bitwise_on_every_rank_with_one_count_reduce_per_moe_layer(out):
    for rank in (0, 1):
        eager, trace = _record(out, "eager", rank), _record(out, "trace", rank)
        assert trace["losses"] == eager["losses"] and trace["params"] == eager["params"]
        assert len(trace["count_reduces"]) == 1  # the tiny model has one MoE layer (layer 1)
