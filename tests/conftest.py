"""Test-session setup: torchvision importable beside the CPU torch build, as memplan's own
loader makes it for model files (transformers, timm and peft import it)."""

from memplan.model.loader import settle_torchvision

settle_torchvision()
