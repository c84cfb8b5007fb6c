"""The meta probe's function modes inside torch functions written in Python.

The meta backend emulates autocast (``probe/meta_autocast.py``) and the target's attention
kernels (``probe/meta_attention.py``) with ``TorchFunctionMode``\\ s. A mode is off inside
its own handler: when a torch function written in Python reaches a mode, the calls in its
body reach none of the modes the handler popped. ``F.multi_head_attention_forward`` is
such a function, and it is what ``nn.MultiheadAttention`` runs in training (every
``nn.TransformerEncoderLayer``, torchvision's ViT). Its body projects with ``linear``,
attends with ``scaled_dot_product_attention`` (or ``torch.baddbmm``, ``softmax`` and
``torch.bmm`` when the weights are asked for) and projects again, so on meta its linears
ran in float32 under bf16 autocast and its attention took the math path, saving the
probabilities, where CUDA autocast casts every one of those calls (it works below the
dispatcher, where nothing is popped) and the device runs a fused kernel.

``run_body`` runs such a function's body with the modes outside it: for the call, each of
the calls its body makes that a mode acts on (``BODY_CALLS``) is replaced by one that
enters the whole stack of modes again around the original, and the function itself runs
with the stack popped, so it does not reach the modes a second time. The replacements are
the globals the body reads (``torch.nn.functional``'s ``linear``, ``softmax``,
``scaled_dot_product_attention``; ``torch.bmm``, ``torch.baddbmm``), restored after.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

MHA_FORWARD = F.multi_head_attention_forward

BODY_CALLS: dict[Callable[..., Any], tuple[tuple[Any, str], ...]] = {
    MHA_FORWARD: (
        (sys.modules[F.__name__], "linear"),
        (sys.modules[F.__name__], "softmax"),
        (sys.modules[F.__name__], "scaled_dot_product_attention"),
        (torch, "bmm"),
        (torch, "baddbmm"),
    ),
}
"""For each torch function written in Python whose body makes calls the meta modes act on:
where its body looks those calls up (module, global name)."""


def run_body(
    handler: TorchFunctionMode, func: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """``func(*args, **kwargs)`` (a key of ``BODY_CALLS``), its body's calls under every
    function mode that was active when ``handler`` was given it (module docstring)."""
    stack = [*_get_current_function_mode_stack(), handler]  # bottom first; handler was on top
    saved = [(owner, name, getattr(owner, name)) for owner, name in BODY_CALLS[func]]

    def under_modes(owner: Any, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            # the original in place while it runs: torch finds a function's public API by
            # its name (``torch.bmm``; F.softmax's own handle_torch_function(softmax, ...)),
            # and that must not be this replacement
            setattr(owner, name, original)
            try:
                with contextlib.ExitStack() as modes:
                    for mode in stack:
                        modes.enter_context(mode)
                    return original(*a, **k)
            finally:
                setattr(owner, name, call)

        return call

    for owner, name, original in saved:
        setattr(owner, name, under_modes(owner, name, original))
    try:
        with _popped():
            return func(*args, **kwargs)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def _popped() -> Iterator[None]:
    """Every function mode off the stack for the block, pushed back after in order."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)
