"""Where emitted training scripts import ``wrap_for_plan`` from (``from memplan.wrap import
wrap_for_plan``); the code lives in memplan.run.wrap."""

from memplan.run.wrap import COMPUTE_DTYPES, fsdp_mixed_precision, wrap_for_plan

__all__ = ["COMPUTE_DTYPES", "fsdp_mixed_precision", "wrap_for_plan"]
