"""A tiny model file that misbehaves on request (tests/test_contract.py, test_signals.py,
test_nonfinite.py, test_validation.py, test_fuzz.py):
MEMPLAN_TEST_MISBEHAVE names what it does — exit at import or in build_model, print,
raise, return meta tensors or NaN losses. ``raise:CLASS:WHERE`` raises memplan's error class
CLASS (``Forged`` is a MemplanError subclass with ``exit_code = 0``) from WHERE: ``import``,
``build``, ``batch``, ``loss`` or ``forward``. Unset, it is a well-behaved two-block MLP.
MEMPLAN_TEST_STEP_MARKS names a folder where every process running a training loss leaves a
file named by its pid, one line per call (so a test knows the ranks are training, and for how
many micro-steps)."""

import os
import sys

import torch
from torch import nn

MODE = os.environ.get("MEMPLAN_TEST_MISBEHAVE", "")
D = 8

if MODE.startswith("raise:"):
    from memplan import errors

    class Forged(errors.MemplanError):
        exit_code = 0

    _, RAISE_CLASS, RAISE_WHERE = MODE.split(":")
else:
    RAISE_CLASS = RAISE_WHERE = ""


def maybe_raise(where: str) -> None:
    if where != RAISE_WHERE:
        return
    if RAISE_CLASS == "Forged":
        raise Forged("forged: exit 0")
    cls = getattr(errors, RAISE_CLASS)
    if cls is errors.Interrupted:
        raise cls(15)
    raise cls(f"{RAISE_CLASS} raised by the model file in {where}")


maybe_raise("import")
if MODE == "import_sys_exit_0":
    sys.exit(0)
if MODE == "import_sys_exit_3":
    sys.exit(3)
if MODE == "import_os_exit_0":
    os._exit(0)
if MODE in ("print", "print_everywhere"):
    print("hello from the model file at import")


BLOCKS: list[nn.Module] = []


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if MODE == "print_everywhere":
            print("forward says hi")
        maybe_raise("forward")
        h = torch.relu(self.lin(x))
        if MODE == "nan_in_block_1_at_1" and x.shape[0] == 1 and self is BLOCKS[1]:
            h = h / h.std(0)  # the unbiased std of one sample is NaN
        return h


def build_model() -> nn.Module:
    if MODE == "build_sys_exit_0":
        sys.exit(0)
    if MODE == "build_os_exit_0":
        os._exit(0)
    maybe_raise("build")
    if MODE == "build_raise":
        raise RuntimeError("boom")
    torch.manual_seed(0)
    BLOCKS[:] = [Block(), Block()]
    return nn.Sequential(*BLOCKS)


def make_batch(batch_size: int):
    maybe_raise("batch")
    if MODE == "meta_batch":
        return torch.randn(batch_size, D, device="meta")
    if MODE == "print_everywhere":
        print("make_batch says hi")
    return torch.randn(batch_size, D)


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    marks = os.environ.get("MEMPLAN_TEST_STEP_MARKS")
    if marks:
        with open(os.path.join(marks, str(os.getpid())), "a") as f:
            f.write("step\n")
    maybe_raise("loss")
    if MODE == "loss_posix_exit_0":  # os._exit under its own module's name
        import posix

        posix._exit(0)
    out = model(batch)
    if MODE == "nan_loss_at_1" and batch.shape[0] == 1:
        # statistics over a batch of one: the unbiased std of one sample is NaN
        out = (out - out.mean(0)) / out.std(0)
    loss = out.square().mean()
    if MODE == "nan_grad_at_1" and batch.shape[0] == 1:
        # a finite loss (sqrt(0) = 0) whose gradient is NaN (d sqrt at 0 is inf, times 0)
        loss = loss + torch.sqrt((out * 0.0).sum())
    return loss
