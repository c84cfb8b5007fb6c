"""Float8 training as torchao converts a model (``probe --precision float8``, issue 34).

torchao's ``convert_to_float8_training`` (pytorch/ao torchao/float8/float8_linear_utils.py,
read at 36027d8) swaps every ``nn.Linear`` a filter accepts for ``Float8Linear``. memplan
runs that conversion itself, on cpu and on meta alike, with the filter torchtitan uses
(torchtitan components/quantization/utils.py ``module_filter_fn`` at b5bcd76, and its
December 2024 float8.py at 9dec370: ``fqn != "output"``): a linear is converted unless its
fully-qualified name contains one of the skipped names (the output head, ``output`` in
torchtitan's Llama, ``lm_head`` in transformers' and torchtitan 0.3's) or a dimension is
not divisible by 16 (the float8 tensor cores' rule).

What the conversion does to memory and time is then measured, not assumed, because the
probe runs torchao's own ``Float8Linear`` (torchao/float8/float8_linear.py
``matmul_with_hp_or_float8_args``):

* saved for backward: the linear's input and weight **in high precision** (``ctx.
  save_for_backward(input_hp, weight_hp_t)``); the float8 casts and their scales are made
  in forward, used by the matmul, freed, and made again in backward. So in eager mode a
  converted linear keeps what a bf16 one keeps (a compiled step may let the partitioner
  keep the casts instead: memplan models eager);
* transient: each dynamic cast (``hp_tensor_to_float8_dynamic``: amax, an fp32 copy scaled
  and clamped, the float8 result), eager, as the tracker sees it;
* time: the matmuls on float8 operands at the device spec's float8 peak
  (memplan.probe.tracker), the casts as the memory-bound ops they are.

The conversion itself is memplan.run.float8's (verify's ranks run the same one). The scaled
matmul itself (``torch._scaled_mm``) runs on cpu in torch 2.13 and has a meta
kernel, so nothing of the step is modelled; without torchao installed the probe refuses
``--precision float8`` and names the package. What the single-process probe cannot run is
FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather``): a plan property, applied by
the memory model to ``Layer.float8_param_bytes`` (memplan.memory.sharding).
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.run.float8 import DEFAULT_SKIP, RECIPES, Float8Conversion

__all__ = [
    "DEFAULT_SKIP",
    "FLOAT8_DTYPES",
    "RECIPES",
    "Float8Conversion",
    "float8_bits",
    "is_float8",
]


def float8_bits(tensor: torch.Tensor) -> Any:
    """What holds a tensor's elements: torchao's ``Float8TrainingTensor`` keeps its float8
    bits in ``_data`` (its own dtype is the original one); any other tensor itself."""
    return getattr(tensor, "_data", tensor)


def is_float8(tensor: Any) -> bool:
    """A float8 operand: a float8 tensor, or torchao's ``Float8TrainingTensor``."""
    if not isinstance(tensor, torch.Tensor):
        return False
    data = float8_bits(tensor)
    return isinstance(data, torch.Tensor) and data.dtype in FLOAT8_DTYPES


FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def fused_cast_seconds(roofline: Any, hp: torch.Tensor) -> float:
    """One dynamic float8 cast as torch.compile runs it: the amax read and the scaled cast
    fused into kernels that read the high-precision tensor twice and write its float8 bits
    once (torchtitan components/quantization/float8.md: "torch.compile fuses the float8
    scaling/casting kernels", and requires it "for competitive performance")."""
    n = hp.numel()
    return roofline.seconds(0.0, 2 * n * hp.element_size() + n, None)


def time_casts_fused() -> None:
    """On a meta probe's clock, charge each of torchao's dynamic casts
    (``hp_tensor_to_float8_dynamic``, as float8_linear.py calls it) as compiled (see
    ``fused_cast_seconds``), not as the eager ops it runs: the bytes stay the eager ones
    (measured, an upper bound on the compiled step's). Trackers without a roofline (cpu,
    cuda: real clocks) are untouched. Installed once per process, where torchao's linear
    looks the function up."""
    import torchao.float8.float8_linear as linear
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    cast = linear.hp_tensor_to_float8_dynamic
    if getattr(cast, "memplan_fused", False):
        return

    def timed(hp_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        clocks = [
            (mode, mode.virtual_seconds)
            for mode in _get_current_dispatch_mode_stack()
            if getattr(mode, "roofline", None) is not None
        ]
        out = cast(hp_tensor, *args, **kwargs)
        for mode, before in clocks:
            mode.virtual_seconds = before + fused_cast_seconds(mode.roofline, hp_tensor)
        return out

    timed.memplan_fused = True  # type: ignore[attr-defined]
    linear.hp_tensor_to_float8_dynamic = timed
