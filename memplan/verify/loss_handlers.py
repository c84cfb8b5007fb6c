"""Loss parallel's DTensor handlers seen by memplan's distributed tracker
(memplan.verify.distributed.DistributedTracker): each handler runs with the tracker pushed
again, so its local temporaries are counted as a device's allocator holds them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


def fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no memory: a meta tensor or a ``FakeTensor`` (which reports
    the device it stands for; its storage is on meta)."""
    return tensor.device.type == "meta" or isinstance(tensor, FakeTensor)


class LossHandlers:
    """Loss parallel's DTensor handlers, each wrapped to run under ``tracker``: the module's
    table (``customized_loss_ops``, copied into DTensor's dispatcher when ``loss_parallel()``
    is entered) and whatever of it the dispatcher holds now (entered before the tracker)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.active = False
        """Whether the tracker is active: a wrapped handler that outlives it (copied into
        DTensor's dispatcher by a ``loss_parallel()`` entered inside) runs as it is."""
        self._saved: list[tuple[dict, Any, Any]] = []

    def wrap(self) -> LossHandlers:
        try:
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.parallel import loss
        except ImportError:  # a torch without DTensor: nothing to see into
            return self
        table = getattr(loss, "customized_loss_ops", None)
        handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
        if not isinstance(table, dict):
            return self
        self.active = True
        for target in (table, handlers if isinstance(handlers, dict) else {}):
            for op in table:
                if op in target:
                    self._saved.append((target, op, target[op]))
                    target[op] = self._inside(target[op])
        return self

    def restore(self) -> None:
        self.active = False
        for target, op, handler in reversed(self._saved):
            if op in target:  # loss_parallel() may have left since (it pops its ops)
                target[op] = handler
        self._saved.clear()

    def _inside(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        from torch.utils._python_dispatch import (
            TorchDispatchMode,
            _get_current_dispatch_mode_stack,
        )

        tracker = self.tracker

        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.active or any(
                mode is tracker for mode in _get_current_dispatch_mode_stack()
            ):
                return handler(*args, **kwargs)  # the tracker is on already
            TorchDispatchMode.__enter__(tracker)
            try:
                return handler(*args, **kwargs)
            finally:
                TorchDispatchMode.__exit__(tracker, None, None, None)

        run.__wrapped__ = handler  # type: ignore[attr-defined]
        return run
