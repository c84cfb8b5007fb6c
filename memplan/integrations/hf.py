"""Hugging Face Trainer: ``plan_trainer(trainer, budget=...)`` (issue 32).

One line on a Trainer the script has built (``Trainer`` or a subclass such as TRL's
``SFTTrainer``)::

    trainer = plan_trainer(Trainer(model=model, args=args, train_dataset=ds), budget="20GiB")

It plans ``trainer.model`` (memplan.integrations.api.plan_model) on batches the Trainer's
own data collator makes from its ``train_dataset``, with the Trainer's own ``compute_loss``
and optimizer class (``Trainer.get_optimizer_cls_and_kwargs``, or the optimizer given with
``optimizers=``), for the effective batch the arguments ask for (per-device batch ×
gradient accumulation × world size; ``target_batch=`` overrides it), at the precision
(``bf16`` / ``fp16``) and data-parallel engine (DeepSpeed ZeRO stage, FSDP) already in
``trainer.args``. Then it sets on ``trainer.args``:

* ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` from the plan (and the
  Trainer's own train batch size, as its constructor derives it; DeepSpeed's batch fields,
  ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` and
  ``train_batch_size``, are refilled from the new arguments as the constructor filled them);
* ``gradient_checkpointing`` (``activation_checkpointing`` in transformers 5) true when the
  plan is Trainer's all-or-nothing checkpointing (every block
  ``gradient_checkpointing_enable()`` checkpoints, fully: memplan.emit.hf
  ``trainer_checkpointing``), else false, with exactly the plan's layers checkpointed by
  ``memplan.apply``.

Everything else in the arguments (DeepSpeed, FSDP, ``max_steps``, the optimizer, the
scheduler) stays as it was. The plan is kept as ``trainer.memplan_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.errors import BadInputError
from memplan.integrations.api import check_options, plan_model
from memplan.integrations.extras import require
from memplan.integrations.live import hf_checkpointing_off
from memplan.plan import Plan
from memplan.run.checkpoint import apply, remove

__all__ = ["configure_trainer", "plan_trainer", "trainer_request"]

_PRECISION = (("bf16", "bf16"), ("fp16", "fp16"))
_ZERO = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}


def plan_trainer(
    trainer: Any,
    *,
    budget: str | int,
    target_batch: int | None = None,
    batch: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    **request: Any,
) -> Any:
    """``trainer``, with its per-device batch, accumulation and checkpointing set from the
    plan (see the module docstring); returns the same Trainer. ``batch`` (a batch or a
    function ``batch_size -> batch``) replaces the batches made from ``train_dataset``;
    ``loss_fn(model, batch)`` replaces ``trainer.compute_loss``. Other keyword arguments
    are ``plan_model``'s (``strategy``, ``modes``, ``margin``, ``output``, ``formats``, ...).
    Raises NoPlanFitsError, before any training, when no plan fits ``budget``."""
    check_options("plan_trainer", request)
    require("transformers", "memplan.integrations.hf.plan_trainer")
    args = getattr(trainer, "args", None)
    if args is None or not hasattr(args, "per_device_train_batch_size"):
        raise BadInputError(
            f"plan_trainer() takes a transformers Trainer, got {type(trainer).__name__}."
        )
    asked = trainer_request(trainer)
    for key, value in asked.items():
        request.setdefault(key, value)
    if target_batch is None:
        target_batch = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        )
    if batch is None:
        batch = _dataset_batches(trainer)
    if loss_fn is None:
        loss_fn = _trainer_loss(trainer)
    request.setdefault("optimizer", _trainer_optimizer(trainer))
    plan = plan_model(
        trainer.model, batch, budget=budget, target_batch=target_batch, loss_fn=loss_fn, **request
    )
    configure_trainer(trainer, plan)
    return trainer


def trainer_request(trainer: Any) -> dict[str, Any]:
    """What the Trainer's arguments already fix: precision, world size, strategy."""
    args = trainer.args
    precision = next((p for flag, p in _PRECISION if getattr(args, flag, False)), "fp32")
    strategy = "ddp"
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = trainer.accelerator.state.deepspeed_plugin
        strategy = _ZERO.get(int(getattr(plugin, "zero_stage", 0) or 0), "ddp")
    elif getattr(trainer, "is_fsdp_enabled", False):
        strategy = "fsdp"
    return {"precision": precision, "world_size": int(args.world_size), "strategy": strategy}


def configure_trainer(trainer: Any, plan: Plan) -> Any:
    """Set ``trainer``'s batch, accumulation and checkpointing from ``plan`` (module
    docstring); returns the Trainer."""
    from memplan.emit.hf import trainer_checkpointing

    args = trainer.args
    dp = plan.data_parallel_ranks
    if plan.micro_batch_size * plan.accumulation_steps * dp != plan.target_batch:
        raise BadInputError("The plan's micro-batch × accumulation × ranks is not its target.")
    if dp != args.world_size:
        raise BadInputError(
            f"The plan is for {dp} data-parallel rank(s); this Trainer runs {args.world_size}.",
            hint="Plan with world_size equal to the number of processes the Trainer runs.",
        )
    args.per_device_train_batch_size = plan.micro_batch_size
    args.gradient_accumulation_steps = plan.accumulation_steps
    trainer._train_batch_size = args.train_batch_size  # as Trainer.__init__ derives it
    whole = trainer_checkpointing(plan)
    model = trainer.model
    if whole:
        remove(model)
    else:
        hf_checkpointing_off(model)
        apply(model, plan)  # exactly the planned layers, in their modes (none: none)
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, whole)
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if hasattr(args, name) and whole:
            setattr(args, name, {"use_reentrant": False})
    if getattr(trainer, "is_deepspeed_enabled", False):
        _refill_deepspeed(trainer)
    trainer.memplan_plan = plan
    return trainer


_DEEPSPEED_BATCH = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
)
"""The DeepSpeed config's batch fields, which the Trainer fills from its arguments."""


def _refill_deepspeed(trainer: Any) -> None:
    """DeepSpeed's batch fields from the arguments as the plan set them. The Trainer's
    constructor already wrote the old numbers over the config's ``"auto"``s, and
    ``propagate_args_to_deepspeed`` fills only ``"auto"`` (a number that differs is recorded
    as a mismatch, which ``train()`` raises): so they are made ``"auto"`` again first, then
    filled as the constructor fills them (the same call the Trainer makes when
    ``auto_find_batch_size`` changes the batch size). A number the user's config pinned is
    replaced too: the plan sets the batch, as it sets ``per_device_train_batch_size``."""
    from transformers.integrations.deepspeed import (
        HfTrainerDeepSpeedConfig,
        propagate_args_to_deepspeed,
    )

    plugin = trainer.accelerator.state.deepspeed_plugin
    config = {**plugin.hf_ds_config.config, **dict.fromkeys(_DEEPSPEED_BATCH, "auto")}
    plugin.hf_ds_config = HfTrainerDeepSpeedConfig(config)
    propagate_args_to_deepspeed(trainer.accelerator, trainer.args)
    if getattr(trainer.args, "hf_deepspeed_config", None) is not None:
        trainer.args.hf_deepspeed_config = plugin.hf_ds_config  # one config, as after __init__


def _dataset_batches(trainer: Any) -> Callable[[int], Any]:
    """``make_batch(n)``: the Trainer's data collator over ``n`` samples of its
    ``train_dataset`` (cycling when it has fewer)."""
    from torch.utils.data import IterableDataset

    dataset = getattr(trainer, "train_dataset", None)
    collator = getattr(trainer, "data_collator", None)
    indexable = (
        not isinstance(dataset, IterableDataset)
        and hasattr(dataset, "__getitem__")
        and hasattr(dataset, "__len__")
    )
    if dataset is None or collator is None or not indexable:
        what = (
            "no train_dataset"
            if dataset is None
            else f"a {type(dataset).__name__} as train_dataset, which memplan cannot index (a "
            "streaming or iterable dataset has no length and no samples by position)"
        )
        raise BadInputError(
            f"The Trainer has {what}, so memplan cannot make batches of a chosen size.",
            hint="Pass batch= (a batch, or a function batch_size -> batch) to plan_trainer.",
        )
    count = len(dataset)
    if count < 1:
        raise BadInputError("The Trainer's train_dataset is empty: nothing to plan with.")

    # named as the user knows it: an error names "data_collator(4)" (memplan.model.loader)
    def data_collator(size: int) -> Any:
        out = collator([dataset[i % count] for i in range(size)])
        return dict(out) if hasattr(out, "keys") else out

    return data_collator


def _trainer_loss(trainer: Any) -> Callable[[Any, Any], Any]:
    """The loss the Trainer trains with: its ``compute_loss`` (a subclass's override too)."""

    def compute_loss(model: Any, batch: Any) -> Any:  # errors name it so
        out = trainer.compute_loss(model, batch)
        return out[0] if isinstance(out, tuple) else out

    # an error names the file of the compute_loss that runs (a subclass's, in the user's
    # script), not this wrapper's; the Trainer's own names the script (memplan.model.loader)
    bound = trainer.compute_loss
    compute_loss.__wrapped__ = getattr(bound, "__func__", bound)  # type: ignore[attr-defined]
    return compute_loss


def _trainer_optimizer(trainer: Any) -> Any:
    """The optimizer the Trainer will train with: the one given with ``optimizers=``, else
    a factory of the class and settings ``create_optimizer`` uses."""
    if getattr(trainer, "optimizer", None) is not None:
        return trainer.optimizer
    try:
        kind, settings = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    except Exception:  # an optimizer name memplan's copy cannot build: memplan's default
        return None

    def make_optimizer(model: Any) -> Any:
        return kind([p for p in model.parameters() if p.requires_grad], **settings)

    return make_optimizer
