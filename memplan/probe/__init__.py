"""The probe: measure a model's memory and time per layer and write a Profile.

The only heavy torch code in memplan. ``probe_model`` measures; ``measure_training_peak``
runs real training steps of a plan-like configuration under the same tracker, so that
predicted and measured peaks come from one instrument.
"""

from __future__ import annotations

from memplan.probe.measure import MeasuredRun, measure_training_peak
from memplan.probe.runner import probe_model

__all__ = ["MeasuredRun", "measure_training_peak", "probe_model"]
