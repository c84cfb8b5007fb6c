"""Linears converted to float8 as torchao converts them (issue 34): the one conversion the
probe (memplan.probe.float8) and verify's ranks (memplan.verify.distributed) both run.

torchao's ``convert_to_float8_training`` (pytorch/ao torchao/float8/float8_linear_utils.py,
read at 36027d8) swaps every ``nn.Linear`` a filter accepts for ``Float8Linear``. The
filter is torchtitan's (components/quantization/utils.py ``module_filter_fn`` at b5bcd76,
and its December 2024 float8.py at 9dec370: ``fqn != "output"``): a linear is converted
unless its fully-qualified name contains a skipped name (the output head: ``output`` in
torchtitan's Llama, ``lm_head`` in transformers' and torchtitan 0.3's) or a dimension is
not divisible by 16 (the float8 tensor cores' rule). On ranks that shard with FSDP2, a
tensorwise plan's weights are all-gathered in float8 (torchao ``Float8LinearConfig
.enable_fsdp_float8_all_gather``), which gloo cannot run (it has no float8 dtype: its
all-gather fails with "Invalid scalar type"), so a CPU run refuses it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
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
    # torchao's import logs a warning per CUDA kernel library it cannot load on a CPU build
    # (torchao/__init__.py) and torch one per Enum it registers: neither is the user's concern.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.ERROR)
        import torchao.float8 as float8
    except ImportError as exc:
        raise BadInputError(
            "--precision float8 runs torchao's Float8Linear, and torchao is not installed "
            f"({exc}).",
            hint="pip install torch==2.13.0 torchao==0.18.0 (memplan's 'float8' extra).",
        ) from exc
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
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

    def convert(self, model: torch.nn.Module, *, gather_in_float8: bool = False) -> torch.nn.Module:
        """``model`` with its accepted linears swapped for torchao's ``Float8Linear`` (in
        place, as torchao swaps them); ``gather_in_float8``: their weights made torchao's
        FSDP2 float8 all-gather subclass (only for ranks about to shard them; the
        single-process probe leaves the all-gather to the memory model)."""
        float8 = torchao_float8()
        self.converted.clear()
        self.skipped.clear()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if gather_in_float8:  # the FSDP2 weight subclass (torchao float8_linear.py from_float)
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        return float8.convert_to_float8_training(
            model, module_filter_fn=self.accepts, config=config
        )

    def param_bytes_under(self, prefix: str) -> int:
        """Bytes of the converted weights inside module ``prefix`` ("" : the whole model)."""
        if not prefix:
            return sum(self.converted.values())
        return sum(b for name, b in self.converted.items() if name.startswith(prefix + "."))

    def environment(self, *, meta_clock: bool = False) -> Float8:
        """The profile's record of the conversion; ``meta_clock``: the probe's times are a
        roofline's, on which the casts are charged as compiled (memplan.probe.float8)."""
        modelled = []
        if self.fsdp_float8_all_gather:
            modelled.append(
                "FSDP2 float8 all-gather of the converted weights (torchao "
                "enable_fsdp_float8_all_gather; torchao/float8/fsdp_utils.py "
                "WeightWithDynamicFloat8CastTensor): 1 byte an element gathered, applied "
                "by the memory model"
            )
        if meta_clock:
            modelled.append(
                "the dynamic float8 casts' time, as torch.compile fuses them: the "
                "high-precision tensor read twice, the float8 bits written once (torchtitan "
                "components/quantization/float8.md); their bytes are eager torchao's"
            )
        return Float8(
            recipe=self.recipe,  # type: ignore[arg-type]
            fsdp_float8_all_gather=self.fsdp_float8_all_gather,
            torchao_version=torchao_version(),
            converted=len(self.converted),
            converted_param_bytes=sum(self.converted.values()),
            skipped=tuple(f"{name}: {why}" for name, why in sorted(self.skipped.items())),
            modelled=tuple(modelled),
        )


def convert_for_plan(
    net: torch.nn.Module, plan: Any, device: torch.device, *, reference: bool = False
) -> None:
    """The plan's float8 conversion on a rank's model, before it is sharded (nothing for a
    plan without float8); ``reference``: a model that is not sharded (the gradient check's
    single-process reference). A plan that gathers in float8 on a CPU (gloo) is refused."""
    if plan.float8 is None:
        return
    gather = plan.float8.fsdp_float8_all_gather and plan.strategy == "fsdp" and not reference
    if gather:
        refuse_float8_gather(plan, device)
    Float8Conversion(
        recipe=plan.float8.recipe, fsdp_float8_all_gather=plan.float8.fsdp_float8_all_gather
    ).convert(net, gather_in_float8=gather)


def refuse_float8_gather(plan: Any, device: torch.device) -> None:
    """A BadInputError for a plan that gathers float8 weights under FSDP2 on a CPU."""
    float8 = plan.float8
    gather = float8 is not None and float8.fsdp_float8_all_gather and plan.strategy == "fsdp"
    if gather and device.type != "cuda":
        raise BadInputError(
            "The plan all-gathers float8 weights under FSDP2 (fsdp_float8_all_gather), and "
            "gloo, the CPU backend, has no float8 dtype (its all-gather fails with 'Invalid "
            "scalar type').",
            hint="Verify on CUDA, or probe again with --no-float8-all-gather and verify "
            "that plan on the CPU (the float8 linears run; weights are gathered in bf16).",
        )
