"""Where emitted training scripts import ``wrap_for_plan`` from (``from memplan.wrap import
wrap_for_plan``), and the Lightning config its FSDP units (``memplan.wrap.PlanUnits``); the
code lives in memplan.run.wrap and memplan.run.fsdp1_policy."""

from memplan.run.fsdp1_policy import PlanUnits
from memplan.run.wrap import COMPUTE_DTYPES, fsdp_mixed_precision, wrap_for_plan

__all__ = ["COMPUTE_DTYPES", "PlanUnits", "fsdp_mixed_precision", "wrap_for_plan"]
