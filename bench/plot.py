"""Plot predicted against measured peak, one point per zoo configuration, from the rows
``bench/zoo_accuracy.py`` wrote: ``bench/results/peak_scatter.png`` (``peak_scatter-cuda.png``
for the CUDA rows). zoo_accuracy calls it at the end of its run.

    python -m bench.plot [--device cpu]

matplotlib is a bench-only extra: without it, ``plot`` says so and returns None."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20


def plot(device: str = "cpu") -> Path | None:
    """Write the scatter from ``<device>-zoo.csv``; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write the file only
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.plot: matplotlib is not installed; no plot written.")
        return None
    with (RESULTS / f"{device}-zoo.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    fig, ax = plt.subplots(figsize=(6, 6))
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        ax.scatter(
            [int(r["measured_bytes"]) / MiB for r in mine],
            [int(r["predicted_bytes"]) / MiB for r in mine],
            s=14,
            label=family,
        )
    top = max(max(int(r["measured_bytes"]), int(r["predicted_bytes"])) for r in rows) / MiB
    line = [0, top * 1.05]
    ax.plot(line, line, color="black", linewidth=0.8, label="predicted = measured")
    ax.plot(line, [v * 1.05 for v in line], color="grey", linewidth=0.6, linestyle="--")
    ax.plot(line, [v * 0.95 for v in line], color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlim(0, line[1])
    ax.set_ylim(0, line[1])
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title(f"memplan: predicted vs measured peak, {len(rows)} zoo configurations ({device})")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    out = RESULTS / ("peak_scatter.png" if device == "cpu" else f"peak_scatter-{device}.png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    out = plot(args.device)
    if out is not None:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
