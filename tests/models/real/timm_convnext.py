"""timm ``convnext_atto`` (10 classes, no weights) on 64x64 images (activations are the peak): LayerNorm, no BatchNorm,
stochastic depth off (timm's default)."""

import _tv  # noqa: F401  (timm imports torchvision)
import timm
import torch
import torch.nn.functional as F


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 3, 64, 64, generator=g), torch.randint(
        0, 10, (batch_size,), generator=g
    )


def training_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
