"""Where a non-finite training loss came from: re-run the forward of the micro-batch that
gave it, with a forward hook on every module, and name the first module (in the order
their forwards finished, so the innermost one) whose output held a NaN or an infinity.
Run with gradients off, outside the tracker: it measures nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _nonfinite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return (
            value.is_floating_point()
            and value.device.type != "meta"
            and not bool(torch.isfinite(value).all())
        )
    if isinstance(value, Mapping):
        return any(_nonfinite(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_nonfinite(v) for v in value)
    return False


def where_nonfinite(
    model: torch.nn.Module, loss: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any
) -> str | None:
    """A phrase saying where the loss of ``batch`` first went non-finite: a module by its
    qualified name and class, the loss computation after the model's forward, or that the
    re-run was finite (the NaN depended on randomness). None when the re-run failed."""
    first: list[tuple[str, str]] = []
    handles = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not first and _nonfinite(output):
                first.append((name, type(module).__name__))

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook_for(name)))
    try:
        with torch.no_grad():
            value = loss(model, batch)
    except Exception:  # a diagnosis only: the probe's own result stands
        return None
    finally:
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.remove()
    if first:
        name, kind = first[0]
        if not name:
            return f"the model's own forward ({kind}) was the first to output NaN or inf"
        return f"the first layer to output NaN or inf was {name} ({kind})"
    if _nonfinite(value):
        return (
            "every module's output was finite: it arose in the loss computation after "
            "the model's forward"
        )
    return "a re-run of that micro-batch was finite (it depends on randomness)"
