"""Where in the model an op was issued, for the meta probe's refusals: a model that meta
cannot run is told which module and line did it (``call_site``), not only the aten op.
Read only when an op fails."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MEMPLAN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NOT_THE_MODEL = (_TORCH_DIR, _MEMPLAN_DIR, "<")


def call_site() -> str:
    """Where the op being dispatched was issued: past memplan's own handlers and torch's
    dispatch, the model's innermost frame, named with the module whose method it is, e.g.
    ``" in SwitchTransformersExperts.forward (…/modeling_switch_transformers.py:174)"``;
    ``" in the backward pass"`` where autograd's engine issued it (its C++ runs backward,
    so no model frame lies between; a Python autograd Function's backward or a checkpoint's
    recompute has its own frames, found first); else ``""``. Read only when an op fails,
    so a refusal says where it is; it never fails itself, which would hide that refusal."""
    try:
        return _walk(sys._getframe(1))
    except Exception:  # a frame it cannot read: the refusal goes out without the place
        return ""


def _walk(frame: Any) -> str:
    """The walk of ``call_site`` from ``frame`` (the caller of the dispatch handler) out."""
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_MODEL):
        if frame.f_code.co_name == "_engine_run_backward":
            return " in the backward pass"  # issued by autograd's engine, no model frame
        frame = frame.f_back  # memplan's handlers and modes, torch's dispatch
    if frame is None:
        return ""
    owner = frame.f_locals.get("self")
    name = frame.f_code.co_name
    if isinstance(owner, torch.nn.Module):
        name = f"{type(owner).__name__}.{name}"
    return f" in {name} ({_short(frame.f_code.co_filename)}:{frame.f_lineno})"


def _short(path: str) -> str:
    """A library's file from its package folder on (``transformers/models/…``), else as is."""
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path
