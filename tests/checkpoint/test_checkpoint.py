"""Checkpoint component: atomic save, pruning, weights_only resume, mismatch errors, RNG restore."""

from __future__ import annotations

import random

import pytest
import torch

from graph_trainer.checkpoint.single_file import (
    CheckpointManager,
    capture_rng_state,
    check_compatible,
    load_model_state,
    restore_rng_state,
)
from graph_trainer.errors import UserError
from graph_trainer.runtime.fsutil import atomic_write_text


def _tiny_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _train_step(model, opt, sched) -> torch.Tensor:
    x = torch.randn(5, 8)
    y = torch.randint(0, 4, (5,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def _state(model, opt, sched, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "data": {"position": 1234, "epoch": 0, "source": "embedded"},
        "rng": capture_rng_state("cpu"),
        "step": step,
    }


def _assert_same(a, b, where="") -> None:
    """Deep equality; tensors must be torch.equal with the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_weights_only_round_trip_and_resume_is_bitwise(tmp_path):
    model, opt, sched = _tiny_setup()
    for _ in range(3):
        _train_step(model, opt, sched)
    state = _state(model, opt, sched, step=3)
    mgr = CheckpointManager(tmp_path / "ckpt", enable=True, interval=1, keep_latest_k=0)
    path = mgr.save(3, state)
    assert path.name == "step-00000003.pt"
    # The file itself must load with the strict unpickler.
    loaded = torch.load(path, weights_only=True)
    _assert_same(state, loaded)
    assert mgr.latest_step() == 3
    _assert_same(state, mgr.load())

    # Uninterrupted continuation.
    expected = [_train_step(model, opt, sched) for _ in range(3)]

    # Resume into fresh objects (different init) and continue: bitwise the same losses and weights.
    model2, opt2, sched2 = _tiny_setup(seed=123)
    ckpt = mgr.load(3)
    load_model_state(model2, ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    sched2.load_state_dict(ckpt["lr_scheduler"])
    restore_rng_state(ckpt["rng"])
    resumed = [_train_step(model2, opt2, sched2) for _ in range(3)]
    for a, b in zip(expected, resumed, strict=True):
        assert torch.equal(a, b)
    for (k, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2), k


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _tiny_setup()
    mgr = CheckpointManager(tmp_path, enable=True, interval=1, keep_latest_k=2)
    good = _state(model, opt, sched, step=1)
    mgr.save(1, good)

    def torn_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        mgr.save(2, _state(model, opt, sched, step=2))
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt"]  # no torn step-2, no temp file
    assert mgr.latest_step() == 1
    _assert_same(good, mgr.load())


def test_keep_latest_k_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, enable=True, interval=2, keep_latest_k=2)
    for step in (2, 4, 6, 8):
        mgr.save(step, {"step": step, "w": torch.full((2,), float(step))})
    assert mgr.saved_steps() == [6, 8]
    assert mgr.load()["step"] == 8
    assert torch.equal(mgr.load(6)["w"], torch.full((2,), 6.0))


def test_stale_temp_file_is_ignored_and_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, enable=True, interval=1, keep_latest_k=0)
    (tmp_path / ".step-00000009.pt.abc.tmp").write_bytes(b"left by a kill -9")
    assert mgr.latest_step() is None
    mgr.save(1, {"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt"]


def test_should_save():
    mgr = CheckpointManager("unused", enable=True, interval=5, keep_latest_k=1)
    assert [s for s in range(1, 13) if mgr.should_save(s, last_step=s == 12)] == [5, 10, 12]
    off = CheckpointManager("unused", enable=False, interval=5, keep_latest_k=1)
    assert not off.should_save(5, last_step=True)


def test_load_errors_are_user_errors(tmp_path):
    mgr = CheckpointManager(tmp_path, enable=True, interval=1, keep_latest_k=0)
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        mgr.load()
    mgr.save(1, {"step": 1})
    with pytest.raises(UserError, match=r"no checkpoint for step 7 .*saved steps: \[1\]"):
        mgr.load(7)
    mgr.path(2).write_bytes(b"not a zip file")
    with pytest.raises(UserError, match="cannot be read"):
        mgr.load(2)


def test_save_refuses_state_weights_only_cannot_load(tmp_path):
    mgr = CheckpointManager(tmp_path, enable=True, interval=1, keep_latest_k=0)
    with pytest.raises(TypeError, match=r"'data\.sampler' is a object"):
        mgr.save(1, {"data": {"sampler": object()}})
    assert mgr.saved_steps() == []


def test_mismatch_names_first_tensor_before_loading():
    big = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    small = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    before = {k: v.clone() for k, v in big.state_dict().items()}
    with pytest.raises(UserError) as err:
        load_model_state(big, small.state_dict())
    assert str(err.value) == (
        "checkpoint tensor '0.weight' has shape (256, 256) but the model expects (512, 512); "
        "resume with the model config the checkpoint was written with, or start a new job.dump_folder"
    )
    for k, v in big.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k])

    model_sd = big.state_dict()
    missing = {k: v for k, v in model_sd.items() if k != "0.bias"}
    with pytest.raises(UserError, match="checkpoint has no tensor '0.bias'"):
        check_compatible(model_sd, missing)
    extra = {**model_sd, "2.weight": torch.zeros(1)}
    with pytest.raises(UserError, match="checkpoint tensor '2.weight' is not in the model"):
        check_compatible(model_sd, extra)
    wrong_dtype = {**model_sd, "1.weight": model_sd["1.weight"].to(torch.bfloat16)}
    with pytest.raises(UserError, match="'1.weight' has dtype torch.bfloat16 but the model expects torch.float32"):
        check_compatible(model_sd, wrong_dtype)
    check_compatible(model_sd, model_sd)


def test_rng_restore_reproduces_random_numbers(tmp_path):
    random.seed(7)
    torch.manual_seed(7)
    random.gauss(0, 1)  # leaves a cached gauss_next in the Python state
    state = capture_rng_state("cpu")
    mgr = CheckpointManager(tmp_path, enable=True, interval=1, keep_latest_k=0)
    mgr.save(1, {"rng": state})
    expected = ([random.random() for _ in range(5)], random.gauss(0, 1), torch.randn(10))

    random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(mgr.load()["rng"])
    got = ([random.random() for _ in range(5)], random.gauss(0, 1), torch.randn(10))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])
    assert state["torch_cpu"].dtype == torch.uint8


def test_atomic_write_text_failure_keeps_old_content(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    atomic_write_text(target, '{"v": 1}')

    def fail_replace(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr("graph_trainer.runtime.fsutil.os.replace", fail_replace)
    with pytest.raises(OSError):
        atomic_write_text(target, '{"v": 2}')
    assert target.read_text() == '{"v": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
