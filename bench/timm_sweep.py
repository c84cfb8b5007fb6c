"""Meta equals cpu across timm's model families: the differential sweep for timm.

One model of each of 39 timm modules (a family: ResNet, ConvNeXt, ViT, Swin, MaxViT,
EfficientFormer, …; ``MODULES`` in bench/timm_sweep.py), its smallest by name (``atto``, ``pico``, ``nano``, ``tiny``,
``small`` first), built with ``timm.create_model(name, pretrained=False, num_classes=10)``
and probed on ``cpu`` and on ``meta`` at micro-batches 2 and 4 (a batch of 1 leaves some
families' pooled BatchNorm one value a channel) through a model file as a user writes one,
at 96 × 96 images, or the model's own input size where it is fixed (ViTs, Swin, MaxViT),
up to 150 M parameters. The bar: the meta profile equals the cpu profile in every byte
field, or meta fails with exit 3 naming the op. Raw rows:
``bench/results/<device>-timm-sweep.csv``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import vision_sweep

MICRO_BATCHES = (2, 4)
MODULES = (
    "resnet", "efficientnet", "convnext", "vision_transformer", "deit", "swin_transformer",
    "mobilenetv3", "regnet", "mobilevit", "levit", "maxxvit", "edgenext", "fastvit",
    "efficientformer", "convmixer", "eva", "xcit", "crossvit", "pvt_v2", "tiny_vit",
    "nfnet", "rexnet", "ghostnet", "hrnet", "dla", "densenet", "res2net", "resnest",
    "cspnet", "byobnet", "vovnet", "inception_v3", "mlp_mixer", "coat", "twins", "cait",
    "repvit", "hgnet", "efficientvit_mit",
)  # fmt: skip
SMALL = ("atto", "femto", "pico", "nano", "tiny", "small", "xxs", "xs", "s", "b0", "18")

MODEL_FILE = '''"""timm {name} (no weights, 10 classes) on {size} x {size} images."""

import timm
import torch
import torch.nn.functional as F


def build_model():
    torch.manual_seed(0)
    return timm.create_model({name!r}, pretrained=False, num_classes=10)


def make_batch(b):
    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, 3, {size}, {size}, generator=g)
    return x, torch.randint(0, 10, (b,), generator=g)


def training_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
'''


def _timm() -> Any:
    from memplan.model.loader import settle_torchvision

    settle_torchvision()  # timm imports torchvision (memplan.model.loader says why)
    import timm

    return timm


def smallest(module: str) -> str | None:
    """The module's model whose name says it is smallest (``SMALL``, in order), else its
    shortest name; None when the module has none."""
    names = _timm().list_models(module=module)

    def rank(name: str) -> tuple[int, int]:
        parts = name.replace(".", "_").split("_")
        for i, word in enumerate(SMALL):
            if word in parts or (
                len(word) > 2 and any(p.startswith(word) or p.endswith(word) for p in parts)
            ):
                return i, len(name)
        return len(SMALL), len(name)

    return min(names, key=rank) if names else None


def image_size(name: str) -> int:
    """96, or the model's own input size where it is fixed (its pretrained config)."""
    config = _timm().get_pretrained_cfg(name)
    if config is None or not config.input_size:
        return 96
    return config.input_size[-1] if getattr(config, "fixed_input_size", False) else 96


def probe_one(name: str, folder: str) -> dict[str, Any]:
    size = image_size(name)
    path = Path(folder) / f"timm_{name.replace('.', '_')}.py"
    path.write_text(MODEL_FILE.format(name=name, size=size))
    return vision_sweep.probe_file(name, str(path), MICRO_BATCHES)


def run(device: str) -> str:
    if device != "cpu":
        return "### Meta equals cpu across timm's models\n\nA CPU-only section.\n"
    names = [n for n in (smallest(m) for m in MODULES) if n]
    return vision_sweep.swept(
        names, device, probe_one, library="timm", doc=__doc__, csv_name="timm-sweep"
    )[1]
