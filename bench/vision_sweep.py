"""Meta equals cpu across torchvision's models: the differential sweep for vision.

Every classification model torchvision lists (``torchvision.models.list_models``) and its
semantic-segmentation models, built from their builders with no weights and 10 classes, up
to 150 M parameters, is probed on ``cpu`` and on ``meta`` at micro-batches 1 and 2 through a
model file as a user writes one: 96 × 96 images (a transformer's ``image_size`` set to
32, 28 for a 14-pixel patch; 160 for Inception-v3, whose last stage is 1 × 1 at 96 and
BatchNorm refuses one value a channel; 224 for MaxViT, whose partitions need it), the
cross-entropy of the logits (a segmentation model's ``out``); DeepLabV3 at micro-batches 2
and 4, its ASPP pooling branch holding one value a channel at any size for a batch of 1.
The bar: the meta profile equals
the cpu profile in every byte field (layers, fixed parts, totals, the optimizer step, every
timeline point), or meta fails with exit 3 naming the op. Raw rows:
``bench/results/<device>-vision-sweep.csv``."""

from __future__ import annotations

import csv
import multiprocessing
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.hf_sweep import meta_against_cpu

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MICRO_BATCHES = (1, 2)
WORKERS = 2
MAX_PARAMETERS = 150_000_000
SEGMENTATION = ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")

MODEL_FILE = '''"""torchvision {name} (no weights, 10 classes) on {size} x {size} images."""

import sys
import types

# PyPI's torchvision registers meta kernels for CUDA ops the CPU build of torch lacks
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("m"))

import torch
import torch.nn.functional as F
import torchvision


def build_model():
    torch.manual_seed(0)
    return torchvision.models.get_model({name!r}, weights=None, num_classes=10{extra})


def make_batch(b):
    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, 3, {size}, {size}, generator=g)
    return x, torch.randint(0, 10, {target}, generator=g)


def training_loss(model, batch):
    x, y = batch
    out = model(x)
    if isinstance(out, dict):  # segmentation: the main head's logits
        out = out["out"]
    return F.cross_entropy(out, y)
'''


def settings(name: str) -> tuple[int, str]:
    """(image size, extra builder arguments) for ``name`` (module docstring)."""
    if name.startswith("vit_"):
        return 32, f", image_size={28 if name.endswith('_14') else 32}"
    if name == "inception_v3":
        return 160, ", aux_logits=False, init_weights=False"
    if name == "googlenet":
        return 96, ", aux_logits=False, init_weights=False"
    if name.startswith("maxvit"):
        return 224, ""
    if name in SEGMENTATION:
        return 96, ", weights_backbone=None, aux_loss=False"
    return 96, ""


def micro_batches(name: str) -> tuple[int, int]:
    """The sizes probed: 2 and 4 for DeepLabV3 (module docstring), else MICRO_BATCHES."""
    return (2, 4) if name.startswith("deeplabv3") else MICRO_BATCHES


def model_file(folder: Path, name: str) -> Path:
    size, extra = settings(name)
    target = f"(b, {size}, {size})" if name in SEGMENTATION else "(b,)"
    path = folder / f"tv_{name}.py"
    path.write_text(MODEL_FILE.format(name=name, size=size, extra=extra, target=target))
    return path


def models() -> list[str]:
    import sys
    import types

    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("m"))
    import torchvision

    return [*torchvision.models.list_models(module=torchvision.models), *SEGMENTATION]


def probe_one(name: str, folder: str) -> dict[str, Any]:
    """One model's row: ``status`` is equal, differs, meta-fails, cpu-fails, crash or skip."""
    return probe_file(name, str(model_file(Path(folder), name)), micro_batches(name))


def probe_file(name: str, path: str, sizes: tuple[int, int]) -> dict[str, Any]:
    """The row of the model file ``path`` (``name`` in the table), probed at ``sizes``."""
    warnings.filterwarnings("ignore")
    from memplan.model.loader import load_model_file
    from memplan.probe.backends import build_on_meta

    row: dict[str, Any] = {"model": name, "status": "", "detail": ""}
    try:  # counted on meta: a 600 M-parameter model allocates nothing
        built = build_on_meta(load_model_file(path))
    except Exception as exc:
        return {**row, "status": "skip", "detail": f"{type(exc).__name__}: {exc}"[:160]}
    row["params"] = sum(p.numel() for p in built.parameters())
    if row["params"] > MAX_PARAMETERS:
        return {**row, "status": "skip", "detail": f"{row['params'] / 1e6:.0f} M parameters"}
    return meta_against_cpu(row, path, sizes, bytes_only=False)


def _probe(args: tuple[Callable[[str, str], dict[str, Any]], str, str]) -> dict[str, Any]:
    probe, name, folder = args
    row = probe(name, folder)
    print(f"{row['model']:30} {row['status']:10} {row['detail'][:90]}", flush=True)
    return row


def sweep(
    names: list[str],
    workers: int = WORKERS,
    probe: Callable[[str, str], dict[str, Any]] = probe_one,
) -> list[dict[str, Any]]:
    """Every name's row from ``probe(name, folder)`` (a module-level function: the workers
    are spawned), one model a task."""
    with tempfile.TemporaryDirectory(prefix="memplan-vision-") as folder:
        jobs = [(probe, name, folder) for name in names]
        if workers <= 1:
            return [_probe(job) for job in jobs]
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, maxtasksperchild=4) as pool:
            return list(pool.imap(_probe, jobs))


def swept(
    names: list[str],
    device: str,
    probe: Callable[[str, str], dict[str, Any]] = probe_one,
    **how: Any,
) -> tuple[list[dict[str, Any]], str]:
    """The rows of the names ``MEMPLAN_SWEEP_ONLY`` keeps (all when unset), and their
    section (``report``'s keywords in ``how``). Shared by the vision, timm and peft sweeps."""
    only = set(filter(None, os.environ.get("MEMPLAN_SWEEP_ONLY", "").split(",")))
    started = time.perf_counter()
    rows = sweep([name for name in names if not only or name in only], probe=probe)
    return rows, report(rows, time.perf_counter() - started, device, **how)


def run(device: str) -> str:
    if device != "cpu":
        return "### Meta equals cpu across torchvision's models\n\nA CPU-only section.\n"
    return swept(models(), device)[1]


def report(
    rows: list[dict[str, Any]],
    seconds: float,
    device: str = "cpu",
    *,
    library: str = "torchvision",
    doc: str = __doc__,
    csv_name: str = "vision-sweep",
    noun: str = "models",
) -> str:
    RESULTS.mkdir(parents=True, exist_ok=True)
    names = ["model", "status", "detail", "params", "cpu_seconds", "meta_seconds"]
    with open(RESULTS / f"{device}-{csv_name}.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    probed = [r for r in rows if r["status"] != "skip"]
    equal = [r for r in probed if r["status"] == "equal"]
    others = [r for r in probed if r["status"] != "equal"]
    skipped = [r for r in rows if r["status"] == "skip"]
    out = [
        f"### Meta equals cpu across {library}'s {noun}\n",
        doc.split("\n\n")[1].replace("\n", " ") + "\n",
        f"**{len(equal)} of {len(probed)} {noun} equal** on meta and cpu ({library} "
        f"{metadata.version(library)}; sweep wall time {seconds:.0f} s, {WORKERS} "
        "processes).\n",
    ]
    if others:
        out += ["| model | status | detail |", "| --- | --- | --- |"]
        out += [f"| {r['model']} | {r['status']} | {r['detail']} |" for r in others]
        out.append("")
    if skipped:
        out.append(
            f"Over {MAX_PARAMETERS / 1e6:.0f} M parameters, or not built, not probed here: "
            + ", ".join(f"{r['model']} ({r['detail']})" for r in skipped)
            + ".\n"
        )
    return "\n".join(out)
