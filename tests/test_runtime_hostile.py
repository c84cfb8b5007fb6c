"""Hostile-user cases of memplan's parallel runtime (memplan.run.parallel, memplan.run.wrap),
the code ``memplan verify`` and the emitted scripts run, on 2 CPU gloo ranks:

* tensor + sequence parallel with no data-parallel ranks (``--world-size 2 --tp 2
  --sequence-parallel``, what ``--layout auto`` picks on 2 ranks): each norm's weight is
  replicated but each rank sees half the sequence, so autograd leaves its gradient a partial
  sum over the TP ranks; nothing reduced it (no DDP/FSDP to do it), and the gradient check
  read one rank's half (relative difference 1.11 on a tiny Llama);
* FSDP units sharing a parameter (ALBERT-style blocks sharing one linear; one
  ``nn.Parameter`` in two layers): torch's ``fully_shard`` refused them (device_mesh's
  "Invariant encountered", exit 3; or "shared with a parameter already managed by another
  FSDP group", worded as the model's forward failing, exit 2). The layers sharing a
  parameter are now one unit, as a tied embedding and head are.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_llama import llama_reference

from memplan.errors import BadInputError
from memplan.parallel import Parallel


def _plan(model: str, parallel: Parallel | None, strategy: str = "ddp", units=(), world=2):
    from memplan.plan import Breakdown, Plan, Prediction

    micro, k = 2, 2
    dp = parallel.dp if parallel is not None else world
    zero = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)
    return Plan(
        target_batch=micro * k * dp,
        micro_batch_size=micro,
        accumulation_steps=k,
        world_size=world,
        strategy=strategy,  # type: ignore[arg-type]
        shard_units=tuple(units),
        budget_bytes=1 << 40,
        predicted=Prediction(peak_bytes=1 << 20, step_seconds=1.0, breakdown=zero),
        model=model,
        parallel=parallel,
    )


# --------------------------------------------------------------------------- TP, dp 1
def _tp_rank(rank: int, port: int, model: str, layout: Parallel, queue) -> None:
    import torch.distributed as dist
    from gloo_ranks import leave_gloo
    from torch.distributed.tensor import DTensor

    from memplan import run
    from memplan.model.batch import map_batch
    from memplan.model.loader import load_model_file
    from memplan.run.parallel import build_layout
    from memplan.verify.parallel import layout_gradient_error

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    world = layout.world_size
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mf = load_model_file(model).at_seq_len(16)
    plan = _plan(model, layout, world=world)
    device = torch.device("cpu")
    # verify's own check: this rank's gradient shard against one process's gradient
    error, worst = layout_gradient_error(mf, plan, layout, device, 0, rank)

    # the gradients the optimizer steps by and the norm the runtime clips by
    # (Layout.clip_grad_norm), against one process's gradient of the same 4 samples
    torch.manual_seed(0)
    reference = mf.build_model().train()
    torch.manual_seed(10_000)
    batch = mf.make_batch(4)
    with run.no_dropout():
        mf.loss(reference, batch).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    wanted = {name: p.grad.norm().item() for name, p in reference.named_parameters()}
    torch.manual_seed(0)
    net = mf.build_model().train()
    run.apply(net, plan)
    built = build_layout(
        net, plan, layout, lambda m: torch.optim.SGD(m.parameters(), lr=0.0), device
    )
    names = {id(p): name for name, p in net.named_parameters()}
    seen: dict[str, float] = {}
    mislaid: list[str] = []  # gradients not in their parameter's layout

    def read(*_):
        seen["norm"] = built.clip_grad_norm(1e9)
        for group in built.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if isinstance(grad, DTensor):
                    if tuple(grad.placements) != tuple(p.placements):
                        mislaid.append(names[id(p)])
                    grad = grad.full_tensor()
                seen[names[id(p)]] = grad.norm().item()

    built.optimizer.register_step_pre_hook(read)
    halves = [map_batch(batch, lambda t, i=i: t[2 * i : 2 * i + 2]) for i in range(2)]
    with run.no_dropout():
        built.train_step(halves, mf.loss)
    queue.put((rank, error, worst, seen, expected, wanted, mislaid))
    leave_gloo(queue)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [Parallel(tp=2, sequence_parallel=True, loss_parallel=True), Parallel(tp=2, pp=2)],
    ids=["tp2-sp-lossparallel", "pp2-tp2"],
)
def test_tp_without_data_parallel_matches_one_process_gradient_and_norm(layout, tmp_path):
    # tp 2 + SP on 2 ranks (what `solve --world-size 2 --layout auto` picks): before, the
    # gradient check read rank 0 1.2 and rank 1 0.76 of the layer norms' gradients (each
    # rank's partial sum), and Layout.clip_grad_norm counted the embedding's gradient,
    # whole on both ranks, twice (1.36 for 1.19), as under pp 2 × tp 2 (no SP).
    import torch.multiprocessing as mp

    from memplan.verify.distributed import free_port

    model = llama_reference(tmp_path / "llama")
    context = mp.get_context("spawn")
    queue = context.Queue()
    world = layout.world_size
    mp.start_processes(
        _tp_rank,
        args=(free_port(), model, layout, queue),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    results = [queue.get() for _ in range(world)]
    assert sorted(r[0] for r in results) == list(range(world))
    held: set[str] = set()
    for rank, error, worst, seen, expected, wanted, mislaid in results:
        assert isinstance(error, float) and error < 1e-4, (rank, error, worst)
        assert seen.pop("norm") == pytest.approx(expected, rel=1e-5), rank
        assert mislaid == [], rank
        assert seen, rank
        for name, value in seen.items():
            assert value == pytest.approx(wanted[name], rel=1e-5, abs=1e-9), (rank, name)
        held |= set(seen)
    assert held == set(wanted)  # every parameter compared on some rank
    assert any("layernorm" in name for name in held)


# --------------------------------------------------------------------------- shared weights
SHARED_LINEAR = """
import torch, torch.nn as nn, torch.nn.functional as F
class Block(nn.Module):
    def __init__(s, shared): super().__init__(); s.shared = shared; s.ln = nn.LayerNorm(16)
    def forward(s, x): return x + F.gelu(s.shared(s.ln(x)))
class M(nn.Module):
    def __init__(s):
        super().__init__(); lin = nn.Linear(16, 16)
        s.blocks = nn.ModuleList(Block(lin) for _ in range(3)); s.head = nn.Linear(16, 2)
    def forward(s, x, y):
        for b in s.blocks: x = b(x)
        return F.cross_entropy(s.head(x.mean(1)), y)
def build_model(): torch.manual_seed(0); return M()
def make_batch(n): return (torch.randn(n, 8, 16), torch.randint(0, 2, (n,)))
"""

SHARED_PARAMETER = """
import torch, torch.nn as nn, torch.nn.functional as F
class Shared(nn.Module):
    def __init__(s, w): super().__init__(); s.w = w
    def forward(s, x): return torch.tanh(F.linear(x, s.w))
class M(nn.Module):
    def __init__(s):
        super().__init__(); w = nn.Parameter(torch.randn(16, 16) / 4)
        s.a = Shared(w); s.b = Shared(w); s.c = nn.Linear(16, 16); s.head = nn.Linear(16, 1)
    def forward(s, x, y): return F.mse_loss(s.head(s.c(s.b(s.a(x)))).squeeze(-1), y)
def build_model(): torch.manual_seed(0); return M()
def make_batch(n): return {"x": torch.randn(n, 8, 16), "y": torch.randn(n, 8)}
"""

SHARED_WITH_EMBEDDING = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.embed = nn.Embedding(16, 16)
        s.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2)); s.head = nn.Linear(16, 1)
        s.blocks[0].weight = s.embed.weight
    def forward(s, x):
        h = s.embed(x)
        for b in s.blocks: h = b(h)
        return s.head(h).mean()
def build_model(): torch.manual_seed(0); return M()
def make_batch(n): return torch.randint(0, 16, (n, 8))
"""


def _model(tmp_path: Path, source: str) -> tuple[str, torch.nn.Module]:
    from memplan.model.loader import load_model_file

    path = tmp_path / "model.py"
    path.write_text(source)
    return str(path), load_model_file(str(path)).build_model()


def test_units_sharing_a_parameter_are_grouped_in_plan_order(tmp_path):
    from memplan.run.wrap import fsdp_unit_groups

    blocks = [f"blocks.{i}" for i in range(3)]
    _, net = _model(tmp_path, SHARED_LINEAR)
    assert fsdp_unit_groups(net, blocks) == ([blocks], [])
    _, net = _model(tmp_path, SHARED_PARAMETER)
    assert fsdp_unit_groups(net, ["a", "b", "c"]) == ([["a", "b"], ["c"]], [])
    assert fsdp_unit_groups(net, ["c", "b", "a"]) == ([["c"], ["b", "a"]], [])
    # a unit sharing a parameter with the embeddings outside every unit: the root's
    _, net = _model(tmp_path, SHARED_WITH_EMBEDDING)
    assert fsdp_unit_groups(net, ["blocks.0", "blocks.1"]) == ([["blocks.1"]], ["blocks.0"])
    # nothing shared: one unit a layer, as before
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert fsdp_unit_groups(plain, ["0", "1"]) == ([["0"], ["1"]], [])


def test_torchtitan_edge_units_refuse_a_layer_sharing_the_embeddings_weight(tmp_path):
    # refused before anything is sharded (no process group needed to see it): a rank's
    # BadInputError is verify's exit 2 with this message
    from memplan.run.wrap import shard_units

    _, net = _model(tmp_path, SHARED_WITH_EMBEDDING)
    with pytest.raises(BadInputError) as caught:
        shard_units(net, ["blocks.0", "blocks.1"], {}, edge_units=True)
    message = str(caught.value)
    assert "embed.weight (in embed, blocks.0)" in message
    assert "torchtitan-2507" in message and "make_batch" not in message
    assert "--fsdp-units memplan" in caught.value.hint


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "units"),
    [(SHARED_LINEAR, ("blocks.0", "blocks.1", "blocks.2")), (SHARED_PARAMETER, ("a", "b", "c"))],
    ids=["albert-shared-linear", "one-parameter-two-layers"],
)
def test_fsdp_on_two_ranks_trains_layers_that_share_a_parameter(source, units, tmp_path):
    # Before: torch's "Invariant encountered" from device_mesh (a CannotMeasureError, exit
    # 3), and "Parameter 'b.w' is shared with a parameter already managed by another FSDP
    # group" worded as the model's forward failing (exit 2, "Check that make_batch()").
    from memplan.verify.distributed import verify_distributed

    model, _ = _model(tmp_path, source)
    plan = _plan(model, None, "fsdp", units)
    result = verify_distributed(model, plan, steps=1, timeout_s=300)
    check = result.gradient_check
    assert check.status == "pass", check
    assert check.relative_error is not None and check.relative_error < 1e-4
    assert [r.effective_batch for r in result.ranks] == [8, 8]


@pytest.mark.slow  # probe, solve and verify on two gloo ranks
def test_fsdp_plan_of_a_model_with_no_layers_verifies_as_one_root_unit(tmp_path):
    # No repeated blocks, so the profile has no layers and the plan no shard_units: FSDP's
    # root is the one unit. Before, verify refused the plan it was given ("The fsdp plan
    # names no shard_units. Solve it again."), and solving again wrote the same plan.
    from typer.testing import CliRunner

    from memplan.cli import app

    model = tmp_path / "model.py"
    model.write_text(SHARED_PARAMETER)

    def run(*args):
        return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)

    done = run("probe", model, "--device", "cpu", "-o", tmp_path / "p.yaml")
    assert done.exit_code == 0, done.output
    done = run(
        *("solve", tmp_path / "p.yaml", "--target-batch", 8, "--budget", "1GiB"),
        *("--world-size", 2, "--strategy", "fsdp", "-o", tmp_path / "plan.yaml"),
    )
    assert done.exit_code == 0, done.output
    assert "shard_units: []" in (tmp_path / "plan.yaml").read_text()
    done = run("verify", tmp_path / "plan.yaml")
    said = " ".join(done.output.split())
    assert done.exit_code == 0, said
    assert "gradient check: pass" in said and "PASS: peak error" in said
