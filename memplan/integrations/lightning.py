"""Lightning: ``MemplanBatchSize``, a callback in the style of ``BatchSizeFinder`` (issue 32).

One line in the Trainer::

    trainer = L.Trainer(callbacks=[MemplanBatchSize(budget="20GiB")], ...)

Before fitting (``on_fit_start``, where ``BatchSizeFinder`` scales), it plans the
LightningModule (memplan.integrations.api.plan_model) on batches made by the training
DataLoader's own ``collate_fn`` from its dataset, with ``training_step`` as the loss and
the optimizer ``configure_optimizers`` made, for the effective batch the run asks for
(batch size × ``accumulate_grad_batches`` × world size; ``target_batch=`` overrides it),
at the Trainer's precision. Then it sets the batch size attribute where
``BatchSizeFinder`` finds it (``lightning_getattr``/``lightning_setattr``: the model, its
``hparams``, or the datamodule), ``trainer.accumulate_grad_batches`` and the checkpointed
layers (``memplan.apply`` on the LightningModule), reloads the training DataLoader, and
logs the plan (one info line, and the logger's hyperparameters). The plan is kept as
``callback.plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.errors import BadInputError
from memplan.integrations.api import budget_bytes, check_options, plan_model
from memplan.integrations.extras import require
from memplan.plan import Plan
from memplan.run.checkpoint import apply
from memplan.units import parse_budget

require("lightning", "memplan.integrations.lightning")

from lightning.pytorch import Callback  # noqa: E402 - after the check that names the extra
from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from lightning.pytorch.utilities.parsing import (  # noqa: E402
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

__all__ = ["MemplanBatchSize", "lightning_request"]

_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


class MemplanBatchSize(Callback):
    """Set the batch size, ``accumulate_grad_batches`` and the checkpointed layers from a
    memplan plan before fitting (module docstring). ``batch`` (a batch or a function
    ``batch_size -> batch``) replaces the batches made from the DataLoader's dataset;
    ``loss_fn(module, batch)`` replaces ``training_step``. Other keyword arguments are
    ``plan_model``'s (``strategy``, ``modes``, ``margin``, ``output``, ``formats``, ...).
    A budget no plan fits raises NoPlanFitsError in ``on_fit_start``, before any step."""

    def __init__(
        self,
        budget: str | int,
        *,
        target_batch: int | None = None,
        batch_arg_name: str = "batch_size",
        batch: Any = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        **request: Any,
    ) -> None:
        check_options("MemplanBatchSize", request)
        _check_values(budget, target_batch, batch_arg_name)
        self.budget = budget
        self.target_batch = target_batch
        self.batch_arg_name = batch_arg_name
        self.batch = batch
        self.loss_fn = loss_fn
        self.request = request
        self.plan: Plan | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if stage not in (None, "fit"):
            return
        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise BadInputError(
                "MemplanBatchSize sets accumulate_grad_batches itself (the plan's accumulation "
                "steps), and Lightning's GradientAccumulationScheduler changes it per epoch: "
                "the two cannot be used together, and memplan would plan for an effective "
                "batch the scheduler then changes.",
                hint="Remove the GradientAccumulationScheduler callback, and give "
                "MemplanBatchSize(target_batch=...) the effective batch you want (batch size × "
                "the scheduler's accumulation × ranks).",
            )
        if not trainer.fit_loop._data_source.is_module():
            raise BadInputError(
                "MemplanBatchSize cannot change the batch size of DataLoaders passed directly "
                "to .fit().",
                hint="Make the DataLoader in the LightningModule's or LightningDataModule's "
                "train_dataloader(), from a batch_size attribute (as BatchSizeFinder needs).",
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise BadInputError(
                f"Field {self.batch_arg_name} not found in the model, the datamodule, nor "
                "their hparams: MemplanBatchSize has no batch size to set.",
                hint="Store the batch size as self.batch_size (or name it with "
                "batch_arg_name=...) and build the DataLoader from it.",
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        current = lightning_getattr(pl_module, self.batch_arg_name)
        target = self.target_batch
        if target is None:
            target = int(current) * int(trainer.accumulate_grad_batches) * trainer.world_size
        request = {**lightning_request(trainer), **self.request}
        request.setdefault(
            "optimizer", trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        )
        plan = plan_model(
            pl_module,
            self.batch if self.batch is not None else _loader_batches(trainer, pl_module),
            budget=self.budget,
            target_batch=target,
            loss_fn=self.loss_fn or _training_step(pl_module),
            keep=[trainer],
            prepare=_quiet,
            **request,
        )
        if plan.data_parallel_ranks != trainer.world_size:
            raise BadInputError(
                f"The plan is for {plan.data_parallel_ranks} data-parallel rank(s); this "
                f"Trainer runs {trainer.world_size}.",
            )
        lightning_setattr(pl_module, self.batch_arg_name, plan.micro_batch_size)
        trainer.accumulate_grad_batches = plan.accumulation_steps
        apply(pl_module, plan)
        trainer.fit_loop._combined_loader = (
            None  # reloaded at the new size, as BatchSizeFinder does
        )
        self.plan = plan
        _log(trainer, plan)


def lightning_request(trainer: Any) -> dict[str, Any]:
    """What the Trainer already fixes: precision, world size, strategy."""
    strategy = type(trainer.strategy).__name__.lower()
    if "deepspeed" in strategy:
        config = getattr(trainer.strategy, "config", None) or {}
        stage = int(config.get("zero_optimization", {}).get("stage", 0))
        chosen = {1: "zero1", 2: "zero2", 3: "fsdp"}.get(stage, "ddp")
    else:
        chosen = "fsdp" if "fsdp" in strategy else "ddp"
    return {
        "precision": _PRECISION.get(str(trainer.precision), "fp32"),
        "world_size": int(trainer.world_size),
        "strategy": chosen,
    }


def _loader_batches(trainer: Any, pl_module: Any) -> Callable[[int], Any]:
    """``make_batch(n)``: the training DataLoader's ``collate_fn`` over ``n`` samples of
    its dataset (cycling), the loader asked of the datamodule, else of the module."""
    datamodule = trainer.datamodule
    source = datamodule if datamodule is not None else pl_module
    loader = source.train_dataloader()
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise BadInputError(
            "The training DataLoader's dataset cannot be indexed, so memplan cannot make "
            "batches of a chosen size from it.",
            hint="Pass batch= (a batch, or a function batch_size -> batch) to MemplanBatchSize.",
        )
    count = len(dataset)
    if count < 1:
        raise BadInputError("The training dataset is empty: nothing to plan with.")
    collate = loader.collate_fn

    # named as the user knows it: an error names "collate_fn(4)" (memplan.model.loader)
    def collate_fn(size: int) -> Any:
        return collate([dataset[i % count] for i in range(size)])

    return collate_fn


def _training_step(pl_module: Any) -> Callable[[Any, Any], Any]:
    """``loss(module, batch)``: the loss the module's ``training_step`` returns (a tensor, or
    a dict's ``loss``). An error names it, in the file that defines the module's
    ``training_step`` (memplan.model.loader), not this wrapper's."""

    def training_step(module: Any, batch: Any) -> Any:
        out = module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    step = pl_module.training_step
    training_step.__wrapped__ = getattr(step, "__func__", step)  # type: ignore[attr-defined]
    return training_step


def _check_values(budget: Any, target_batch: Any, batch_arg_name: Any) -> None:
    """Refuse a value no fit could use when the callback is made, not once the fit has
    started: ``budget`` as ``plan_model`` reads it (a percentage or ``auto`` is resolved on
    the fit's device), ``target_batch`` a positive whole number, ``batch_arg_name`` a name."""
    if isinstance(budget, str):
        parse_budget(budget, capacity_bytes=1, free_bytes=1, what="budget")
    else:
        budget_bytes(budget, "meta")
    if target_batch is not None and (
        isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1
    ):
        raise BadInputError(
            f"target_batch must be a positive whole number of samples, got {target_batch!r}.",
            hint="Give the effective batch (samples per optimizer step, all ranks), or leave "
            "it out: batch size × accumulate_grad_batches × ranks.",
        )
    if not isinstance(batch_arg_name, str) or not batch_arg_name:
        raise BadInputError(
            f"batch_arg_name must be the name of the batch size attribute (a string such as "
            f"'batch_size'), got {batch_arg_name!r}.",
            hint="Pass the attribute's name, e.g. MemplanBatchSize(budget, "
            "batch_arg_name='batch_size'), not its value.",
        )


def _quiet(module: Any) -> None:
    """The planning copy logs nothing: ``self.log`` outside the fit loop would raise."""
    module.log = lambda *args, **kwargs: None
    module.log_dict = lambda *args, **kwargs: None


def _log(trainer: Any, plan: Plan) -> None:
    layers = len(plan.checkpoint)
    rank_zero_info(
        f"memplan: micro-batch {plan.micro_batch_size} × {plan.accumulation_steps} "
        f"accumulation × {plan.data_parallel_ranks} rank(s) = {plan.target_batch}; "
        f"{layers} layer(s) checkpointed; predicted peak {plan.predicted.peak_bytes} B of "
        f"{plan.budget_bytes} B"
    )
    values = {
        "memplan/micro_batch_size": plan.micro_batch_size,
        "memplan/accumulation_steps": plan.accumulation_steps,
        "memplan/target_batch": plan.target_batch,
        "memplan/checkpointed_layers": layers,
        "memplan/predicted_peak_bytes": plan.predicted.peak_bytes,
        "memplan/budget_bytes": plan.budget_bytes,
    }
    for logger in trainer.loggers:
        logger.log_hyperparams(values)
