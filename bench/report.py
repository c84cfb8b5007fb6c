"""`memplan report` on the 7B example: how big the page is and how long it takes to write
and to show. The page must stay under 5 MB and render in under 2 s (issue #14)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from memplan.devices import load_device
from memplan.plan import plan_to_yaml
from memplan.profile import load_profile
from memplan.report import build_report, data, render_report
from memplan.solver import SolveRequest, solve

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "examples" / "ci" / "baselines" / "llama7b.profile.yaml"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _screenshot_seconds(browser: str, url: str, folder: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={folder / 'home'}",
            "--window-size=1280,1600",
            f"--screenshot={folder / 'shot.png'}",
            url,
        ],
        capture_output=True,
        check=True,
        timeout=120,
    )
    return time.perf_counter() - start


def run(device: str) -> str:
    del device  # drawing does not depend on the device
    profile = load_profile(PROFILE)
    spec = load_device("h200")
    plan = solve(
        profile,
        SolveRequest(
            target_batch=32,
            budget_bytes=spec.memory_bytes,
            device_spec=spec,
            profile_path=str(PROFILE),
        ),
    ).plan
    start = time.perf_counter()
    report = data.plan_report(profile, plan, device_spec=spec)
    model_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "plan.yaml").write_text(plan_to_yaml(plan))
        start = time.perf_counter()
        page = render_report(build_report(folder / "plan.yaml"), ".html")
        html_seconds = time.perf_counter() - start
        start = time.perf_counter()
        png = render_report(build_report(folder / "plan.yaml"), ".png")
        png_seconds = time.perf_counter() - start
        (folder / "report.html").write_bytes(page)
        (folder / "blank.html").write_text("<!DOCTYPE html><title>blank</title>")
        browser = next((b for b in BROWSERS if shutil.which(b)), None)
        browser_line = "no Chromium found: browser time not measured"
        if browser:
            runs = {"report": [], "blank": []}
            for _ in range(3):
                for name in runs:
                    url = (folder / f"{name}.html").as_uri()
                    runs[name].append(_screenshot_seconds(browser, url, folder))
            page_s, blank_s = statistics.median(runs["report"]), statistics.median(runs["blank"])
            browser_line = (
                f"headless Chromium screenshot {page_s:.2f} s vs {blank_s:.2f} s for a blank "
                f"page (median of 3): the page costs {page_s - blank_s:.2f} s to render"
            )
    bars = len(report.timeline.bars)
    lines = [
        "### `memplan report` on the 7B example (`bench/report.py`)\n",
        f"examples/llama7b.py's committed meta profile, solved for an H200 (target 32): "
        f"micro-batch {plan.micro_batch_size} × {plan.accumulation_steps}, "
        f"{len(plan.checkpoint_layers)} of {len(profile.layers)} layers checkpointed; "
        f"{bars} timeline bars. The drawn peak equals the plan's "
        f"({report.timeline.peak_bytes:,} == {plan.predicted.peak_bytes:,} bytes).\n",
        "| what | figure |",
        "|---|---|",
        f"| HTML page | {len(page) / 1024:.0f} KiB (bar: < 5 MB) |",
        f"| PNG | {len(png) / 1024:.0f} KiB |",
        f"| timeline from the model | {model_seconds * 1e3:.0f} ms |",
        f"| write HTML (solve again, draw, SVG) | {html_seconds:.2f} s |",
        f"| write PNG | {png_seconds:.2f} s |",
        f"| browser | {browser_line} (bar: < 2 s) |",
    ]
    print("\n".join(lines[3:]))
    return "\n".join(lines) + "\n"
