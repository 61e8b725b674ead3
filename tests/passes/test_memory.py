"""Run-time memory measurement (`graph_trainer.observability.memory`) and the static estimate
(`graph_trainer.tracer.memory_estimate`): the estimate equals the measured peak to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.observability.memory import (
    LiveTensorTracker,
    MemoryMonitor,
    StepMemory,
    cuda_memory_stats,
    reset_peak,
    rss_peak_bytes,
)
from graph_trainer.observability.units import GIB, to_gib
from graph_trainer.tracer.memory_estimate import estimate_peak_memory, saved_tensors

VOCAB, DIM, HEADS = 64, 32, 4


class TinyModel(nn.Module):
    """Embedding, one causal attention (SDPA), a residual and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, HEADS, d // HEADS).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + self.proj(a)
        return self.out(F.gelu(h))


def _batch(b: int = 2, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g)


def _loss_and_grads(model, params, x, y, tag_backward):
    logits = torch.func.functional_call(model, params, (x,))
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    if tag_backward:
        with torch.fx.traceback.annotate({"phase": "backward"}):
            grads = torch.autograd.grad(loss, list(params.values()))
    else:
        grads = torch.autograd.grad(loss, list(params.values()))
    return loss, grads


def _trace(f, *args, tracing_mode: str = "real"):
    """make_fx on fake copies of `args`, as the tracer does; keeps `phase` annotations."""
    with torch.fx.traceback.preserve_node_meta():
        if tracing_mode == "symbolic":
            return make_fx(f, tracing_mode="symbolic")(*args)
        with FakeTensorMode() as fm:
            fake = torch.utils._pytree.tree_map_only(torch.Tensor, fm.from_tensor, args)
            return make_fx(f)(*fake)


def _fwd_bwd_graph(tag_backward: bool = True, tracing_mode: str = "real"):
    torch.manual_seed(0)
    model = TinyModel()
    params = dict(model.named_parameters())
    x, y = _batch()

    def step(p, x, y):
        loss, grads = _loss_and_grads(model, p, x, y, tag_backward)
        return (loss, *grads)

    return _trace(step, params, x, y, tracing_mode=tracing_mode), params, x, y


class _RecordingTracker(LiveTensorTracker):
    """Also records the live bytes right after every op, for op-by-op comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.after_op: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.after_op.append(self.current_bytes)
        return out


def _run_tracked(gm, args, live_inputs, *, grad: bool = False):
    tracker = _RecordingTracker()
    tracker.track_existing(live_inputs)
    with torch.set_grad_enabled(grad), tracker:
        out = gm(*args)
    return tracker, out


def _assert_matches_every_op(gm, est, tracker):
    dispatched = [
        i
        for i, n in enumerate(gm.graph.nodes)
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    ]
    assert len(dispatched) == len(tracker.after_op)
    assert [est.timeline[i] for i in dispatched] == tracker.after_op


# ---------------------------------------------------------------------------
# LiveTensorTracker


def test_tracker_counts_views_once_and_frees():
    base = torch.zeros(256)  # 1 KiB, registered as live
    tracker = LiveTensorTracker()
    tracker.track_existing([base])
    assert tracker.current_bytes == 1024
    with tracker:
        a = base * 2  # +1 KiB
        v = a[10:].view(-1, 2)  # view: nothing new
        base.add_(1)  # in place: nothing new
        del a
        assert tracker.current_bytes == 2048  # the view keeps a's storage alive
        del v
        assert tracker.current_bytes == 1024
        tmp = torch.ones(512)  # factory op: +2 KiB, then freed
        del tmp
    assert tracker.peak_bytes == 1024 + 2048
    tracker.reset()
    assert tracker.peak_bytes == tracker.current_bytes == 1024


def test_tracker_ignores_unregistered_inputs_written_in_place():
    existing = torch.zeros(100)
    with LiveTensorTracker() as tracker:
        existing.mul_(2)
        view = existing[:10]
    assert tracker.peak_bytes == 0
    del view


def _eager_setup(b: int, t: int):
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x, y = _batch(b, t)

    def step():
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    def existing():
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [*model.parameters(), *state, x, y]

    step()  # create the optimizer state
    return model, opt, x, y, step, existing


def _tracked(step, existing) -> LiveTensorTracker:
    """A tracker that saw `step()` run with `existing` registered as live beforehand."""
    tracker = LiveTensorTracker()
    tracker.track_existing(existing)
    with tracker:
        step()
    return tracker


def test_tracker_sees_backward_on_eager_step():
    model, opt, x, y, step, existing = _eager_setup(8, 64)
    tracker = LiveTensorTracker()
    tracker.track_existing(existing())
    with tracker:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fwd_peak = tracker.peak_bytes
        tracker.reset()
        loss.backward()
        bwd_peak = tracker.peak_bytes
        del loss
        opt.step()
        opt.zero_grad()
    # The backward's own allocations (grads of activations) push the peak past the forward's.
    assert bwd_peak > fwd_peak
    # Afterwards only params, optimizer state and batch remain (grads were zeroed to None).
    assert tracker.current_bytes == sum(t.untyped_storage().nbytes() for t in existing())


def test_tracker_equals_memtracker_on_eager_step():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model, opt, x, y, step, existing = _eager_setup(8, 64)
    tracker = _tracked(step, existing())
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt, x, y)
    with mt:
        step()
    assert tracker.peak_bytes == mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_tracker_equals_profiler_on_eager_step():
    """The profiler sees the CPU allocator itself: an independent measurement."""
    model, opt, x, y, step, existing = _eager_setup(8, 64)
    tracker = _tracked(step, existing())
    growth = tracker.peak_bytes - tracker.current_bytes  # bytes above what lives before/after the step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    assert live == 0
    assert peak == growth


# ---------------------------------------------------------------------------
# Static estimate == measured, to the byte


def test_estimate_equals_tracker_on_fwd_bwd_graph():
    gm, params, x, y = _fwd_bwd_graph()
    est = estimate_peak_memory(gm)
    tracker, out = _run_tracked(gm, (params, x, y), [*params.values(), x, y])
    assert est.peak_bytes == tracker.peak_bytes
    _assert_matches_every_op(gm, est, tracker)
    assert est.input_bytes == sum(p.nbytes for p in params.values()) + x.nbytes + y.nbytes
    assert sum(est.peak_bytes_by_category.values()) == est.peak_bytes
    # Outputs stay live to the end: the last entry holds inputs + loss + all grads.
    assert est.timeline[-1] == est.input_bytes + sum(t.nbytes for t in out)


def test_estimate_equals_tracker_on_symbolic_trace():
    gm, params, x, y = _fwd_bwd_graph(tracing_mode="symbolic")
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes)
    est = estimate_peak_memory(gm)
    tracker, _ = _run_tracked(gm, (params, x, y), [*params.values(), x, y])
    assert est.peak_bytes == tracker.peak_bytes


def test_estimate_equals_tracker_with_inplace_optimizer():
    """Forward + backward + a hand-written AdamW that updates params and state in place."""
    torch.manual_seed(0)
    model = TinyModel()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    exp_avg = {k: torch.zeros_like(v) for k, v in params.items()}
    exp_avg_sq = {k: torch.zeros_like(v) for k, v in params.items()}
    x, y = _batch()

    def step(p, m, v, x, y):
        loss, grads = _loss_and_grads(model, p, x, y, tag_backward=True)
        with torch.no_grad():
            for (k, w), g in zip(p.items(), grads, strict=True):
                w.mul_(1 - 1e-3 * 0.1)
                m[k].lerp_(g, 0.1)
                v[k].mul_(0.999).addcmul_(g, g, value=0.001)
                denom = (v[k] / 0.001).sqrt_().add_(1e-8)
                w.addcdiv_(m[k], denom, value=-1e-3 / 0.1)
        return (loss,)

    gm = _trace(step, params, exp_avg, exp_avg_sq, x, y)
    n_inputs = 3 * len(params)
    est = estimate_peak_memory(
        gm,
        input_categories=["parameter"] * len(params) + ["optimizer_state"] * (2 * len(params)) + ["batch"] * 2,
    )
    live = [*params.values(), *exp_avg.values(), *exp_avg_sq.values(), x, y]
    before = [t.clone() for t in params.values()]
    tracker, _ = _run_tracked(gm, (params, exp_avg, exp_avg_sq, x, y), live)
    assert not any(torch.equal(a, b) for a, b in zip(before, params.values(), strict=True))  # really updated in place
    assert est.peak_bytes == tracker.peak_bytes
    _assert_matches_every_op(gm, est, tracker)
    at_peak = est.peak_bytes_by_category
    assert at_peak["parameter"] * 2 == at_peak["optimizer_state"]
    assert at_peak["batch"] == x.nbytes + y.nbytes
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == n_inputs + 2


def test_estimate_equals_tracker_with_view_outputs_tuples_and_dead_values():
    def f(a, b):
        c = a @ b
        top_vals, top_idx = torch.topk(c, 3)  # multi-output op; both used
        mean_only = torch.var_mean(c, dim=0)[1]  # multi-output op; var never read
        unused = c.exp()  # no users: freed right after it is made
        del unused
        big = torch.cat([c, c])  # dies before the return
        s = big.sum(0)
        return c.t(), c[0], a.view(-1), top_vals[:, 0], top_idx, mean_only + s

    a, b = torch.randn(64, 32), torch.randn(32, 48)
    gm = _trace(f, a, b)
    assert any(not n.users and n.op == "call_function" for n in gm.graph.nodes)
    est = estimate_peak_memory(gm)
    tracker, out = _run_tracked(gm, (a, b), [a, b])
    assert est.peak_bytes == tracker.peak_bytes
    _assert_matches_every_op(gm, est, tracker)
    assert out[2].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def test_estimate_equals_tracker_after_remat():
    """Remat copies node meta, so a recomputed node shares its forward twin's fake value."""
    remat_pass = pytest.importorskip(
        "torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass"
    )
    from torch.utils.checkpoint import CheckpointPolicy

    gm, params, x, y = _fwd_bwd_graph()
    recompute = {torch.ops.aten.gelu.default, torch.ops.aten.add.Tensor, torch.ops.aten.addmm.default}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("custom", {}).get("phase") != "backward":
            n.meta["recompute"] = (
                CheckpointPolicy.PREFER_RECOMPUTE if n.target in recompute else CheckpointPolicy.MUST_SAVE
            )
            n.meta["ac_graph_id"] = 0
    remat = remat_pass.remat_using_tags_for_fwd_loss_bwd_graph(gm)
    assert any(n.name.endswith("_recomputed") for n in remat.graph.nodes)
    flat = [*params.values(), x, y]
    tracker, _ = _run_tracked(remat, flat, flat)
    est = estimate_peak_memory(remat)
    assert est.peak_bytes == tracker.peak_bytes
    _assert_matches_every_op(remat, est, tracker)


# ---------------------------------------------------------------------------
# Saved tensors, categories, no_grad


def test_saved_tensors_need_phase_tags():
    gm, params, _, _ = _fwd_bwd_graph(tag_backward=True)
    est = estimate_peak_memory(gm)
    saved = saved_tensors(gm)
    assert est.saved_bytes == sum(s.nbytes for s in saved) > 0
    assert [s.nbytes for s in saved] == sorted((s.nbytes for s in saved), reverse=True)
    assert any("scaled_dot_product" in s.op for s in saved)
    assert all(s.nbytes >= torch.Size(s.shape).numel() * s.dtype.itemsize for s in saved)
    grads = sum(p.nbytes for p in params.values())
    assert est.final_bytes_by_category == {"input": est.input_bytes, "gradient": grads, "output": 4}

    untagged, *_ = _fwd_bwd_graph(tag_backward=False)
    assert estimate_peak_memory(untagged).saved_bytes == 0
    assert saved_tensors(untagged) == []


def test_estimate_rejects_wrong_category_count_and_missing_meta():
    gm, *_ = _fwd_bwd_graph()
    with pytest.raises(ValueError, match="input_categories"):
        estimate_peak_memory(gm, input_categories=["parameter"])
    plain = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="FakeTensorProp"):
        estimate_peak_memory(plain)


def test_no_grad_peak_below_grad_enabled_peak():
    gm, params, x, y = _fwd_bwd_graph()
    live = [*params.values(), x, y]
    no_grad, _ = _run_tracked(gm, (params, x, y), live, grad=False)
    with_grad, out = _run_tracked(gm, (params, x, y), live, grad=True)
    # With grad on, autograd records the traced ops and grad_fn keeps the forward alive.
    assert no_grad.peak_bytes < with_grad.peak_bytes
    assert out[0].grad_fn is not None


# ---------------------------------------------------------------------------
# Front and device helpers


def test_monitor_cpu_tracked_and_untracked():
    model, opt, x, y, step, existing = _eager_setup(2, 16)
    tracker = _tracked(step, existing())

    monitor = MemoryMonitor("cpu", track=True)
    with monitor.measure_step(existing=existing()) as mem:
        step()
    assert isinstance(mem, StepMemory) and monitor.last is mem
    assert mem.peak_active_bytes == mem.peak_reserved_bytes == tracker.peak_bytes
    assert mem.rss_peak_bytes > 0
    assert set(mem.as_record()) == {"peak_active_bytes", "peak_reserved_bytes", "rss_peak_bytes"}

    with MemoryMonitor("cpu", track=False).measure_step() as mem:
        step()
    assert mem.peak_active_bytes is None and mem.peak_reserved_bytes is None
    assert mem.rss_peak_bytes >= rss_peak_bytes() // 2


def test_helpers_off_cuda():
    assert cuda_memory_stats("cpu") == {}
    reset_peak("cpu")  # no-op, no CUDA call
    assert to_gib(GIB * 3) == 3.0 and to_gib(None) is None
    assert rss_peak_bytes() > 10 * 1024 * 1024  # bytes, not KiB: a Python process with torch is > 10 MiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stats_and_monitor():
    dev = torch.device("cuda")
    monitor = MemoryMonitor(dev)
    with monitor.measure_step() as mem:
        t = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device=dev)
        del t
    assert mem.peak_active_bytes >= 64 * 1024 * 1024
    assert mem.peak_reserved_bytes >= mem.peak_active_bytes
    assert mem.num_ooms == 0
    stats = cuda_memory_stats(dev)
    assert set(stats) >= {
        "peak_active_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "num_alloc_retries",
        "num_ooms",
    }


def test_a_storage_whose_last_reference_another_thread_drops_is_counted_as_freed_late():
    """gloo's worker can let go of a collective's buffer after the step's thread: counted, and named as late."""
    import threading

    tracker = LiveTensorTracker()
    with tracker:
        kept, handed_over = torch.empty(100), torch.empty(1000)
    holder = [handed_over]
    del handed_over
    worker = threading.Thread(target=holder.clear)  # the worker thread drops the last reference
    worker.start()
    worker.join()
    assert tracker.late_free_bytes == 4000
    assert tracker.current_bytes == 400 and tracker.peak_bytes == 4400
    del kept  # freed on this thread: not late
    assert tracker.late_free_bytes == 4000 and tracker.current_bytes == 0


def test_clipped_gradients_are_counted_as_gradients():
    """Clipping scales the gradients in place (an optimizer-phase `mul_`), so the graph returns that op's
    result; the storage is still the backward's gradient and must not be counted as an activation."""
    from graph_trainer.tracer import trace_step

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    traced = trace_step(model, {"x": torch.randn(8, 16)}, loss_fn=lambda m, b: m(b["x"]).square().mean(), max_norm=1.0)
    est = estimate_peak_memory(traced.gm)
    assert est.final_bytes_by_category["gradient"] == sum(p.nbytes for p in model.parameters())
