"""torchvision ``resnet18`` (10 classes, no weights) on 96x96 images: the activations, not
the optimizer step, are the peak, so a budget halfway between the micro-batch-16 peaks with
every block checkpointed and with none binds (at 64x64 both peaks are the optimizer step's:
188.7 MiB needed, 185.9 MiB usable after solve's 3% margin; 32x32 leaves layer4 at 1x1,
which BatchNorm refuses at micro-batch 1)."""

import _tv  # noqa: F401  (torchvision on the CPU build of torch)
import torch
import torch.nn.functional as F
from torchvision.models import resnet18


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return resnet18(num_classes=10)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 3, 96, 96, generator=g), torch.randint(
        0, 10, (batch_size,), generator=g
    )


def training_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
