"""The caching-allocator simulator (graph_trainer/plan/caching_allocator.py) on hand-built sequences whose
reserved and allocated figures follow from the allocator's rules, and the event stream that feeds it."""

from __future__ import annotations

import torch

from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.memory import ALLOC, FREE, AllocationRecorder, LiveTensorTracker
from graph_trainer.observability.units import MIB
from graph_trainer.optimizer.update_memory import adamw_update_events, eager_step_scratch_bytes
from graph_trainer.plan.allocation_stream import graph_step_stream
from graph_trainer.plan.caching_allocator import replay
from graph_trainer.plan.eager_baseline import eager_whole_step_peak, repeated_steps
from graph_trainer.tracer.memory_estimate import allocation_events, estimate_peak_memory
from tests.passes.test_memory import _fwd_bwd_graph


def _alloc(key, nbytes):
    return (ALLOC, key, nbytes)


def _free(key):
    return (FREE, key, 0)


def test_requests_are_rounded_to_512_bytes_in_a_2_mib_small_segment():
    peaks = replay([_alloc("a", 1), _alloc("b", 1000), _alloc("c", 0)])
    assert peaks.requested_bytes == 1001
    assert peaks.allocated_bytes == 512 + 1024  # 1 -> 512, 1000 -> 1024, 0 bytes -> no block
    assert peaks.reserved_bytes == 2 * MIB and peaks.segments == 1


def test_the_small_pool_reuses_its_segments():
    # Two 1 MiB requests share one 2 MiB segment (the 1 MiB remainder is split off); a third needs another.
    first = [_alloc(i, MIB) for i in range(3)]
    peaks = replay([*first, *(_free(i) for i in range(3)), *(_alloc(("again", i), MIB) for i in range(3))])
    assert peaks.reserved_bytes == 4 * MIB and peaks.segments == 2  # the second round reuses both segments
    assert peaks.allocated_bytes == 3 * MIB


def test_two_8_mib_blocks_share_one_20_mib_segment():
    peaks = replay([_alloc("a", 8 * MIB), _alloc("b", 8 * MIB)])
    assert peaks.reserved_bytes == 20 * MIB and peaks.segments == 1
    assert peaks.allocated_bytes == 16 * MIB
    # The 4 MiB left cannot hold a third: a new 20 MiB segment.
    assert replay([_alloc("a", 8 * MIB), _alloc("b", 8 * MIB), _alloc("c", 8 * MIB)]).reserved_bytes == 40 * MIB


def test_a_large_request_gets_its_own_segment_and_keeps_a_remainder_under_1_mib():
    # 11 MiB + 1 byte: rounded to 11 MiB + 512, in a 12 MiB segment; the remainder (1 MiB - 512) is not split off.
    peaks = replay([_alloc("a", 11 * MIB + 1)])
    assert peaks.reserved_bytes == 12 * MIB
    assert peaks.allocated_bytes == 12 * MIB  # the whole segment is handed out


def test_a_freed_100_mib_block_cannot_serve_150_mib():
    events = [_alloc("a", 100 * MIB), _alloc("b", 100 * MIB), _free("a"), _alloc("c", 150 * MIB)]
    peaks = replay(events)
    assert peaks.reserved_bytes == 350 * MIB  # a's segment stays cached beside c's
    assert peaks.allocated_bytes == 250 * MIB
    # The best fit: of two free blocks that hold a request, the smaller serves it, and no segment is added.
    fits = [_alloc("a", 100 * MIB), _alloc("b", 60 * MIB), _free("a"), _free("b"), _alloc("c", 50 * MIB)]
    fits += [_alloc("d", 100 * MIB)]
    assert replay(fits).reserved_bytes == 160 * MIB


def test_a_freed_block_merges_with_its_free_neighbours():
    # Three 6 MiB blocks split one 20 MiB segment; freeing the first two leaves one free 12 MiB block, which serves
    # an 11 MiB request (a request of 10 MiB or more would otherwise get a 12 MiB segment of its own).
    events = [_alloc(i, 6 * MIB) for i in range(3)] + [_free(1), _free(0), _alloc("big", 11 * MIB)]
    assert replay(events).reserved_bytes == 20 * MIB
    # Freed in the other order, the merge is with the previous block: the same.
    events = [_alloc(i, 6 * MIB) for i in range(3)] + [_free(0), _free(1), _alloc("big", 11 * MIB)]
    assert replay(events).reserved_bytes == 20 * MIB
    # With the middle block still allocated the two free pieces are apart: a new 12 MiB segment.
    events = [_alloc(i, 6 * MIB) for i in range(3)] + [_free(0), _free(2), _alloc("big", 11 * MIB)]
    assert replay(events).reserved_bytes == 32 * MIB


def test_at_the_cap_cached_segments_are_released_and_the_cudamalloc_retried():
    events = [_alloc("a", 60 * MIB), _free("a"), _alloc("b", 80 * MIB)]
    assert replay(events).reserved_bytes == 140 * MIB  # no cap: a's segment stays cached
    capped = replay(events, device_bytes=100 * MIB)
    assert (capped.reserved_bytes, capped.retries, capped.oom) == (80 * MIB, 1, False)
    # A cached segment that is partly in use is not released: out of memory after the retry.
    split = [_alloc("a", 8 * MIB), _alloc("a2", 8 * MIB), _free("a"), _alloc("b", 90 * MIB)]
    oom = replay(split, device_bytes=100 * MIB)
    assert (oom.reserved_bytes, oom.retries, oom.oom) == (20 * MIB, 1, True)


def test_the_recorder_reports_what_the_tracker_does_and_the_order_of_storages():
    x = torch.ones(1000)
    with LiveTensorTracker() as plain:
        y = (x * 2).sum()
        del y
    recorder = AllocationRecorder()
    recorder.track_existing([x])
    with recorder:
        a = x * 2
        b = a + 1
        del a
        c = b.sum()
    assert recorder.peak_bytes == 3 * 4000 and recorder.current_bytes == 4000 + 4000 + 4
    kinds = [(kind, n) for kind, _, n in recorder.events]
    assert kinds == [(ALLOC, 4000), (ALLOC, 4000), (ALLOC, 4000), (FREE, 0), (ALLOC, 4)]
    assert recorder.events[3][1] == recorder.events[1][1]  # the freed storage is a's
    assert replay(recorder.events).requested_bytes == recorder.peak_bytes  # the replay's live peak is the tracker's
    assert plain.peak_bytes == 4000 + 4  # the plain tracker without registered inputs, as before
    del b, c


def test_the_adamw_scratch_events_peak_at_the_modelled_scratch():
    params = [torch.nn.Parameter(torch.ones(n)) for n in (300, 100, 200)]
    for implementation in ("single_tensor", "foreach"):
        optimizer = torch.optim.AdamW(params, foreach=implementation == "foreach")
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        state, scratch = adamw_update_events(optimizer, implementation, torch.device("cpu"))
        assert sum(n for _, _, n in state) == sum(2 * 4 * p.numel() + 4 for p in params)  # exp_avg(_sq), step
        assert replay(scratch).requested_bytes == eager_step_scratch_bytes(optimizer)
        assert replay(scratch).allocated_bytes > 0 and not _alive(scratch)


def test_repeated_steps_free_what_a_step_leaves_and_rerun_it():
    recorded = [_alloc("param", 100), _alloc("grad", 100), _alloc("act", 50), _free("act")]
    events = repeated_steps(recorded, 1, [_alloc("s", 10), _free("s")], steps=2)
    assert _alive(events) == {"param", ("step 2", "grad")}
    assert [k for kind, k, _ in events if kind == FREE] == ["act", "s", "grad", ("step 2", "act"), "s"]


def _alive(events):
    alive = set()
    for kind, key, _ in events:
        (alive.add if kind == ALLOC else alive.discard)(key)
    return alive


def test_the_eager_step_stream_replays_to_the_eager_whole_step_peak():
    """The debug model's eager step with FSDP 2 (planning mesh, fake tensors, bf16 plan) and its AdamW update: the
    replayed stream's live peak is `eager_whole_step_peak`'s to the byte, in both steps, and the allocator holds
    at least that much."""
    args = ["--config", "llama3_debug", "--model.n_layers", "2", "--training.seq_len", "64"]
    cfg, _ = load_config([*args, "--parallelism.dp_shard", "2", "--training.mixed_precision_param", "bfloat16"])
    whole = eager_whole_step_peak(cfg, torch.device("cpu"), record_events=True)
    second = [key for kind, key, _ in whole.events if kind == ALLOC and isinstance(key, tuple) and key[0] == "step 2"]
    assert len(second) == sum(kind == ALLOC for kind, _, _ in whole.step.events[whole.step.step_events_from :]) > 100
    peaks = replay(whole.events)
    assert peaks.requested_bytes == whole.peak_bytes
    assert peaks.reserved_bytes >= peaks.allocated_bytes >= peaks.requested_bytes and not peaks.oom
    assert eager_whole_step_peak(cfg, torch.device("cpu")).events is None  # recorded only when asked


def test_the_graph_stream_is_the_one_a_run_of_the_graph_makes():
    """`allocation_events` of a traced forward-backward graph: the same allocations, in the same order, as the
    recorder sees running it, and the same allocator peaks; its live peak is the estimate's."""
    gm, params, x, y = _fwd_bwd_graph()
    events, inputs = allocation_events(gm)
    recorder = AllocationRecorder()
    recorder.track_existing([*params.values(), x, y])
    with torch.no_grad(), recorder:
        out = gm(params, x, y)
    assert inputs == len(params) + 2
    assert _renamed(events) == _renamed(recorder.events)  # every allocation and free, in the same order
    assert replay(events) == replay(recorder.events)
    assert replay(events).requested_bytes == estimate_peak_memory(gm).peak_bytes
    del out


def _renamed(events):
    """`events` with each key replaced by the rank of its allocation (keys differ between two streams)."""
    names, out = {}, []
    for i, (kind, key, nbytes) in enumerate(events):
        if kind == ALLOC:
            names[key] = i  # a key (a storage address) may come back after its free
        out.append((kind, names[key], nbytes))
    return out


def test_the_traced_step_stream_replays_to_its_plan_peak():
    """The debug model's traced step (FSDP 2 on the planning mesh, the update eager after the graph): the stream of
    its full trace replays to the plan's live peak, update included, in both steps."""
    args = ["--config", "llama3_debug", "--model.n_layers", "2", "--training.seq_len", "64"]
    cfg, _ = load_config([*args, "--parallelism.dp_shard", "2", "--compile.trace_optimizer", "false"])
    plan, events = graph_step_stream(cfg, torch.device("cpu"))
    assert plan.optimizer != "in graph"
    peaks = replay(events)
    assert peaks.requested_bytes == plan.peak_bytes
    assert peaks.reserved_bytes >= peaks.allocated_bytes >= peaks.requested_bytes and not peaks.oom
    assert any(isinstance(key, tuple) and key[0] == "adamw_state" for _, key, _ in events)
