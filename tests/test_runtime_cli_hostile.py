"""Hostile-user findings in the runtime's wrapping (``memplan.run.wrap``), the scripts'
emitters and the command line's streams and signals: ZeRO-1 keeps every parameter group's
options, DDP names the trainable parameters the loss never reaches, the torch scripts refuse
a context-parallel plan, a closed pipe loses neither the plan nor the exit code, and a
signal during an import waits for the import to return."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from plan_factory import hand_plan
from profiles_factory import uniform_chain
from torch import nn

from memplan.emit import emit, emit_all
from memplan.errors import BadInputError
from memplan.parallel import Parallel
from memplan.profile import profile_to_yaml
from memplan.run.wrap import wrap_for_plan

MEMPLAN = [sys.executable, "-m", "memplan.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        if unused:
            self.pooler = nn.Linear(4, 4)  # trainable, never in the loss (BERT's under MLM)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


# ------------------------------------------------------------------ 1: ZeRO-1's groups
def test_zero1_keeps_every_parameter_groups_options(one_rank) -> None:
    torch.manual_seed(0)
    net = Net()

    def make_optimizer(module):
        return torch.optim.AdamW(
            [
                {"params": list(module.head.parameters()), "lr": 0.0, "weight_decay": 0.0},
                {"params": list(module.body.parameters()), "betas": (0.8, 0.9)},
            ],
            lr=1e-2,
            weight_decay=0.05,
        )

    model, optimizer = wrap_for_plan(
        net, hand_plan("m.py", strategy="zero1"), make_optimizer, torch.device("cpu")
    )
    assert type(optimizer).__name__ == "ZeroRedundancyOptimizer"
    groups = optimizer.param_groups
    assert [g["lr"] for g in groups] == [0.0, 1e-2]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.05]
    assert [g["betas"] for g in groups] == [(0.9, 0.999), (0.8, 0.9)]
    assert [len(g["params"]) for g in groups] == [2, 2]
    # the local optimizer steps with them: the head (lr 0) stays, the body moves
    head, body = net.head.weight.detach().clone(), net.body.weight.detach().clone()
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert torch.equal(net.head.weight, head)
    assert not torch.equal(net.body.weight, body)


# ------------------------------------------------------------------ 2: DDP, unused parameters
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_ddp_names_the_trainable_parameters_the_loss_never_reaches(one_rank, strategy) -> None:
    torch.manual_seed(0)
    net = Net(unused=True)
    model, optimizer = wrap_for_plan(
        net,
        hand_plan("m.py", strategy=strategy),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        torch.device("cpu"),
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as the Accumulator does: no gradient left to see
    with pytest.raises(BadInputError) as caught:
        model(torch.randn(3, 4))
    text = str(caught.value)
    assert text.startswith(
        "DDP cannot train this model: the trainable parameters pooler.weight, pooler.bias get "
        "no gradient from training_loss()"
    )
    assert "body" not in text and "head" not in text
    assert "Set requires_grad False on them" in caught.value.hint
    assert "--strategy fsdp" in caught.value.hint
    assert caught.value.exit_code == 2


def test_ddp_of_a_model_whose_loss_reaches_every_parameter_trains(one_rank) -> None:
    net = Net()
    model, optimizer = wrap_for_plan(
        net,
        hand_plan("m.py"),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        torch.device("cpu"),
    )
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert isinstance(model, nn.parallel.DistributedDataParallel)


# ------------------------------------------------------------------ 3: cp > 1, scripts
@pytest.mark.parametrize("fmt", ["torch", "torchrun"])
def test_scripts_refuse_a_context_parallel_plan(fmt) -> None:
    plan = hand_plan("m.py", parallel=Parallel(dp_replicate=2, cp=2), seq_len=64)
    with pytest.raises(BadInputError) as caught:
        emit(plan, fmt)
    assert str(caught.value).startswith(
        f"--format {fmt} cannot write a plan with context parallelism"
    )
    assert caught.value.exit_code == 2
    hint = caught.value.hint
    assert "Formats that write this layout: plan, torchtitan, torchtitan-toml, megatron" in hint
    assert "torchrun" not in hint.split(";")[0]
    # emit_all refuses those two and writes the rest
    done = emit_all(plan, ["plan", "torch", "torchrun", "megatron"])
    assert [f for f, _, _ in done.files] == ["plan", "megatron"]
    assert [f for f, _ in done.refused] == ["torch", "torchrun"]
    # tp and pp stay theirs
    emit(hand_plan("m.py", parallel=Parallel(dp_replicate=2, tp=2)), fmt)


def test_a_data_parallel_format_names_only_the_formats_that_run_a_cp_layout() -> None:
    plan = hand_plan("m.py", parallel=Parallel(dp_replicate=2, cp=2), seq_len=64)
    with pytest.raises(BadInputError) as caught:
        emit(plan, "hf")
    assert caught.value.hint == (
        "Formats that write this layout: plan, torchtitan, torchtitan-toml, megatron."
    )


# ------------------------------------------------------------------ 4: a closed pipe
def test_solve_into_a_closed_pipe_still_writes_the_plan_and_exits_0(tmp_path: Path) -> None:
    profile = tmp_path / "chain.profile.yaml"
    profile.write_text(profile_to_yaml(uniform_chain(2).profile()))
    plan = tmp_path / "plan.yaml"
    read, write = os.pipe()
    os.close(read)  # `| head` that has gone: every write fails with EPIPE
    try:
        done = subprocess.run(
            [
                *MEMPLAN,
                "solve",
                str(profile),
                "--target-batch",
                "8",
                "--budget",
                "8GiB",
                "-o",
                plan,
            ],
            stdout=write,
            stderr=write,
            env=ENV,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 0
    assert plan.read_text().startswith("schema_version: 2\ntarget_batch: 8\n")


@pytest.mark.parametrize(("budget", "code"), [("8GiB", 0), ("1KiB", 1)])
def test_json_into_a_closed_pipe_exits_with_the_commands_code(
    tmp_path: Path, budget: str, code: int
) -> None:
    profile = tmp_path / "chain.profile.yaml"
    profile.write_text(profile_to_yaml(uniform_chain(2).profile()))
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [*MEMPLAN, "solve", str(profile), "--target-batch", "8", "--budget", budget, "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            env=ENV,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == code  # 1: no plan fits, as when the output is read
    assert b"Traceback" not in done.stderr and b"BrokenPipe" not in done.stderr


# ------------------------------------------------------------------ 5: a signal in an import
MODEL = """
import os, signal, pathlib
for _ in range({times}):
    os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode, inside this import
    total = 0
    for i in range(200_000):  # bytecode boundaries: the old handler raised here
        total += i
pathlib.Path({marker!r}).write_text("imported")
import torch
def build_model():
    return torch.nn.Linear(2, 2)
def make_batch(n):
    return {{"x": torch.randn(n, 2)}}
def training_loss(model, batch):
    return model(batch["x"]).sum()
"""


def _probe_sending_itself(tmp_path: Path, times: int) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / "imported.txt"
    model = tmp_path / "selfkill.py"
    model.write_text(textwrap.dedent(MODEL.format(times=times, marker=str(marker))))
    out = tmp_path / "out.yaml"
    done = subprocess.run(
        [*MEMPLAN, "probe", str(model), "--device", "cpu", "-o", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name not in {model.name, marker.name}] == []
    return done, marker


def test_sigterm_during_an_import_waits_for_it_then_exits_143(tmp_path: Path) -> None:
    done, marker = _probe_sending_itself(tmp_path, 1)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert marker.read_text() == "imported"  # the import ran to its end, undisturbed
    assert done.stderr.splitlines()[-1] == "interrupted"
    assert done.stderr.count("interrupted") == 1
    assert "Traceback" not in done.stderr


def test_a_second_sigterm_during_an_import_interrupts_at_once(tmp_path: Path) -> None:
    done, marker = _probe_sending_itself(tmp_path, 2)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert not marker.exists()  # a hung import stays interruptible
    assert done.stderr.splitlines()[-1] == "interrupted"
    assert "Traceback" not in done.stderr
