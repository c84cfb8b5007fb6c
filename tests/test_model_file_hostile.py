"""A model file's errors outside its forward are the model file's (exit 2), never a
traceback with exit 1, and meta refuses what cpu refuses: an error raised in the model's
backward (a custom autograd Function's, autograd's check of a tensor changed in place)
names the user's file and line or the op (memplan.probe.session); verify's gradient
check passes a batch's 0-dim and shared tensors whole into each micro-batch and refuses
a batch it cannot cut, naming the tensor (memplan.model.batch.sample_rows); a meta probe
refuses a matmul of mixed dtypes as cpu does (memplan.probe.meta_kernels)."""

from __future__ import annotations

import pytest
import torch
from plan_factory import hand_plan
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ModelFileError
from memplan.model.batch import sample_rows
from memplan.plan import plan_to_yaml

runner = CliRunner()

BAD_BACKWARD = """
import torch, torch.nn as nn, torch.nn.functional as F
class Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        raise ValueError("my backward is broken")
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.fc = nn.Linear(16, 16)
    def forward(s, x):
        return x + Bad.apply(s.fc(x))
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.blocks = nn.ModuleList(Block() for _ in range(2)); s.head = nn.Linear(16, 2)
    def forward(s, x, y):
        for b in s.blocks:
            x = b(x)
        return F.cross_entropy(s.head(x.mean(1)), y)
def build_model():
    torch.manual_seed(0); return M()
def make_batch(n):
    return (torch.randn(n, 4, 16), torch.randint(0, 2, (n,)))
"""
BAD_BACKWARD_LINE = (
    BAD_BACKWARD.splitlines().index('        raise ValueError("my backward is broken")') + 1
)

IN_PLACE = BAD_BACKWARD.replace(
    "return x + Bad.apply(s.fc(x))", "h = F.relu(s.fc(x)); h.mul_(0.5); return x + h"
)

TEMP = """
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.fc = nn.Linear(8, 8); s.head = nn.Linear(8, 2)
    def forward(s, x, y, temp, mix):
        return F.cross_entropy(s.head((mix @ torch.tanh(s.fc(x))).mean(1)) / temp, y)
def build_model():
    torch.manual_seed(0); return M()
def make_batch(n):
    # temp: 0-dim; mix: shared by every sample, its first dimension 4 = the effective batch
    return {"x": torch.randn(n, 4, 8), "y": torch.randint(0, 2, (n,)),
            "temp": torch.tensor(2.0), "mix": torch.eye(4) / 2}
"""

SEQ_FIRST = """
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.fc = nn.Linear(8, 2)
    def forward(s, x, y):
        return F.cross_entropy(s.fc(x).mean(0), y)
def build_model():
    torch.manual_seed(0); return M()
def make_batch(n):
    return {"x": torch.randn(3, n, 8), "y": torch.randint(0, 2, (n,))}
"""

MIXED = """
import torch, torch.nn as nn, torch.nn.functional as F
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    def forward(s, x, y):
        return F.mse_loss(s.blocks(x).float(), y)
def build_model():
    return M()
def make_batch(n):
    return (X, torch.randn(n, 8))
"""
MIXED_LINE = MIXED.splitlines().index("        return F.mse_loss(s.blocks(x).float(), y)") + 1


def _write(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _flat(output: str) -> str:
    return " ".join(output.split())


def _probe(path, device):
    return runner.invoke(
        app,
        [
            "probe",
            str(path),
            "--device",
            device,
            "--micro-batches",
            "1,2",
            "-o",
            str(path.with_suffix(f".{device}.yaml")),
        ],
    )


def _verify(tmp_path, path, **plan):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(plan_to_yaml(hand_plan(str(path), **plan)))
    return runner.invoke(app, ["verify", str(path), str(plan_file), "--steps", "1"])


# ------------------------------------------------------------------ 1: errors in the backward
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_custom_functions_backward_error_is_exit_2_at_its_line(tmp_path, device):
    path = _write(tmp_path, BAD_BACKWARD, "badbackward.py")
    result = _probe(path, device)
    out = _flat(result.output)
    assert result.exit_code == 2, result.output
    assert f"badbackward.py:{BAD_BACKWARD_LINE}: the model's backward raised ValueError" in out
    assert "my backward is broken" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_in_place_change_of_a_saved_tensor_is_exit_2_naming_the_op(tmp_path, device):
    path = _write(tmp_path, IN_PLACE, "inplace.py")
    result = _probe(path, device)
    out = _flat(result.output)
    assert result.exit_code == 2, result.output
    assert "inplace.py: the model's backward raised RuntimeError" in out
    assert "output 0 of Relu" in out and "in-place" in out
    assert "set_detect_anomaly" in out
    assert "Traceback" not in out


def test_verify_reports_an_error_in_the_backward_as_the_model_files(tmp_path):
    path = _write(tmp_path, BAD_BACKWARD, "badbackward.py")
    result = _verify(tmp_path, path, micro=2, k=2)
    assert result.exit_code == 2, result.output
    out = _flat(result.output)
    assert f"badbackward.py:{BAD_BACKWARD_LINE}: the model's backward raised ValueError" in out


def test_measure_training_peak_reports_an_error_in_the_backward(tmp_path):
    from memplan.probe import measure_training_peak

    path = _write(tmp_path, IN_PLACE, "inplace.py")
    with pytest.raises(ModelFileError, match="output 0 of Relu"):
        measure_training_peak(str(path), device="cpu", micro_batch=2)


def test_memplans_own_failure_in_the_backward_stays_exit_3(tmp_path, monkeypatch):
    """The tracker failing on an op of the backward is memplan's (InternalError, exit 3),
    not made the model file's by the backward's wrapping."""
    from memplan.probe import tracker

    account = tracker.LiveTracker._account

    def failing(self, func, *args, **kwargs):
        if "threshold_backward" in str(func):
            raise ValueError("bookkeeping broke")
        return account(self, func, *args, **kwargs)

    monkeypatch.setattr(tracker.LiveTracker, "_account", failing)
    path = _write(tmp_path, IN_PLACE.replace("h.mul_(0.5); ", ""), "relu.py")
    result = _probe(path, "meta")
    assert result.exit_code == 3, result.output
    out = _flat(result.output)
    assert "live tracker" in out and "threshold_backward" in out
    assert "relu.py" not in out.split("failed")[0]  # not reported at the user's line


# ------------------------------------------------------------------ 2: cutting verify's batch
def test_verify_passes_0_dim_and_shared_tensors_whole(tmp_path):
    """A 0-dim temperature, and a matrix every sample shares whose first dimension is the
    effective batch's size (4), go whole into each micro-batch: before, the check sliced
    them (IndexError: slice() cannot be applied to a 0-dim tensor; exit 1)."""
    from memplan.verify import verify_plan

    path = str(_write(tmp_path, TEMP))
    result = verify_plan(path, hand_plan(path, micro=2, k=2), steps=1, device="cpu")
    assert result.gradient_check.status == "pass", result.gradient_check
    assert result.batch_coupling.status == "equivalent", result.batch_coupling


def test_verify_refuses_a_batch_it_cannot_cut_naming_the_tensor(tmp_path):
    path = _write(tmp_path, SEQ_FIRST)
    result = _verify(tmp_path, path, micro=2, k=2)
    assert result.exit_code == 2, result.output
    out = _flat(result.output)
    assert "model.py: make_batch(): batch['x'] has shape (3, 4, 8)" in out
    assert "(3, 2, 8) in the batch of 2" in out
    assert "--no-grad-check" in out
    assert "gradient check:" not in out  # refused before any run


def test_sample_rows_marks_the_tensors_holding_samples_first():
    def batch(n):
        return {"x": torch.zeros(n, 3), "t": torch.tensor(1.0), "m": torch.zeros(4, 4), "k": 1}

    assert sample_rows(batch(4), batch(2), 4, 2) == [True, False, False]
    with pytest.raises(ValueError, match=r"batch\[1\] has shape \(3, 4\)"):
        sample_rows((torch.zeros(4), torch.zeros(3, 4)), (torch.zeros(2), torch.zeros(3, 2)), 4, 2)
    with pytest.raises(ValueError, match="no tensor holds the samples"):
        sample_rows(torch.zeros(5), torch.zeros(5), 4, 2)


# ------------------------------------------------------------------ 3: mixed dtypes on meta
@pytest.mark.parametrize(
    ("x", "dtype"),
    [
        ("torch.randn(n, 8, dtype=torch.float64)", "torch.float64"),
        ("torch.randint(0, 5, (n, 8))", "torch.int64"),
    ],
)
def test_meta_refuses_a_batch_of_another_dtype_as_cpu_does(tmp_path, x, dtype):
    path = _write(tmp_path, MIXED.replace("X", x))
    cpu = _probe(path, "cpu")
    meta = _probe(path, "meta")
    assert cpu.exit_code == 2, cpu.output
    assert meta.exit_code == 2, meta.output
    out = _flat(meta.output)
    assert f"model.py:{MIXED_LINE}: the model's forward raised RuntimeError" in out
    assert (
        f"aten.addmm.default: mat1 and mat2 must have the same dtype, but got {dtype} and torch.float32"
        in out
    )
    assert not path.with_suffix(".meta.yaml").exists()


def test_meta_refuses_mixed_dtypes_of_bmm_as_the_models_error(tmp_path):
    """bmm's meta kernel refuses mixed dtypes itself; that was reported as the meta
    probe's limit (exit 3, "probe with --device cpu"), not the model's error."""
    text = MIXED.replace("s.blocks(x).float()", "(x @ x.transpose(1, 2).float()).mean(-1)")
    path = _write(tmp_path, text.replace("X", "torch.randn(n, 8, 8, dtype=torch.float64)"))
    result = _probe(path, "meta")
    assert result.exit_code == 2, result.output
    assert "aten.bmm.default: batch1 and batch2 must have the same dtype" in _flat(result.output)


def test_the_meta_dtype_check_leaves_float8_and_subclasses_to_their_kernels():
    from memplan.probe.meta_kernels import refuse_mixed_dtypes

    aten = torch.ops.aten
    a = torch.empty(4, 4, device="meta", dtype=torch.float8_e4m3fn)
    b = torch.empty(4, 4, device="meta", dtype=torch.bfloat16)
    refuse_mixed_dtypes(aten.mm.default, (a, b))  # float8: _scaled_mm's business
    refuse_mixed_dtypes(aten.addmm.default, (b.float(), b, b))  # the bias is not checked
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        refuse_mixed_dtypes(aten.mm.default, (b, b.float()))


def test_verify_on_two_ranks_passes_0_dim_and_shared_tensors_whole(tmp_path):
    """The ranks' gradient check sliced every tensor too (verify/distributed_grads.py): a
    0-dim temperature raised IndexError on each rank. They cut as one process does."""
    from memplan.verify.distributed import verify_distributed

    path = str(_write(tmp_path, TEMP))
    plan = hand_plan(path, micro=2, k=2, world_size=2, strategy="ddp")
    result = verify_distributed(path, plan, steps=1, device="cpu", timeout_s=120)
    assert result.gradient_check.status == "pass", result.gradient_check


def test_an_error_in_the_backward_on_two_ranks_is_the_model_files(tmp_path):
    """A rank ran the backward unwrapped: the error came back as memplan's (exit 3)."""
    path = _write(tmp_path, BAD_BACKWARD, "badbackward.py")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(plan_to_yaml(hand_plan(str(path), micro=2, k=1, world_size=2)))
    result = CliRunner().invoke(app, ["verify", str(path), str(plan_file), "--steps", "1"])
    out = _flat(result.output)
    assert result.exit_code == 2, result.output
    assert "the model's backward raised ValueError" in out and "my backward is broken" in out


def test_a_failure_of_torch_distributed_in_the_backward_is_not_the_model_files(tmp_path):
    """A collective or FSDP hook failing inside the backward on a rank (its frames torch's
    distributed code, none the user's) passes unchanged, for the rank's own account
    (exit 3); only the model's code is reported as the model file's."""
    from memplan.probe.session import users_backward

    namespace: dict = {"torch": torch}
    fake = str(tmp_path / "site-packages" / "torch" / "distributed" / "fsdp_hook.py")
    exec(
        compile(
            "class Hook(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x):\n"
            "        return x * 2\n"
            "    @staticmethod\n"
            "    def backward(ctx, g):\n"
            "        raise RuntimeError('gloo: connection closed by peer')\n",
            fake,
            "exec",
        ),
        namespace,
    )
    mf = type("MF", (), {"path": tmp_path / "model.py"})()
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="connection closed by peer"), users_backward(mf):
        namespace["Hook"].apply(x).sum().backward()


def test_the_probe_says_when_it_enters_the_models_backward(tmp_path):
    """check --timeout names where a hung probe was (loader.observe_calls): the backward
    was never announced, so a hang there was named as the forward."""
    from memplan.model.loader import observe_calls
    from memplan.probe import probe_model

    path = str(_write(tmp_path, TEMP))
    seen: list[str] = []
    with observe_calls(seen.append):
        probe_model(path, device="meta", micro_batches=(1, 2))
    forward = seen.index("the model's forward")
    assert "the model's backward" in seen[forward:], seen
