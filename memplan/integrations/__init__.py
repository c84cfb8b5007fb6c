"""memplan inside the training script a user already has (issue 32): the wing above the
torch wings, beside ``run/``.

* ``api``: ``plan_model`` plans a live ``nn.Module`` (or a factory) with a batch or a batch
  function, an optional loss function and optimizer, and the request of ``memplan solve``;
  it probes a copy, so the model, its optimizer and the RNG states are left as they were.
* ``hf``: ``plan_trainer(trainer, ...)`` sets a Hugging Face Trainer's per-device batch,
  gradient-accumulation steps and checkpointing from the plan (Trainer and its subclasses).
* ``lightning``: ``MemplanBatchSize``, a callback in the style of ``BatchSizeFinder``.
* ``accelerate``: ``accelerator_kwargs(plan)`` and ``prepare_model(model, plan)`` for
  ``Accelerator(gradient_accumulation_steps=...)`` with ``memplan.apply``.

The frameworks are optional: nothing here is imported by ``import memplan``, and each
module that needs one says which extra installs it (``require``). Names are loaded on first
use, so ``memplan.integrations`` itself imports no torch.
"""

from __future__ import annotations

from memplan.lazy import loader

_HOMES = {
    "plan_model": "api",
    "profile_model": "api",
    "plan_trainer": "hf",
    "MemplanBatchSize": "lightning",
    "accelerator_kwargs": "accelerate",
    "prepare_model": "accelerate",
}

__all__ = sorted(_HOMES)


__getattr__ = loader(__name__, _HOMES)
