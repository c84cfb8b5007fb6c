"""memplan.run: checkpointing by module name and the accumulation step helper.

Oracles: the same model without checkpointing (gradients must match, dropout included) and
the full batch in one backward (accumulated gradients must match)."""

from __future__ import annotations

import copy
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import memplan
from memplan.errors import BadInputError
from memplan.run import Accumulator, apply, checkpointed_names, move_to_device, remove
from memplan.run.accumulate import samples_in


class Block(nn.Module):
    def __init__(self, width: int, p: float = 0.5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class TinyNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3, p: float = 0.5, batchnorm: bool = False):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width, p) for _ in range(depth))
        if batchnorm:
            self.blocks[1].fc1 = nn.Sequential(
                nn.Linear(width, 2 * width), nn.BatchNorm1d(2 * width)
            )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def fake_plan(k: int, micro: int = 2, precision: str = "fp32", layers=()) -> SimpleNamespace:
    return SimpleNamespace(
        accumulation_steps=k,
        micro_batch_size=micro,
        world_size=1,
        precision=precision,
        checkpoint=dict.fromkeys(layers, "full"),
    )


# --------------------------------------------------------------------------- apply / remove


def test_checkpointed_gradients_match_with_dropout() -> None:
    torch.manual_seed(0)
    plain = TinyNet(p=0.5).double()
    ckpt = copy.deepcopy(plain)
    apply(ckpt, ["blocks.0", "blocks.2"])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    torch.manual_seed(123)
    mse(plain, (x, y)).backward()
    torch.manual_seed(123)
    mse(ckpt, (x, y)).backward()

    expected, got = grads(plain), grads(ckpt)
    assert expected.keys() == got.keys()
    for name in expected:  # same dropout masks in the recompute: identical gradients
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12, msg=name)


def test_checkpoint_really_recomputes_in_training_only() -> None:
    model = TinyNet()
    calls = []
    model.blocks[1].fc1.register_forward_hook(lambda *_: calls.append(1))
    apply(model, ["blocks.1"])
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert len(calls) == 2  # forward + recompute during backward
    calls.clear()
    model.eval()
    model(x).sum().backward()
    assert len(calls) == 1
    calls.clear()
    model.train()
    with torch.no_grad():
        model(x)
    assert len(calls) == 1


def test_names_and_state_dict_unchanged() -> None:
    model = TinyNet()
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    apply(model, ["blocks.0", "blocks.1", "head"])
    assert [n for n, _ in model.named_modules()] == names
    assert list(model.state_dict()) == keys
    model.load_state_dict(TinyNet().state_dict())  # strict load still works


def test_apply_is_idempotent_and_exact() -> None:
    model = TinyNet()
    assert apply(model, ["blocks.0"]) == ["blocks.0"]
    first = model.blocks[0].forward
    apply(model, ["blocks.0"])
    assert checkpointed_names(model) == ["blocks.0"]
    assert model.blocks[0].__dict__["forward"] is first  # the same patch, not a second
    assert "_memplan_saved_forward" in model.blocks[0].__dict__
    # a second plan replaces the first: exactly the named modules are checkpointed
    apply(model, ["blocks.2"])
    assert checkpointed_names(model) == ["blocks.2"]
    assert "forward" not in model.blocks[0].__dict__


def test_apply_accepts_names_and_a_single_name_and_refuses_anything_else() -> None:
    model = TinyNet()
    assert apply(model, ("blocks.1", "blocks.2")) == ["blocks.1", "blocks.2"]
    assert apply(model, "head") == ["head"]
    assert checkpointed_names(model) == ["head"]
    # A plan-shaped object that is not a Plan is not guessed at (apply is typed).
    with pytest.raises(BadInputError, match="needs a memplan Plan"):
        apply(model, fake_plan(1, layers=["blocks.1"]))  # type: ignore[arg-type]
    assert checkpointed_names(model) == ["head"]


def test_remove_restores_original_forward() -> None:
    model = TinyNet()
    x = torch.randn(2, 4)
    model.eval()
    before = model(x)
    apply(model, ["blocks.0", "blocks.1"])
    assert remove(model) == ["blocks.0", "blocks.1"]
    assert checkpointed_names(model) == []
    for block in model.blocks:
        assert "forward" not in block.__dict__
        assert not any(k.startswith("_memplan") for k in block.__dict__)
    torch.testing.assert_close(model(x), before)
    assert remove(model) == []


def test_remove_keeps_a_users_own_instance_forward() -> None:
    model = TinyNet()
    custom = model.head.forward
    model.head.forward = custom
    apply(model, ["head"])
    remove(model)
    assert model.head.__dict__["forward"] is custom


def test_deepcopy_of_applied_model_checkpoints_the_copy() -> None:
    model = TinyNet()
    apply(model, ["blocks.0"])
    clone = copy.deepcopy(model)
    assert clone.blocks[0].forward.__self__ is clone.blocks[0]
    assert checkpointed_names(clone) == ["blocks.0"]
    # the copy runs (an EMA or teacher copy): the patch's "no forward of its own" marker
    # was a bare object(), which deepcopy and pickle duplicated, so the copy called it as its
    # forward ("'object' object is not callable"); a pickled model the same
    twin = pickle.loads(pickle.dumps(model))
    x, y = torch.randn(6, 4), torch.randn(6)
    expected = None
    for net in (model, clone, twin):
        net.eval()  # no dropout: the three give the same gradients
        net.zero_grad()
        mse(net, (x, y)).backward()
        got = grads(net)
        expected = expected or got
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)
    remove(clone)
    assert "forward" not in clone.blocks[0].__dict__ and checkpointed_names(clone) == []


def test_unknown_name_lists_valid_names_closest_first() -> None:
    model = TinyNet()
    with pytest.raises(BadInputError) as info:
        apply(model, ["blocks.0", "block.1"])
    text = str(info.value)
    assert "'block.1'" in text
    assert "Did you mean 'blocks.1'" in text
    listed = text.split("Valid module names (closest first): ")[1]
    assert listed.startswith("blocks.1")
    for name in ("embed", "head", "blocks.2.fc2"):
        assert name in listed
    assert checkpointed_names(model) == []  # nothing applied on error


def test_batchnorm_inside_checkpointed_module_warns() -> None:
    model = TinyNet(batchnorm=True)
    with pytest.warns(UserWarning, match=r"blocks\.1.*BatchNorm"):
        apply(model, ["blocks.0", "blocks.1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply(model, ["blocks.0"])  # no BatchNorm inside: silent


def test_apply_sees_through_wrappers() -> None:
    model = TinyNet()
    wrapped = nn.DataParallel(model)
    apply(wrapped, ["blocks.0"])
    assert checkpointed_names(model) == ["blocks.0"]
    remove(wrapped)
    assert checkpointed_names(model) == []


def test_lazy_exports() -> None:
    assert memplan.apply is apply
    assert memplan.remove is remove
    assert memplan.Accumulator is Accumulator


# --------------------------------------------------------------------------- accumulation


def _data(n: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 4, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_accumulated_gradient_equals_full_batch(checkpoint: bool) -> None:
    torch.manual_seed(0)
    full = TinyNet(p=0.0).double()
    acc_model = copy.deepcopy(full)
    if checkpoint:
        apply(acc_model, ["blocks.0", "blocks.1"])
    x, y = _data(12)
    mse(full, (x, y)).backward()
    expected = grads(full)

    k = 4
    opt = torch.optim.SGD(acc_model.parameters(), lr=0.0)
    seen: dict[str, torch.Tensor] = {}
    real_step = opt.step

    def capture_step(*a, **kw):
        seen.update(grads(acc_model))
        return real_step(*a, **kw)

    opt.step = capture_step
    acc = Accumulator(acc_model, opt, fake_plan(k, micro=3))
    for i in range(k):
        m = acc.step((x[3 * i : 3 * i + 3], y[3 * i : 3 * i + 3]), mse)
        assert m["stepped"] is (i == k - 1)
        assert m["micro_step"] == i + 1
    assert m["effective_batch"] == 12
    assert m["optimizer_steps"] == 1
    for name in expected:
        torch.testing.assert_close(seen[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)
    assert all(p.grad is None for p in acc_model.parameters())  # zero_grad(set_to_none=True)
    loss_full = float(mse(full, (x, y)).detach())
    assert m["loss"] == pytest.approx(loss_full, rel=1e-9)


def test_token_normalisation_matches_full_batch_token_mean() -> None:
    torch.manual_seed(0)
    full = TinyNet(p=0.0).double()
    acc_model = copy.deepcopy(full)
    x, y = _data(10)
    # uneven micro-batches (4 + 6 "tokens"): a per-micro-batch mean would weight them wrongly
    nn.functional.mse_loss(full(x), y, reduction="sum").div(10).backward()
    expected = grads(full)

    def token_loss(model, batch):
        bx, by = batch
        return nn.functional.mse_loss(model(bx), by, reduction="sum"), by.numel()

    opt = torch.optim.SGD(acc_model.parameters(), lr=0.0)
    seen = {}
    real_step = opt.step
    opt.step = lambda *a, **kw: (seen.update(grads(acc_model)), real_step(*a, **kw))[1]
    acc = Accumulator(acc_model, opt, fake_plan(2), normalize="tokens")
    m = acc.accumulate(
        [(x[:4], y[:4]), (x[4:], y[4:])], token_loss, count_tokens=lambda b: b[1].numel()
    )
    assert m["stepped"] and m["tokens"] == 10 and m["effective_batch"] == 10
    for name in expected:
        torch.testing.assert_close(seen[name], expected[name], rtol=1e-10, atol=1e-12)

    # the per-call form, and the errors that protect it
    acc.step((x[:4], y[:4]), token_loss, tokens_in_effective_batch=10)
    assert acc.step((x[4:], y[4:]), token_loss)["stepped"]
    with pytest.raises(BadInputError, match="token count"):
        acc.step((x[:4], y[:4]), token_loss)
    acc.step((x[:4], y[:4]), token_loss, tokens_in_effective_batch=9)
    with pytest.raises(BadInputError, match="reported 10 tokens"):
        acc.step((x[4:], y[4:]), token_loss)
    assert all(p.grad is None for p in acc_model.parameters())


def test_scheduler_steps_once_per_effective_batch() -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt_calls = []
    opt.register_step_post_hook(lambda *_: opt_calls.append(1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    acc = Accumulator(model, opt, fake_plan(3), scheduler=sched)
    x, y = _data(2, torch.float32)
    steps = 4
    for _ in range(steps * 3):
        acc.step((x, y), mse)
    assert sched.last_epoch == steps
    assert len(opt_calls) == steps
    assert acc.optimizer_steps == steps
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / (1 + steps))


def test_clipping_once_per_step_after_last_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **kw):
        calls.append(acc._micro)  # which micro-step we are at when clipping happens
        return real_clip(params, max_norm, *a, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    acc = Accumulator(model, opt, fake_plan(4), max_grad_norm=1e-3)
    x, y = _data(2, torch.float32)
    metrics = [acc.step((x, y), mse) for _ in range(8)]
    assert calls == [4, 4]  # twice in two steps, each after the 4th micro-batch
    assert [("grad_norm" in m) for m in metrics] == [False, False, False, True] * 2
    assert metrics[3]["grad_norm"] > 1e-3


def test_clipping_uses_norm_of_accumulated_gradient() -> None:
    torch.manual_seed(0)
    model = TinyNet(p=0.0)
    ref = copy.deepcopy(model)
    x, y = _data(8, torch.float32)
    mse(ref, (x, y)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt, fake_plan(2), max_grad_norm=0.5)
    acc.step((x[:4], y[:4]), mse)
    m = acc.step((x[4:], y[4:]), mse)
    assert m["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)


def test_bf16_autocast_and_batch_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, fake_plan(1, precision="bf16"))
    dtypes = []

    def loss_fn(m, batch):
        dtypes.append(m.embed(batch["x"]).dtype)
        return {"loss": mse(m, (batch["x"], batch["y"]))}

    x, y = _data(2, torch.float32)
    assert acc.step({"x": x, "y": y}, loss_fn)["stepped"]
    assert dtypes == [torch.bfloat16]
    assert acc.scaler is None  # GradScaler only for fp16 on CUDA


def test_fp16_uses_given_scaler_unscales_before_clipping() -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = []

    class SpyScaler:
        def scale(self, loss):
            order.append("scale")
            return loss * 8.0

        def unscale_(self, optimizer):
            order.append("unscale")
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(8.0)

        def step(self, optimizer):
            order.append("step")
            optimizer.step()

        def update(self):
            order.append("update")

        def get_scale(self):
            return 8.0

    acc = Accumulator(model, opt, fake_plan(2), scaler=SpyScaler(), max_grad_norm=1.0)
    x, y = _data(2, torch.float32)
    acc.step((x, y), mse)
    m = acc.step((x, y), mse)
    assert order == ["scale", "scale", "unscale", "step", "update"]
    assert m["skipped_nonfinite"] is False


def test_no_sync_on_all_but_last_micro_batch() -> None:
    class FakeDDP(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner
            self.syncing = []
            self.in_no_sync = False

        def forward(self, *a):
            return self.module(*a)

        def no_sync(self):
            parent = self

            class _Ctx:
                def __enter__(self):
                    parent.in_no_sync = True

                def __exit__(self, *exc):
                    parent.in_no_sync = False

            return _Ctx()

    model = FakeDDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, fake_plan(3))

    def loss_fn(m, batch):
        m.syncing.append(not m.in_no_sync)
        return mse(m, batch)

    x, y = _data(2, torch.float32)
    for _ in range(6):
        acc.step((x, y), loss_fn)
    assert model.syncing == [False, False, True] * 2


def test_real_ddp_single_rank(tmp_path) -> None:
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        inner = TinyNet(p=0.0).double()
        ref = copy.deepcopy(inner)
        model = nn.parallel.DistributedDataParallel(inner)
        apply(model, ["blocks.1"])
        x, y = _data(8)
        mse(ref, (x, y)).backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        seen = {}
        real_step = opt.step
        opt.step = lambda *a, **kw: (seen.update(grads(inner)), real_step(*a, **kw))[1]
        acc = Accumulator(model, opt, fake_plan(2, micro=4))
        acc.step((x[:4], y[:4]), mse)
        m = acc.step((x[4:], y[4:]), mse)
        assert m["stepped"] and m["effective_batch"] == 8
        for name, g in grads(ref).items():
            torch.testing.assert_close(seen[name], g, rtol=1e-10, atol=1e-12)
    finally:
        dist.destroy_process_group()


def test_accumulate_checks_count_and_mode() -> None:
    model = TinyNet()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), fake_plan(2))
    x, y = _data(2, torch.float32)
    with pytest.raises(BadInputError, match="got 3 micro-batches"):
        acc.accumulate([(x, y)] * 3, mse)
    assert acc.accumulate([(x, y)] * 2, mse)["optimizer_steps"] == 1
    acc.step((x, y), mse)
    with pytest.raises(BadInputError, match="middle of an effective batch"):
        acc.accumulate([(x, y)] * 2, mse)


def test_non_scalar_loss_is_a_clear_error() -> None:
    model = TinyNet()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), fake_plan(1))
    x, y = _data(2, torch.float32)
    with pytest.raises(BadInputError, match=r"scalar loss.*shape \(2,\)"):
        acc.step((x, y), lambda m, b: m(b[0]))
    with pytest.raises(ValueError, match="normalize"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), fake_plan(1), normalize="x")


def test_move_to_device_keeps_structure() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    batch = {
        "t": torch.ones(2),
        "nested": [torch.zeros(1), (torch.ones(1), 3)],
        "p": Pair(torch.ones(1), "s"),
    }
    moved = move_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["nested"], list) and isinstance(moved["nested"][1], tuple)
    assert isinstance(moved["p"], Pair) and moved["p"].b == "s"
    assert samples_in(batch) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_on_cuda_uses_a_grad_scaler_and_matches_fp32_direction() -> None:
    torch.manual_seed(0)
    model = TinyNet(p=0.0).cuda()
    ref = copy.deepcopy(model)
    x, y = (t.cuda() for t in _data(8, torch.float32))
    mse(ref, (x, y)).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = {}
    opt.register_step_pre_hook(lambda *_: seen.update(grads(model)))
    acc = Accumulator(model, opt, fake_plan(2, precision="fp16"), max_grad_norm=1e9)
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    acc.step((x[:4].cpu(), y[:4].cpu()), mse)  # moved to the model's device
    m = acc.step((x[4:], y[4:]), mse)
    assert m["stepped"] and not m["skipped_nonfinite"]
    for name, g in grads(ref).items():  # unscaled before the step: fp32 scale, fp16 accuracy
        torch.testing.assert_close(seen[name], g, rtol=2e-2, atol=2e-3)


def test_a_shared_tensor_first_in_the_batch_does_not_count_as_the_samples():
    """A batch whose first tensor every sample shares (a 5 × 5 mask) counted 5 samples a
    micro-batch; the plan's micro-batch of 3 is what its samples tensor holds."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt, fake_plan(2, micro=3))

    def loss(m, batch):
        return m(batch["x"]).sum() + 0 * batch["mask"].sum()

    for _ in range(2):
        m = acc.step({"mask": torch.zeros(5, 5), "x": torch.ones(3, 4)}, loss)
    assert m["stepped"] and m["effective_batch"] == 6
    # a smaller last micro-batch is still counted by its first tensor
    acc = Accumulator(model, opt, fake_plan(1, micro=3))
    assert (
        acc.step({"x": torch.ones(2, 4), "mask": torch.zeros(5, 5)}, loss)["effective_batch"] == 2
    )
