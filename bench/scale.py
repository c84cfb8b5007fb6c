"""How memplan's time and memory grow with depth: probe (meta), solve and report of
tests/models/deep_residual.py at 100, 1,000 and 10,000 blocks, identical and varied.

Each command runs as its own process (``python -m memplan.cli ...``) so its peak RSS is its
own; times are wall-clock of the whole command, start-up included. The identical stack is
probed at three short lengths and derived (memplan.probe.repeats); the varied one (widths
cycling 4, 5, 6, 7) is probed block by block, so it is run at 100 and 1,000 blocks only:
10,000 would take most of an hour. The growth rate is the exponent ``k`` in
``time ∝ layers^k`` between 1,000 and 10,000 (or 100 and 1,000) layers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "deep_residual.py"

RUN = r"""
import sys, time
from memplan.cli import app
t = time.perf_counter()
sys.argv = ["memplan", *sys.argv[1:]]
code = 0
try:
    app()
except SystemExit as exc:
    code = exc.code or 0
seconds = time.perf_counter() - t
# VmHWM: this process's own peak (ru_maxrss would start from the parent's at the fork)
status = open("/proc/self/status").read().split("VmHWM:")
rss = int(status[1].split()[0]) * 1024 if len(status) > 1 else 0
print(f"@@{seconds} {rss} {code}", file=sys.stderr)
"""


def _run(*args: str) -> tuple[float, int, int]:
    """(seconds, peak RSS bytes, exit code) of one memplan command in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=1800
    )
    line = [x for x in out.stderr.splitlines() if x.startswith("@@")]
    if not line:
        return math.nan, 0, -1
    seconds, rss, code = line[-1][2:].split()
    return float(seconds), int(rss), int(code)


def _factory(kind: str, n: int) -> str:
    if kind == "identical":
        return "build_model" if n == 10_000 else f"blocks_{n}"
    return f"varied_{n}"


def _growth(rows: list[dict], kind: str, step: str) -> str:
    pts = {r["layers"]: r[f"{step}_s"] for r in rows if r["kind"] == kind}
    for a, b in ((1_000, 10_000), (100, 1_000)):
        if a in pts and b in pts and pts[a] > 0 and pts[b] > 0:
            k = math.log(pts[b] / pts[a]) / math.log(b / a)
            return f"layers^{k:.2f} ({a:,}→{b:,})"
    return "—"


def run(device: str = "cpu") -> str:
    del device  # meta probes: the same on any machine
    rows = []
    plan = ("--budget", "1.2GiB", "--target-batch", "65536", "--device-profile", "h100")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, sizes in (("identical", (100, 1_000, 10_000)), ("varied", (100, 1_000))):
            for n in sizes:
                profile = Path(tmp) / f"{kind}{n}.yaml"
                model = f"{MODEL}:{_factory(kind, n)}"
                probe = _run("probe", model, "--device", "meta", "-o", str(profile), "--json")
                solve = _run("solve", str(profile), *plan, "--json")
                html = Path(tmp) / f"{kind}{n}.html"
                report = _run("report", str(profile), "-o", str(html), *plan)
                row = {
                    "kind": kind,
                    "layers": n,
                    "probe_s": probe[0],
                    "probe_rss": probe[1],
                    "solve_s": solve[0],
                    "solve_rss": solve[1],
                    "report_s": report[0],
                    "report_rss": report[1],
                    "html_bytes": html.stat().st_size if html.exists() else 0,
                    "codes": (probe[2], solve[2], report[2]),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    mib = 2**20
    lines = [
        "## Scale: time and memory by depth",
        "",
        "`tests/models/deep_residual.py`: residual blocks `x + Linear(4, 4)(x)` (identical) or "
        "bottlenecks of widths 4–7 (varied). Each command is a fresh process "
        "(start-up included); `probe --device meta -o`, `solve " + " ".join(plan) + "`, "
        "`report -o x.html` with the same budget. RSS is the process's peak.",
        "",
        "| blocks | kind | probe s | probe RSS | solve s | solve RSS | report s | report RSS "
        "| page | exit codes |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']:,} | {r['kind']} | {r['probe_s']:.1f} | {r['probe_rss'] / mib:.0f} MiB "
            f"| {r['solve_s']:.1f} | {r['solve_rss'] / mib:.0f} MiB | {r['report_s']:.1f} "
            f"| {r['report_rss'] / mib:.0f} MiB | {r['html_bytes'] / 1024:.0f} KiB "
            f"| {r['codes']} |"
        )
    lines.append("")
    for kind in ("identical", "varied"):
        lines.append(
            f"- {kind}: probe grows as {_growth(rows, kind, 'probe')}, solve as "
            f"{_growth(rows, kind, 'solve')}, report as {_growth(rows, kind, 'report')}."
        )
    lines.append(
        "- varied at 10,000 blocks is not run: its probe measures every block (no run of "
        "identical blocks to derive), most of an hour."
    )
    deep = next((r for r in rows if r["kind"] == "identical" and r["layers"] == 10_000), None)
    if deep is not None:
        met = deep["codes"][0] == 0 and deep["probe_s"] < 120 and deep["probe_rss"] < 2**30
        lines.append(
            f"- Issue 26's bar, 10,000 identical blocks probed on meta in under 120 s and "
            f"1 GiB: {'met' if met else 'MISSED'} ({deep['probe_s']:.1f} s, "
            f"{deep['probe_rss'] / mib:.0f} MiB). tests/test_lookalike_blocks.py checks what "
            "the probe derives, at 1,000 blocks; the time and memory are this table's."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
