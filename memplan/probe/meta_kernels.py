"""Meta kernels for ops whose PyTorch meta kernel refuses what the CPU kernel runs, and
FLOP formulas that ``torch.utils.flop_counter`` lacks.

``aten._grouped_mm`` (mixture-of-experts layers: transformers' ``integrations/moe.py``
multiplies each expert's tokens by its weights in one call) has a meta kernel that checks
the CUDA kernel's constraints: bfloat16 inputs only, 16-byte aligned strides
(torch/_meta_registrations.py ``_meta_grouped_mm_common``). The CPU kernel takes float32,
so a float32 Mixtral runs on cpu and stopped the meta probe. Its result is a function of
shapes alone (``grouped_mm_meta``, the output sizes of ``_create_grouped_mm_output_tensor``
there), so the meta probe makes it itself, contiguous as the CPU kernel's.

Its FLOPs (``grouped_mm_flops``): each output element is a dot product over the
contraction dimension K, two FLOPs per term. With a 2-D ``mat_a`` (tokens × K) and a 3-D
``mat_b`` (experts × K × N), every token row meets one expert: 2 · tokens · K · N. With two
2-D operands (a weight gradient: K split into groups by ``offs``) the output is
(groups × M × N) and each group contracts its own slice of K: 2 · M · N · K in all.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten


def grouped_mm_meta(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm`` on meta for any floating dtype: its output, contiguous."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        groups = offs.size(0) if offs is not None else 1
        size = (groups, mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        size = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        size = (mat_a.size(1), mat_b.size(1))
    else:
        size = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def grouped_mm_flops(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """FLOPs of one ``aten._grouped_mm`` call (module docstring)."""
    contraction = mat_a.shape[-1]
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # K split among the groups of the output
        return 2 * mat_a.shape[0] * mat_b.shape[1] * contraction
    return 2 * out_val.numel() * contraction


CONV_TARGET: ContextVar[str] = ContextVar("memplan_conv_target", default="cpu")
"""The device whose convolution layout the meta probe follows: ``cpu`` or ``cuda`` (the
backend sets it with the attention target, for the step)."""


def _suggested_format(t: torch.Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last when ``t`` is laid out so and not
    plainly contiguous, else contiguous."""
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    if channels_last and not t.is_contiguous() and t.is_contiguous(memory_format=channels_last):
        return channels_last
    return torch.contiguous_format


def _cpu_conv_format(input: torch.Tensor, weight: torch.Tensor, args: tuple) -> Any:
    """What the CPU's convolution lays its output out as, asked of PyTorch's own backend
    choice (``_select_conv_backend``, ``_conv_determine_backend_memory_format``, as
    FakeTensor's ``conv`` asks) for CPU stand-ins of the same sizes and strides (never
    written, so their pages are never touched)."""
    bias, stride, padding, dilation, transposed, output_padding, groups = args

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype)

    with _disable_current_modes():
        x, w = stand_in(input), stand_in(weight)
        backend = torch._C._select_conv_backend(
            x,
            w,
            stride=stride,
            padding=padding,
            dilation=dilation,
            transposed=transposed,
            output_padding=output_padding,
            groups=groups,
            bias=None if bias is None else stand_in(bias),
        )
        if w.dim() == 3:  # 1-d: the backend decides on the 2-d form
            x, w = x.contiguous().unsqueeze(2), w.unsqueeze(2)
        return torch._C._conv_determine_backend_memory_format(x, w, backend)


def convolution_meta(input: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    """``aten.convolution`` on meta, laid out as the target device's kernel lays it out.
    PyTorch's meta ``convolution`` returns contiguous, having no device to ask, so a model
    that feeds a convolution a transposed view (SegFormer's and PVTv2's depthwise
    convolution after ``transpose(1, 2).view(...)``) copied on meta where the CPU takes a
    view. On a CPU target PyTorch's backend choice is asked (:func:`_cpu_conv_format`); on
    a CUDA target cuDNN's rule applies: channels-last when the input or the weight is
    (``cudnn_conv_suggest_memory_format``; the rule PyTorch's meta kernel applies to
    ``convolution_backward``)."""
    out = aten.convolution.default(input, weight, *args)
    if out.dim() not in (4, 5):
        return out
    if CONV_TARGET.get() == "cpu":
        layout = _cpu_conv_format(input, weight, args)
    else:  # input and weight have the output's rank: one channels-last format at most
        layout = max(_suggested_format(input), _suggested_format(weight), key=_is_channels_last)
    if not _is_channels_last(layout) or out.dim() != (5 if layout == torch.channels_last_3d else 4):
        return out
    return torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=layout)


def _is_channels_last(layout: torch.memory_format) -> bool:
    return layout in (torch.channels_last, torch.channels_last_3d)


def layer_norm_backward_meta(*args: Any) -> tuple:
    """``aten.native_layer_norm_backward`` on meta with the input gradient contiguous, as
    the CPU and CUDA kernels make it (``empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``
    of the contiguous input); PyTorch's meta kernel keeps the input's strides, so a layer
    norm of a permuted view (PVTv2's) copied the gradient on meta before the next view."""
    grads = aten.native_layer_norm_backward.default(*args)
    grad_input = grads[0]
    if grad_input is None or grad_input.is_contiguous():
        return grads
    fresh = torch.empty(grad_input.shape, dtype=grad_input.dtype, device=grad_input.device)
    return (fresh, *grads[1:])


def rnn_notes(model: torch.nn.Module) -> list[str]:
    """The meta probe's warning for a model with recurrent layers (``nn.LSTM``, ``nn.GRU``,
    ``nn.RNN``). Their kernels save workspaces of the library's own sizes: cuDNN's reserve
    space on cuda, oneDNN's workspace on cpu (``mkldnn_rnn_layer``). PyTorch's meta kernels
    leave both at 0 bytes (torch/_meta_registrations.py, ``_cudnn_rnn``: "TODO: Query
    cudnnGetRNNTrainingReserveSize"), and a meta input takes neither path, so meta runs
    PyTorch's generic RNN, one matmul a step, whose saved bytes are neither device's.
    Empty when the model has none."""
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.RNNBase)]
    if not names:
        return []
    shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
    return [
        f"{len(names)} recurrent layer(s) ({shown}) measured on meta as PyTorch's generic "
        "RNN kernel: cuDNN (cuda) and oneDNN (cpu) keep workspaces whose size meta cannot "
        "know, so these layers' saved and transient bytes are not either device's. Probe "
        "with --device cpu or cuda for their exact bytes"
    ]


_SAME_DTYPE = {
    aten.mm.default: ("mat1", "mat2"),
    aten.addmm.default: (None, "mat1", "mat2"),
    aten.bmm.default: ("batch1", "batch2"),
    aten.baddbmm.default: ("input", "batch1", "batch2"),
    aten.addbmm.default: (None, "batch1", "batch2"),
    aten.mv.default: ("mat", "vec"),
    aten.addmv.default: ("input", "mat", "vec"),
    aten.dot.default: ("self", "tensor"),
    aten.vdot.default: ("self", "tensor"),
    aten.convolution.default: ("input", "weight"),
}
"""Ops whose operands (by position; None: not checked) must share one dtype on cpu and
cuda, with their names in the refusal. PyTorch's meta kernels of ``mm``, ``addmm``,
``addbmm``, ``mv`` and ``convolution`` (without a bias) do not check it, so a float64 or
int64 batch into a float32 ``nn.Linear`` ran on meta and wrote a profile of a model that
cannot run; the others' meta kernels refuse it, which the tracker reported as the meta
probe's limit (exit 3).
``addmm``'s bias is left out: CUDA may add an fp32 bias to a bf16 product."""


def refuse_mixed_dtypes(func: Any, args: tuple) -> None:
    """Raise RuntimeError, as cpu does, naming ``func`` and the operands' dtypes when
    ``func`` is one of ``_SAME_DTYPE`` and its operands differ in dtype: the model's error
    (the tracker calls this outside its handling of memplan's own failures). Tensor
    subclasses (torchao's float8 tensors, which carry their high-precision dtype) and
    float8 operands (whose ``_scaled_mm`` takes scales of another dtype) are left to their
    own kernels."""
    names = _SAME_DTYPE.get(func)
    if names is None:
        return
    operands = [
        (name, arg)
        for name, arg in zip(names, args, strict=False)
        if name is not None and isinstance(arg, torch.Tensor)
    ]
    if any(
        type(t) is not torch.Tensor or (t.dtype.itemsize == 1 and t.is_floating_point())
        for _, t in operands
    ):
        return
    if len({t.dtype for _, t in operands}) > 1:
        said = " and ".join(name for name, _ in operands)
        got = " and ".join(str(t.dtype) for _, t in operands)
        raise RuntimeError(
            f"{func}: {said} must have the same dtype, but got {got} (cpu and cuda refuse it too)"
        )


META_KERNELS = {
    aten._grouped_mm.default: grouped_mm_meta,
    aten.convolution.default: convolution_meta,
    aten.native_layer_norm_backward.default: layer_norm_backward_meta,
}
"""Meta kernels used instead of PyTorch's (meta probes only)."""

REFUSAL_HINTS = {
    aten._pack_padded_sequence.default: (
        "pack_padded_sequence takes its lengths on the CPU, on cuda as on meta: pass "
        "lengths.cpu() (memplan's batch puts every tensor on the probed device)."
    ),
}
"""Hints for a meta probe's refusal of an op that cuda refuses alike (the fix is the
model's), instead of "probe with --device cpu"."""

FLOP_FORMULAS = {aten._grouped_mm: grouped_mm_flops}
"""Formulas by overload packet, added to torch.utils.flop_counter's."""
