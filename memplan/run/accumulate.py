"""Gradient accumulation in a user's own training loop: ``Accumulator`` steps once per
effective batch, and the batch helpers it shares with verify (moving a batch to a device,
its sample count, the scalar loss of a forward's output).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from memplan.errors import BadInputError

Normalize = Literal["mean", "tokens"]
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``: a tensor, a tuple/list (named tuples
    kept), a mapping, or anything with a ``.to(device)`` (e.g. a Hugging Face BatchEncoding)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(item, device) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to_device(item, device) for item in batch)
    if isinstance(batch, Mapping):
        moved = {key: move_to_device(value, device) for key, value in batch.items()}
        return moved if type(batch) is dict else _rebuild_mapping(batch, moved)
    if callable(getattr(batch, "to", None)):
        return batch.to(device)
    return batch


def _rebuild_mapping(original: Mapping, moved: dict) -> Any:
    try:
        return type(original)(moved)
    except Exception:  # a mapping type that cannot be built from a dict
        return moved


def samples_in(batch: Any, expected: int | None = None) -> int | None:
    """Samples in a micro-batch: ``expected`` (the plan's micro-batch) where some tensor's
    leading dimension is that, else the leading dimension of its first tensor. (A batch
    whose first tensor is one every sample shares, a [T, T] mask, counted T samples.)"""
    sizes = [int(t.shape[0]) for t in _tensors(batch) if t.dim() > 0]
    if expected is not None and expected in sizes:
        return expected
    return sizes[0] if sizes else None


def _tensors(batch: Any) -> Iterable[torch.Tensor]:
    """The tensors of a batch (a tensor, a tuple/list, any mapping, nested), in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping | tuple | list):
        for item in batch.values() if isinstance(batch, Mapping) else batch:
            yield from _tensors(item)


def _scalar_loss(value: Any, what: str) -> torch.Tensor:
    loss = value
    if not isinstance(loss, torch.Tensor):
        loss = getattr(value, "loss", None)
        if loss is None and isinstance(value, Mapping):
            loss = value.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise BadInputError(
            f"{what} must return a scalar loss tensor (or an object with .loss), got "
            f"{type(value).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + ".",
            hint="Reduce the loss to one number in loss_fn (training_loss in model.py).",
        )
    return loss.reshape(())


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


class Accumulator:
    """Gradient accumulation done right, one micro-batch per call.

    ``acc.step(batch, loss_fn)`` (or ``acc(batch, loss_fn)``) runs forward and backward of one
    micro-batch; every ``plan.accumulation_steps``-th call it also finishes the effective
    batch: unscale (fp16 GradScaler), clip once (``max_grad_norm``), step the optimizer and
    the scheduler once, then ``zero_grad(set_to_none=True)``. All but the last micro-batch run
    under the model's ``no_sync()`` (DDP / FSDP) so gradients are all-reduced once. The
    forward runs under autocast per ``plan.precision`` (bf16 / fp16); for fp16 on CUDA a
    ``torch.amp.GradScaler`` is created unless ``scaler`` is given. The batch is moved to
    ``device`` (default: the model's device).

    ``loss_fn(model, batch)`` returns, for ``normalize="mean"``, the mean loss of the
    micro-batch (a scalar tensor or an object with ``.loss``); it is divided by the number of
    accumulation steps, so equal-sized micro-batches give exactly the full-batch mean.

    For ``normalize="tokens"`` it returns ``(sum_of_token_losses, n_tokens)``, and the sum is
    divided by the token count of the *whole effective batch*, which therefore has to be
    known before the first backward. Give it per effective batch in one of two ways:

    * ``acc.step(first_batch, loss_fn, tokens_in_effective_batch=N)`` on the first
      micro-batch (later calls of the same effective batch may repeat it or omit it), or
    * ``acc.accumulate(micro_batches, loss_fn, count_tokens=fn)``, which counts the tokens of
      all micro-batches first (``fn(batch) -> int``, e.g. ``(b["labels"] != -100).sum()``).

    ``N`` counts this rank's tokens; under ``torch.distributed`` it is all-reduced once per
    effective batch and the loss is multiplied by the world size, undoing DDP's gradient
    averaging, so the result is normalised by the global token count. The sum of the
    ``n_tokens`` that ``loss_fn`` returns is checked against ``N`` before the optimizer step.

    Each call returns a metrics dict: ``loss`` (mean loss of the effective batch so far,
    token-weighted for ``"tokens"``), ``micro_loss``, ``micro_step`` (1-based),
    ``stepped`` (this call finished the effective batch), ``optimizer_steps`` (so far),
    ``effective_batch`` (samples in the effective batch so far × world size: the effective
    batch actually used once ``stepped``), ``accumulation_steps``, ``grad_norm`` (only when
    clipped, before clipping), ``tokens`` (``"tokens"`` mode) and ``skipped_nonfinite``
    (fp16: the scaler skipped the optimizer step because of inf/NaN gradients).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: Any,
        *,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        normalize: Normalize = "mean",
        scaler: torch.amp.GradScaler | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if normalize not in ("mean", "tokens"):
            raise ValueError(f"normalize must be 'mean' or 'tokens', got {normalize!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.accumulation_steps = int(plan.accumulation_steps)
        if self.accumulation_steps < 1:
            raise ValueError("plan.accumulation_steps must be >= 1")
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.normalize: Normalize = normalize
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.precision: str = getattr(plan, "precision", "fp32")
        # Under the engine's mixed-precision policy (FSDP2 MixedPrecisionPolicy) parameters
        # are already in the compute dtype: no autocast on top.
        mixed = getattr(plan, "mixed_precision", "autocast")
        self.autocast_dtype = None if mixed == "params" else _AUTOCAST_DTYPES.get(self.precision)
        if scaler is None and self.precision == "fp16" and self.device.type == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        self.scaler = scaler
        self.optimizer_steps = 0
        self.tokens_in_effective_batch: int | None = None
        """Set before the first micro-batch of an effective batch (``"tokens"`` mode), or
        pass ``tokens_in_effective_batch=`` to ``step``. Cleared after every optimizer step."""
        self._reset_effective_batch()

    # -- public ---------------------------------------------------------------------------

    def step(
        self,
        batch: Any,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        *,
        tokens_in_effective_batch: int | None = None,
    ) -> dict[str, Any]:
        """Forward and backward of one micro-batch; finishes the effective batch on every
        ``accumulation_steps``-th call. See the class docstring for the metrics."""
        first = self._micro == 0
        if tokens_in_effective_batch is not None:
            if not first and int(tokens_in_effective_batch) != self.tokens_in_effective_batch:
                raise BadInputError(
                    f"tokens_in_effective_batch changed in the middle of an effective batch "
                    f"({self.tokens_in_effective_batch} then {tokens_in_effective_batch}).",
                    hint="Give the same count (or none) for every micro-batch of one step.",
                )
            self.tokens_in_effective_batch = int(tokens_in_effective_batch)
        if first and self.normalize == "tokens":
            self._token_scale = self._start_token_normalisation()

        self._micro += 1
        last = self._micro == self.accumulation_steps
        batch = move_to_device(batch, self.device)
        size = samples_in(batch, getattr(self.plan, "micro_batch_size", None))
        self._samples += size or 0

        sync = contextlib.nullcontext()
        if not last and callable(getattr(self.model, "no_sync", None)):
            sync = self.model.no_sync()
        with sync:
            with self._autocast():
                out = loss_fn(self.model, batch)
            loss = self._scaled_loss(out)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()

        metrics = self._metrics()
        if last:
            metrics.update(self._finish_effective_batch())
        return metrics

    __call__ = step

    def accumulate(
        self,
        micro_batches: Iterable[Any],
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        *,
        count_tokens: Callable[[Any], Any] | None = None,
    ) -> dict[str, Any]:
        """Run one whole effective batch: exactly ``accumulation_steps`` micro-batches, then
        the optimizer step. In ``"tokens"`` mode ``count_tokens(batch)`` gives each
        micro-batch's token count, summed up front. Returns the last step's metrics."""
        if self._micro != 0:
            raise BadInputError(
                f"accumulate() called in the middle of an effective batch "
                f"({self._micro} of {self.accumulation_steps} micro-batches done with step())."
            )
        batches = list(micro_batches)
        if len(batches) != self.accumulation_steps:
            raise BadInputError(
                f"accumulate() got {len(batches)} micro-batches; the plan accumulates "
                f"{self.accumulation_steps}."
            )
        total = None
        if self.normalize == "tokens":
            if count_tokens is None:
                raise BadInputError(
                    "normalize='tokens' needs the token count of the effective batch up front.",
                    hint="Pass count_tokens=lambda batch: <tokens in batch> to accumulate().",
                )
            total = sum(int(count_tokens(b)) for b in batches)
        metrics: dict[str, Any] = {}
        for batch in batches:
            metrics = self.step(batch, loss_fn, tokens_in_effective_batch=total)
        return metrics

    # -- internals ------------------------------------------------------------------------

    def _reset_effective_batch(self) -> None:
        self._micro = 0
        self._samples = 0
        self._loss_sum = 0.0  # Σ micro losses ("mean") or Σ token losses ("tokens")
        self._tokens_seen = 0
        self._last_micro_loss = math.nan
        self._token_scale = 1.0

    def _world_size(self) -> int:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    def _start_token_normalisation(self) -> float:
        total = self.tokens_in_effective_batch
        if total is None:
            raise BadInputError(
                "normalize='tokens' needs the token count of the whole effective batch before "
                "its first backward.",
                hint="Pass tokens_in_effective_batch=N on the first micro-batch, or use "
                "accumulate(micro_batches, loss_fn, count_tokens=...).",
            )
        world = self._world_size()
        if world > 1:  # normalise by the global count; DDP averages gradients over ranks
            count = torch.tensor([float(total)], device=self.device)
            torch.distributed.all_reduce(count)
            global_total = float(count.item())
        else:
            global_total = float(total)
        if global_total <= 0:
            raise BadInputError(f"tokens_in_effective_batch must be positive, got {total}.")
        return world / global_total

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _scaled_loss(self, out: Any) -> torch.Tensor:
        if self.normalize == "mean":
            loss = _scalar_loss(out, "loss_fn")
            self._last_micro_loss = float(loss.detach())
            self._loss_sum += self._last_micro_loss
            return loss / self.accumulation_steps
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise BadInputError(
                f"With normalize='tokens', loss_fn must return (sum_of_token_losses, n_tokens), "
                f"got {type(out).__name__}."
            )
        loss_sum = _scalar_loss(out[0], "loss_fn (sum of token losses)")
        n_tokens = int(out[1])
        self._tokens_seen += n_tokens
        value = float(loss_sum.detach())
        self._loss_sum += value
        self._last_micro_loss = value / n_tokens if n_tokens else math.nan
        return loss_sum * self._token_scale

    def _metrics(self) -> dict[str, Any]:
        if self.normalize == "tokens":
            running = self._loss_sum / self._tokens_seen if self._tokens_seen else math.nan
        else:
            running = self._loss_sum / self._micro
        metrics: dict[str, Any] = {
            "loss": running,
            "micro_loss": self._last_micro_loss,
            "micro_step": self._micro,
            "accumulation_steps": self.accumulation_steps,
            "stepped": False,
            "optimizer_steps": self.optimizer_steps,
            "effective_batch": self._samples * self._world_size(),
        }
        if self.normalize == "tokens":
            metrics["tokens"] = self._tokens_seen
        return metrics

    def _finish_effective_batch(self) -> dict[str, Any]:
        if self.normalize == "tokens" and self._tokens_seen != self.tokens_in_effective_batch:
            declared, seen = self.tokens_in_effective_batch, self._tokens_seen
            self.optimizer.zero_grad(set_to_none=True)
            self.tokens_in_effective_batch = None
            self._reset_effective_batch()
            raise BadInputError(
                f"loss_fn reported {seen} tokens in the effective batch, but "
                f"tokens_in_effective_batch was {declared}; the gradients would be mis-scaled, "
                "so they were discarded.",
                hint="Count the same tokens the loss sums over (e.g. labels != -100).",
            )
        out: dict[str, Any] = {"stepped": True}
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        if self.max_grad_norm is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            out["grad_norm"] = float(norm)
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            out["skipped_nonfinite"] = self.scaler.get_scale() < scale_before
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        out["optimizer_steps"] = self.optimizer_steps
        self.tokens_in_effective_batch = None
        self._reset_effective_batch()
        return out
