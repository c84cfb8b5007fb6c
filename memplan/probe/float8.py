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

The scaled matmul itself (``torch._scaled_mm``) runs on cpu in torch 2.13 and has a meta
kernel, so nothing of the step is modelled; without torchao installed the probe refuses
``--precision float8`` and names the package. What the single-process probe cannot run is
FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather``): a plan property, applied by
the memory model to ``Layer.float8_param_bytes`` (memplan.memory.sharding).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.profile.data import Float8

RECIPES = ("tensorwise", "rowwise")
DEFAULT_SKIP = ("output", "lm_head")
"""The output head, as torchtitan leaves it in bf16 (its 9dec370 float8.py converted every
linear but ``output``; 0.3's llama3_405b config passes ``filter_fqns=["lm_head"]``)."""
ALIGNMENT = 16
"""Both dimensions of a converted linear divide by this (float8 tensor cores; torchtitan's
``module_filter_fn``, torchao's ``_auto_filter_for_recipe``)."""


def torchao_float8() -> Any:
    """``torchao.float8``, or a BadInputError naming the package to install."""
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise BadInputError(
            "--precision float8 runs torchao's Float8Linear, and torchao is not installed "
            f"({exc}).",
            hint="pip install torch==2.13.0 torchao==0.18.0 (memplan's 'float8' extra).",
        ) from exc
    return float8


def torchao_version() -> str:
    import torchao

    return str(getattr(torchao, "__version__", ""))


@dataclass(kw_only=True)
class Float8Conversion:
    """What ``convert`` did to one model: the converted linears' names and weights."""

    recipe: str = "tensorwise"
    skip: tuple[str, ...] = DEFAULT_SKIP
    fsdp_float8_all_gather: bool = True
    converted: dict[str, int] = field(default_factory=dict)
    """Converted linear's FQN -> its weight's bytes."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Linear left in the compute dtype -> why."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise BadInputError(
                f"float8 recipe {self.recipe!r} is not one of {', '.join(RECIPES)}."
            )
        if self.recipe != "tensorwise":  # torchao's from_float asserts dynamic tensorwise
            self.fsdp_float8_all_gather = False

    def accepts(self, module: torch.nn.Module, fqn: str) -> bool:
        """torchtitan's filter: not a skipped name, both dimensions divisible by 16."""
        if not isinstance(module, torch.nn.Linear):
            return False
        hit = next((s for s in self.skip if s in fqn or fnmatch.fnmatch(fqn, s)), None)
        if hit is not None:
            self.skipped[fqn] = f"filtered ({hit!r})"
            return False
        if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
            self.skipped[fqn] = (
                f"{module.in_features}x{module.out_features} not divisible by {ALIGNMENT}"
            )
            return False
        self.converted[fqn] = module.weight.numel() * module.weight.element_size()
        return True

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with its accepted linears swapped for torchao's ``Float8Linear`` (in
        place, as torchao swaps them). The single-process probe builds no FSDP weight
        subclass: the float8 all-gather is the memory model's (module docstring)."""
        float8 = torchao_float8()
        self.converted.clear()
        self.skipped.clear()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        return float8.convert_to_float8_training(
            model, module_filter_fn=self.accepts, config=config
        )

    def param_bytes_under(self, prefix: str) -> int:
        """Bytes of the converted weights inside module ``prefix`` ("" : the whole model)."""
        if not prefix:
            return sum(self.converted.values())
        return sum(b for name, b in self.converted.items() if name.startswith(prefix + "."))

    def environment(self) -> Float8:
        return Float8(
            recipe=self.recipe,  # type: ignore[arg-type]
            fsdp_float8_all_gather=self.fsdp_float8_all_gather,
            torchao_version=torchao_version(),
            converted=len(self.converted),
            converted_param_bytes=sum(self.converted.values()),
            skipped=tuple(f"{name}: {why}" for name, why in sorted(self.skipped.items())),
            modelled=(
                "FSDP2 float8 all-gather of the converted weights (torchao "
                "enable_fsdp_float8_all_gather; torchao/float8/fsdp_utils.py "
                "WeightWithDynamicFloat8CastTensor): 1 byte an element gathered, applied "
                "by the memory model",
            )
            if self.fsdp_float8_all_gather
            else (),
        )


def is_float8(tensor: Any) -> bool:
    """A float8 operand: a float8 tensor, or torchao's ``Float8TrainingTensor`` (its dtype is
    the original one; its ``_data`` holds the float8 bits)."""
    if not isinstance(tensor, torch.Tensor):
        return False
    data = getattr(tensor, "_data", tensor)
    return isinstance(data, torch.Tensor) and data.dtype in FLOAT8_DTYPES


FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
