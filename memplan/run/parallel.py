"""Run a model under a parallel layout (issue 25) in an initialised process group: the one
definition that ``memplan verify --world-size N`` runs for a plan with ``parallel:`` and
the emitted training scripts import.

``build_layout(net, plan, parallel, make_optimizer, device)`` on every rank:

1. a DeviceMesh over the world, dimensions ``pp, dp_replicate, dp_shard, cp, tp`` in
   torchtitan's order (``ParallelDims``: tp innermost, so a TP group is adjacent ranks);
2. tensor parallelism: ``parallelize_module`` on the tp mesh, each module of the model's TP
   plan (memplan.run.tp_plan) with the ParallelStyle transformers registers for its style
   (``transformers/distributed/tensor_parallel.py``: colwise = ColwiseParallel, rowwise =
   RowwiseParallel, colwise_gather_output = ColwiseParallel(output_layouts=Replicate()),
   rowwise_split_input = RowwiseParallel(input_layouts=Replicate()), embedding_rowwise =
   RowwiseParallel(input_layouts=Replicate()) on the embedding (vocab-parallel), sequence_parallel
   = SequenceParallel); the same styles as torchtitan's Llama ``apply_tp``
   (``tok_embeddings``: RowwiseParallel(input_layouts=Replicate()));
3. pipeline parallelism: the repeated block list split into contiguous stages
   (``Parallel.stage_ranges``: uneven allowed), embeddings on the first stage, final norm, head and
   loss on the last; the layers of other stages are replaced by pass-throughs so every
   module keeps its fully-qualified name; ``torch.distributed.pipelining`` runs the plan's
   schedule (GPipe, 1F1B, interleaved 1F1B) over ``accumulation_steps`` micro-batches;
4. data parallelism over what is left: DDP on the ``dp_replicate`` mesh
   (``DistributedDataParallel(device_mesh=...)``, which composes with TP by localising
   DTensor parameters; under PP each gradient is all-reduced in place after the
   pipeline's backward instead), or FSDP2 ``fully_shard`` on the ``dp_shard`` mesh (HSDP on both),
   one unit per plan shard unit (those sharing a parameter as one), then the root: with TP
   a 2-D (dp_shard, tp) layout; with TP and neither (or under PP), each gradient autograd leaves in
   another layout than its parameter's (a sequence-parallel norm's partial sum, the
   vocabulary-split embedding's whole gradient) is put in its parameter's before the
   optimizer step (``settle_grad_layouts``);
5. the model file's optimizer over this rank's parameters.

``Layout.train_step(batches, loss_fn)`` runs one optimizer step. Context parallelism is
not run here (the CPU has no ring-attention kernels): ``cp > 1`` is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.parallel import Parallel
from memplan.run.pipeline import (
    check_pipeline_split,
    make_stage_module,
    pipeline_parts,
)
from memplan.run.tp_plan import tp_modules, tp_plan_for

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Device-mesh dimensions, outermost first (torchtitan's ParallelDims order)."""


def build_mesh(parallel: Parallel, device_type: str) -> Any:
    """The world's DeviceMesh for ``parallel``, one named dimension per degree (size-1
    dimensions included, so ``mesh["tp"]`` always exists)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(getattr(parallel, name) for name in MESH_DIMS)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def mesh_coordinates(parallel: Parallel, rank: int) -> dict[str, int]:
    """This rank's index along each mesh dimension (row-major over ``MESH_DIMS``)."""
    out: dict[str, int] = {}
    rest = rank
    for name in reversed(MESH_DIMS):
        degree = getattr(parallel, name)
        out[name] = rest % degree
        rest //= degree
    return out


def data_rank(parallel: Parallel, rank: int) -> int:
    """Which data-parallel replica/shard this rank feeds: ranks of one TP group and one
    pipeline see the same samples."""
    where = mesh_coordinates(parallel, rank)
    return where["dp_replicate"] * parallel.dp_shard + where["dp_shard"]


def layout_to_run(plan: Any) -> Parallel | None:
    """The plan's layout when it needs this module (tensor, pipeline or context parallel
    degrees); None for plain data parallelism, which memplan.run.wrap runs."""
    parallel = getattr(plan, "parallel", None)
    if parallel is None or (parallel.tp == 1 and parallel.pp == 1 and parallel.cp == 1):
        return None
    return parallel


# --------------------------------------------------------------------------- tensor parallel
def parallel_style(style: str) -> Any:
    """The torch ParallelStyle for a transformers TP style name."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # on an nn.Embedding: vocab-sharded (dim 0), the partial lookups all-reduced
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        # on an nn.Embedding: hidden-sharded (dim 1), the slices gathered
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }
    if style not in styles:
        raise BadInputError(
            f"Tensor-parallel style {style!r} is not one memplan runs.",
            hint=f"Use one of {', '.join(sorted(styles))} in the model's TP plan.",
        )
    return styles[style]()


def check_tp_divisible(net: torch.nn.Module, modules: dict[str, str], tp: int) -> None:
    """Refuse a TP degree that splits an attention head or a linear's split dimension."""
    config = getattr(net, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise BadInputError(
                f"tp {tp} does not divide the model's {attr} ({heads}): each TP rank must "
                "hold whole attention heads.",
                hint=f"Choose a tensor-parallel degree that divides {heads}.",
            )
    named = dict(net.named_modules())
    for name, style in modules.items():
        if not isinstance(named[name], torch.nn.Linear):
            continue  # DTensor splits an embedding's vocabulary unevenly too
        weight = named[name].weight
        dim = 0 if style.startswith("colwise") else 1
        if style.startswith(("colwise", "rowwise")) and weight.shape[dim] % tp:
            raise BadInputError(
                f"tp {tp} does not divide {name}.weight's dimension {dim} "
                f"({weight.shape[dim]}), which the {style} style splits.",
                hint="Choose a tensor-parallel degree that divides it.",
            )


HEAD_STYLES = ("colwise_gather_output", "colwise_rep")
"""TP-plan styles of a head whose logits are gathered whole: the module loss parallel
keeps sharded by vocabulary instead."""


def loss_parallel_head(modules: dict[str, str], sequence_parallel: bool) -> tuple[str, Any]:
    """The head (the one module of the TP plan with a gathered colwise style) and its style
    under loss parallel: ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``,
    the logits left a vocabulary-sharded DTensor for ``loss_parallel()`` (torchtitan's
    ``apply_tp`` for the ``output`` projection, torchtitan/models/llama3/infra/parallelize.py
    at v0.2.2; with sequence parallel its input is ``Shard(1)``, gathered by the style)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    heads = [name for name, style in modules.items() if style in HEAD_STYLES]
    if len(heads) != 1:
        raise BadInputError(
            f"loss parallel shards the head's logits, but the TP plan has {len(heads)} "
            f"gathered colwise heads ({', '.join(heads) or 'none'}).",
            hint="Name the head once in TP_PLAN with style colwise_gather_output, or plan "
            "without loss parallel.",
        )
    style = ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(),
        output_layouts=Shard(-1),
        use_local_output=False,
    )
    return heads[0], style


def apply_tp(
    net: torch.nn.Module,
    tp_mesh: Any,
    declared: Any = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, str]:
    """Split ``net``'s TP-plan modules over ``tp_mesh`` (with ``sequence_parallel``, the
    norms and the residual stream between the TP regions too; with ``loss_parallel`` the
    head's logits left sharded by vocabulary); returns name -> style."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = tp_modules(net, tp_plan_for(net, declared))
    if not modules:
        raise BadInputError(
            f"The TP plan of {type(net).__name__} matches none of its modules.",
            hint="Check the module-name patterns of TP_PLAN against model.named_modules().",
        )
    check_tp_divisible(net, modules, tp_mesh.size())
    head = loss_parallel_head(modules, sequence_parallel) if loss_parallel else None
    if not sequence_parallel:
        plan = {name: parallel_style(s) for name, s in modules.items()}
        if head is not None:
            plan[head[0]] = head[1]
        parallelize_module(net, tp_mesh, plan)
        return modules
    from memplan.run.sequence_parallel import sequence_parallel_plan

    plan, regions, norms = sequence_parallel_plan(net, modules)
    if head is not None:
        plan[head[0]] = head[1]
    parallelize_module(net, tp_mesh, plan)
    from memplan.run.sequence_parallel import gather_sequence

    for name in regions:
        net.get_submodule(name).register_forward_pre_hook(gather_sequence, with_kwargs=True)
    return {**modules, **dict.fromkeys(norms, "sequence_parallel")}


# --------------------------------------------------------------------------- pipeline
def hf_causal_loss(net: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the model computes from ``labels`` (transformers' ``loss_function``),
    as a function of (logits, labels) for the last pipeline stage."""
    vocab = int(net.config.vocab_size)  # type: ignore[union-attr]
    compute = net.loss_function  # type: ignore[union-attr]
    return lambda logits, labels: compute(logits=logits, labels=labels, vocab_size=vocab)


def _schedule_class(parallel: Parallel) -> Any:
    from torch.distributed import pipelining

    return {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
    }[parallel.schedule]


# --------------------------------------------------------------------------- data parallel
def _wrap_data_parallel(module: torch.nn.Module, plan: Any, parallel: Parallel, mesh: Any) -> Any:
    """DDP over dp_replicate, or FSDP2 over dp_shard (HSDP over both); unchanged if dp 1."""
    if parallel.dp_shard > 1:
        from torch.distributed.fsdp import fully_shard

        from memplan.run.wrap import fsdp_mixed_precision, fsdp_no_sync, shard_units

        dp_mesh = (
            mesh["dp_replicate", "dp_shard"] if parallel.dp_replicate > 1 else mesh["dp_shard"]
        )
        policy = fsdp_mixed_precision(plan)
        options: dict[str, Any] = {"mesh": dp_mesh}
        if parallel.pp > 1:
            # as torchtitan shards pipeline stages (torchtitan/distributed/fsdp.py,
            # get_fsdp_reshard_after_forward_policy "default": not pp_enabled): no
            # all-gather per micro-batch; memory.sharding models it
            options["reshard_after_forward"] = False
        if policy is not None:
            options["mp_policy"] = policy
        # one unit per layer, layers sharing a parameter as one (memplan.run.wrap)
        shard_units(module, plan.shard_units, options, edge_units=parallel.edge_units)
        fully_shard(module, **options)
        if parallel.pp == 1 and plan.grad_sync == "last_micro_step":
            fsdp_no_sync(module)
        return module
    if parallel.dp_replicate > 1 and parallel.pp == 1:
        return torch.nn.parallel.DistributedDataParallel(
            module, device_mesh=mesh["dp_replicate"], gradient_as_bucket_view=True
        )
    return module


# --------------------------------------------------------------------------- the layout
@dataclass(kw_only=True)
class Layout:
    """One rank's share of a model under a parallel layout, ready to train."""

    parallel: Parallel
    mesh: Any
    model: torch.nn.Module
    """What this rank calls (DDP/FSDP-wrapped; a pipeline stage's module under PP)."""
    net: torch.nn.Module
    """The unwrapped module whose parameters this rank holds (names as in the full model)."""
    optimizer: torch.optim.Optimizer
    plan: Any
    tp_styles: dict[str, str] = field(default_factory=dict)
    stage_ranges: tuple[range, ...] = ()
    """Under PP: the layers of each of this rank's stages."""
    schedule: Any = None
    is_first: bool = True
    is_last: bool = True
    accumulator: Any = None
    max_grad_norm: float | None = None
    dtensor_placements: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Parameter name -> (mesh, placements) of each TP-split parameter (before DDP
    localises them), for slicing a full gradient to this rank's shard."""

    def train_step(self, micro_batches: Sequence[Any], loss_fn: Callable[..., Any]) -> float:
        """One optimizer step over this data rank's micro-batches (``accumulation_steps`` of
        them): accumulated, or the pipeline's micro-batches under PP. Returns the mean loss
        (NaN on pipeline stages that compute none)."""
        if self.schedule is None:
            metrics: dict[str, Any] = {}
            with self.loss_context():
                for batch in micro_batches:
                    metrics = self.accumulator.step(batch, loss_fn)
            return float(metrics.get("loss", float("nan")))
        device = self.mesh.device_type
        whole = {
            key: torch.cat([b[key] for b in micro_batches]).to(device)
            for key in ("input_ids", "labels")
        }
        losses: list[torch.Tensor] = []
        args = (whole["input_ids"],) if self.is_first else ()
        target = whole["labels"] if self.is_last else None
        # the merged outputs step returns (kept_outputs 'last') are dropped at once
        keep = self.parallel.kept_outputs != "none"
        self.schedule.step(*args, target=target, losses=losses, return_outputs=keep)
        if self.parallel.tp > 1:  # the embedding's comes back whole: its slice, for the norm
            settle_grad_layouts(self.optimizer)
        if self.parallel.dp_replicate > 1 and self.parallel.dp_shard == 1:
            self._average_gradients()
        if self.max_grad_norm is not None:
            self.clip_grad_norm(self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not losses:
            return float("nan")
        return float(torch.stack([loss.detach() for loss in losses]).mean())

    def loss_context(self) -> Any:
        """``torch.distributed.tensor.parallel.loss_parallel()`` under loss parallel (the
        cross-entropy over vocabulary-sharded logits, forward and backward, as torchtitan's
        train context runs it), else nothing."""
        import contextlib

        if not self.parallel.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradient norm of the whole model (every TP shard and pipeline stage)
        to ``max_norm``; returns the norm before clipping. torch's ``clip_grad_norm_`` mixes
        plain and DTensor gradients only under FSDP (which makes every gradient a DTensor), so
        without it: each rank sums the squares of its local gradients, TP-split ones
        all-reduced over tp, replicated ones counted once, then over the pipeline's stages."""
        from torch.distributed.tensor import DTensor

        if self.parallel.dp_shard > 1 and self.parallel.pp == 1:
            params = [p for p in self.net.parameters() if p.grad is not None]
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        split = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        grads = []
        for name, p in self.net.named_parameters():
            if p.grad is None:
                continue
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.append(grad)
            square = grad.detach().double().pow(2).sum()
            placements = self.dtensor_placements.get(name, (None, ()))[1]
            if any(placement.is_shard() for placement in placements):
                split += square
            else:
                whole += square
        dist = torch.distributed
        if self.parallel.tp > 1:
            dist.all_reduce(split, group=self.mesh["tp"].get_group())
        total = split + whole
        if self.parallel.pp > 1:
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        norm = float(total.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            for grad in grads:
                grad.mul_(scale)
        return norm

    def _average_gradients(self) -> None:
        """Pipeline stages' data-parallel replicas: each gradient all-reduced in place
        over dp_replicate and divided by it. (DDP cannot wrap a stage: its bucket rebuild
        counts every pipeline micro-batch's backward, torch 2.13 reducer.cpp:2003.)"""
        group = self.mesh["dp_replicate"].get_group()
        for p in self.net.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                torch.distributed.all_reduce(grad, group=group)
                grad.div_(self.parallel.dp_replicate)


def settle_grad_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Each TP-split parameter's gradient put in the parameter's own layout before the
    optimizer step, where autograd left it otherwise: a partial sum over the TP ranks
    (``Partial``: one all-reduce, as FSDP2 reduces them, torch 2.13 ``_fsdp_param.py``
    ``_get_grad_inner_tensor``) or whole on every rank (``Replicate`` for a ``Shard``
    parameter: each rank keeps its slice). Under sequence parallelism a norm's weight is
    replicated but each rank sees only its slice of the sequence: its gradient is
    ``Partial``; the vocabulary-split embedding's comes back ``Replicate``. torch's
    optimizers step either right (DTensor redistributes inside each op), but ``to_local()``
    (the gradient check) and ``Layout.clip_grad_norm`` read one rank's share, or count the
    whole gradient once per rank. DDP's TP composition does this in ``from_local``'s
    backward, and FSDP2 itself; without them it is an optimizer step pre-hook, and under
    pipeline stages ``Layout.train_step`` calls it once the schedule's backward is done."""
    from torch.distributed.tensor import DTensor, Replicate

    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if not isinstance(grad, DTensor):
                continue
            if isinstance(param, DTensor) and param.device_mesh == grad.device_mesh:
                wanted = tuple(param.placements)
            else:
                wanted = tuple(Replicate() if p.is_partial() else p for p in grad.placements)
            if tuple(grad.placements) != wanted:
                param.grad = grad.redistribute(grad.device_mesh, wanted)


def _placements(net: torch.nn.Module) -> dict[str, tuple[Any, Any]]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.device_mesh, tuple(p.placements))
        for name, p in net.named_parameters()
        if isinstance(p, DTensor)
    }


def build_layout(
    net: torch.nn.Module,
    plan: Any,
    parallel: Parallel,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    device: torch.device,
    *,
    declared_tp_plan: Any = None,
    max_grad_norm: float | None = None,
) -> Layout:
    """``net`` (built identically on every rank, checkpointing already applied) parallelised
    by ``parallel`` on this rank; see the module doc. ``max_grad_norm`` clips the gradient
    norm once per step without pipeline parallelism (DTensor gradients included); a
    pipeline's norm spans stages, which torch's clip does not see, so it is not clipped."""
    from memplan import run

    if parallel.cp > 1:
        raise BadInputError(
            "Context parallelism is modelled but not run by memplan's runtime, on any "
            "device: it has no ring attention.",
            hint="Verify the layout with --cp 1, or train with the emitted torchtitan or "
            "Megatron configuration.",
        )
    if parallel.loss_parallel and parallel.pp > 1:
        raise BadInputError(
            "Loss parallel with pipeline stages is modelled but not run by memplan (the last "
            "stage would hand the schedule's loss a vocabulary-sharded DTensor).",
            hint="Verify the layout with --pp 1, or without loss parallel.",
        )
    if parallel.sequence_parallel and parallel.pp > 1:
        raise BadInputError(
            "Sequence parallelism with pipeline stages is modelled but not run by memplan "
            "(a stage would send sequence-sharded hidden states).",
            hint="Verify the layout with --pp 1, or without --sequence-parallel.",
        )
    if parallel.kept_outputs == "all":
        raise BadInputError(
            "parallel.kept_outputs 'all' (every stage keeping its outputs, torch before "
            "pytorch/pytorch#153383) is modelled but not run: torch 2.13 keeps the last "
            "stage's only.",
            hint="Verify the plan with kept_outputs 'last' or 'none'.",
        )
    if parallel.pp > 1:  # on the whole model, before TP splits it: every rank alike
        check_pipeline_split(net, parallel.pp, parallel.stage_split)
    rank = torch.distributed.get_rank()
    mesh = build_mesh(parallel, device.type)
    styles: dict[str, str] = {}
    if parallel.tp > 1:
        styles = apply_tp(
            net,
            mesh["tp"],
            declared_tp_plan,
            sequence_parallel=parallel.sequence_parallel,
            loss_parallel=parallel.loss_parallel,
        )
    placements = _placements(net)
    if parallel.pp == 1:
        model = _wrap_data_parallel(net, plan, parallel, mesh)
        optimizer = make_optimizer(net)
        fsdp = parallel.dp_shard > 1  # every gradient a DTensor: torch's clip works
        if parallel.tp > 1 and not fsdp:  # before the clip's and any reader's hook
            optimizer.register_step_pre_hook(lambda *_: settle_grad_layouts(optimizer))
        clip = max_grad_norm if fsdp else None
        acc = run.Accumulator(model, optimizer, plan, device=device, max_grad_norm=clip)
        layout = Layout(
            parallel=parallel,
            mesh=mesh,
            model=model,
            net=net,
            optimizer=optimizer,
            plan=plan,
            tp_styles=styles,
            accumulator=acc,
            dtensor_placements=placements,
        )
        if max_grad_norm is not None and not fsdp:  # clip before each optimizer step

            def clip(*_: Any) -> None:
                layout.clip_grad_norm(max_grad_norm)  # type: ignore[arg-type]

            optimizer.register_step_pre_hook(clip)
        return layout
    if parallel.virtual_stages > 1:
        raise BadInputError(
            "Interleaved 1F1B with virtual stages is modelled but not run by memplan verify.",
            hint="Verify with schedule 1f1b or gpipe.",
        )
    from torch.distributed.pipelining import PipelineStage

    parts = pipeline_parts(net)
    loss = hf_causal_loss(net)
    n_layers = len(net.get_submodule(parts.layers))
    if n_layers < parallel.pp:
        raise BadInputError(
            f"{n_layers} layers cannot fill {parallel.pp} pipeline stages.",
            hint=f"Plan with --pp {n_layers} or less.",
        )
    stage = mesh_coordinates(parallel, rank)["pp"]
    ranges = parallel.stage_ranges(n_layers)
    first, last = stage == 0, stage == parallel.pp - 1
    make_stage_module(net, parts, ranges[stage], first=first, last=last)
    model = _wrap_data_parallel(net, plan, parallel, mesh)
    pipeline_stage = PipelineStage(model, stage, parallel.pp, device, group=mesh["pp"].get_group())
    schedule = _schedule_class(parallel)(
        pipeline_stage, n_microbatches=plan.accumulation_steps, loss_fn=loss
    )
    optimizer = make_optimizer(net)
    return Layout(
        parallel=parallel,
        mesh=mesh,
        model=model,
        net=net,
        optimizer=optimizer,
        plan=plan,
        tp_styles=styles,
        stage_ranges=(ranges[stage],),
        schedule=schedule,
        is_first=first,
        is_last=last,
        max_grad_norm=max_grad_norm,
        dtensor_placements=placements,
    )
