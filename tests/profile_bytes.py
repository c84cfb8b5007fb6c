"""Two profiles compared in every byte field (import as ``from profile_bytes import
assert_meta_equals_cpu``; pytest puts tests/ on the path): the bar for a meta probe is the
cpu probe of the same model, to the byte. And ``write_model``, the model file both probe."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.files.schema import to_data


def _bytes_fields(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each item's name and every ``*_bytes`` field (an int or an affine fit), selective
    savings included, but the TP split (``tp_*``: a separate measurement)."""
    return [
        {
            k: v
            for k, v in item.items()
            if k == "name" or (k.endswith("_bytes") and not k.startswith("tp_"))
        }
        for item in items
    ]


def assert_meta_equals_cpu(cpu: Any, meta: Any) -> None:
    """Every byte field of two profiles: layers, fixed parts, totals, optimizer step and
    every timeline point."""
    for name in ("layers", "fixed"):
        assert _bytes_fields(to_data(getattr(meta, name))) == _bytes_fields(
            to_data(getattr(cpu, name))
        ), name
    assert meta.totals == cpu.totals
    assert meta.optimizer_step_peak_bytes == cpu.optimizer_step_peak_bytes
    assert to_data(meta.timeline) == to_data(cpu.timeline)


def write_model(tmp: Path, name: str, text: str) -> str:
    """The model file ``text`` written as ``tmp / name``: its path, as probe_model takes it."""
    path = tmp / name
    path.write_text(text)
    return str(path)


@dataclass(frozen=True)
class MetaProbe:
    """What ``memplan probe <model> --device meta -o <tmp>/p.yaml`` did: its exit code,
    its output, that output with its line breaks folded (``said``: rich wraps long
    messages), and whether it wrote the profile."""

    exit_code: int
    output: str
    said: str
    wrote: bool


def probe_on_meta(path: str, tmp: Path) -> MetaProbe:
    """Run ``memplan probe path --device meta -o tmp/p.yaml`` through the CLI."""
    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp / "p.yaml"
    result = CliRunner().invoke(app, ["probe", path, "--device", "meta", "-o", str(out)])
    return MetaProbe(result.exit_code, result.output, " ".join(result.output.split()), out.exists())
