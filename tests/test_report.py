"""memplan report: the drawn timeline is the memory model's, the files are real images and
self-contained pages, bad input is a clean exit 2."""

from __future__ import annotations

import dataclasses
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import ChainSpec, uniform_chain
from typer.testing import CliRunner

from memplan import memory
from memplan.cli import app
from memplan.plan import plan_to_yaml
from memplan.profile import profile_to_yaml
from memplan.report import MAX_HTML_BYTES, build_report, predicted_timeline, render_report
from memplan.report.data import KINDS, alike_layer_runs
from memplan.solver import SolveRequest, solve

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the IHDR chunk (PNG spec, section 11.2.2)."""
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def non_white_fraction(path: Path) -> float:
    from matplotlib.image import imread

    pixels = imread(str(path))[..., :3]
    return float((pixels.min(axis=-1) < 0.9).mean())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A profile and a plan solved from it, written as a user would have them."""
    folder = tmp_path_factory.mktemp("report")
    spec = uniform_chain(6, saved=[100, 400, 100, 400, 100, 100])
    profile = spec.profile()
    (folder / "m.profile.yaml").write_text(profile_to_yaml(profile))
    # A budget that forces checkpointing and accumulation (found by scanning budgets:
    # 29,750 bytes fits micro-batch 1 only, with two of six layers checkpointed).
    budget = 29_750
    result = solve(
        profile,
        SolveRequest(target_batch=64, budget_bytes=budget, profile_path="m.profile.yaml"),
    )
    assert result.plan.checkpoint_layers and any(not c.fits for c in result.candidates)
    (folder / "m.plan.yaml").write_text(plan_to_yaml(result.plan))
    return {"folder": folder, "profile": folder / "m.profile.yaml", "plan": folder / "m.plan.yaml"}


# --------------------------------------------------------------------------- the numbers
@settings(max_examples=40, deadline=None)
@given(
    saved=st.lists(st.integers(20, 400), min_size=1, max_size=5),
    b=st.integers(1, 32),
    k=st.integers(1, 3),
    data=st.data(),
)
def test_timeline_peak_is_the_models_peak(saved, b, k, data):
    n = len(saved)
    profile = ChainSpec(
        params=[1000] * n, saved=saved, output=[5] * n, fwd_seconds=[0.25] * n
    ).profile()
    chosen = frozenset(data.draw(st.sets(st.integers(0, n - 1))))
    strategy = data.draw(st.sampled_from(["ddp", "zero1", "fsdp"]))
    world = data.draw(st.integers(1, 4))
    sharding = memory.Sharding(strategy=strategy, world_size=world)
    reserve = memory.Reserve(fixed_bytes=512, fragmentation_fraction=0.05)
    line = predicted_timeline(profile, b, chosen, k, reserve=reserve, sharding=sharding)
    peak = memory.step_peak(profile, b, chosen, k, reserve=reserve, sharding=sharding)
    assert line.peak_bytes == peak.peak_bytes
    assert line.bars[line.peak_index].where == peak.where
    for bar in line.bars:  # every bar's kinds add up to its height
        assert sum(getattr(bar, kind) for kind in KINDS) == bar.total_bytes
    # One bar per segment of each phase the step runs, then the optimizer step; a run of
    # three or more alike layers is drawn as its highest bar (memplan.report.runs)
    phases = memory.phases_for(k)
    every = sum(len(profile.timeline[p]) for p in phases) + 1
    if any(run.count > 1 for run in alike_layer_runs(profile, chosen)):
        assert len(line.bars) < every
    else:
        assert len(line.bars) == every


def test_plan_report_peak_equals_the_plan_and_the_drawn_line(files):
    from memplan.plan import load_plan
    from memplan.report import draw

    report = build_report(files["plan"])
    plan = load_plan(files["plan"])
    assert report.timeline.peak_bytes == plan.predicted.peak_bytes
    assert report.timeline.bars[report.timeline.peak_index].where == plan.predicted.peak_phase
    assert not report.notes
    # The chart: the predicted total line's highest point is the predicted peak.
    fig = draw.timeline_figure(report)
    (line,) = [a for a in fig.axes[0].lines if a.get_gid() == "predicted-total"]
    scale, _ = draw._unit(max(report.timeline.peak_bytes, plan.budget_bytes))
    assert round(max(line.get_ydata()) * scale) == plan.predicted.peak_bytes
    # Checkpointed layers are the plan's, and only those are shaded as running checkpointed.
    shaded = {b.layer for b in report.timeline.bars if b.checkpointed}
    assert shaded == set(plan.checkpoint_layers)
    rows = {row.name: row for row in report.layers}
    assert {n for n, r in rows.items() if r.checkpointed} == set(plan.checkpoint_layers)
    # Candidates are the solver's: one per micro-batch dividing 64, the plan's chosen.
    assert [c.micro_batch for c in report.candidates] == [1, 2, 4, 8, 16, 32, 64]
    (chosen,) = [c for c in report.candidates if c.chosen]
    assert chosen.micro_batch == plan.micro_batch_size


def test_layer_rows_are_the_profiles_bytes_at_the_plan_micro_batch(files):
    report = build_report(files["plan"])
    b = report.plan.micro_batch_size
    for row, layer in zip(report.layers, report.profile.layers, strict=True):
        assert row.held_bytes == memory.affine_bytes(layer.saved_bytes, b)
        assert row.savings_bytes == int(layer.savings_bytes.at(b) // 1)
        # uniform_chain: every layer's forward takes 0.25 s; recompute = one forward per
        # micro-step when the profile has no measured recompute.
        assert row.recompute_seconds == pytest.approx(
            report.plan.accumulation_steps * layer.fwd_seconds.at(b)
        )


def test_a_changed_profile_is_said_not_hidden(files, tmp_path):
    spec = uniform_chain(6, saved=[100, 400, 100, 400, 100, 300])  # layer 5 grew
    (tmp_path / "grown.yaml").write_text(profile_to_yaml(spec.profile()))
    report = build_report(files["plan"], profile_path=tmp_path / "grown.yaml")
    assert any("profile changed" in note for note in report.notes)


# --------------------------------------------------------------------------- the files
def test_html_is_one_self_contained_page_under_5mb(files, tmp_path):
    out = tmp_path / "r.html"
    result = invoke("report", files["plan"], "-o", out)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert len(text.encode()) < MAX_HTML_BYTES
    assert text.count("<svg") == 2 and 'id="timeline-chart"' in text
    assert 'id="candidates-chart"' in text and 'id="layers"' in text
    # Nothing to fetch: every src/href is a fragment inside the page; no URL anywhere
    # but the SVG namespace declarations; no script.
    links = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', text)
    assert links and all(link.startswith("#") for link in links)
    without_ns = re.sub(r'xmlns(:\w+)?="[^"]*"', "", text)
    assert not re.search(r"https?:|//[a-z]", without_ns, re.I)
    assert "<script" not in text and "<link" not in text and "@import" not in text


def test_png_is_a_real_non_blank_image(files, tmp_path):
    out = tmp_path / "r.png"
    result = invoke("report", files["plan"], "-o", out)
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    width, height = png_size(data)
    assert (width, height) == (1200, 960)  # 12 × 9.6 in at 100 dpi
    assert 0.2 < non_white_fraction(out) < 0.95


def test_profile_alone_and_profile_solved(files, tmp_path):
    result = invoke("report", files["profile"], "-o", tmp_path / "p.html")
    assert result.exit_code == 0, result.output
    assert "No plan" in (tmp_path / "p.html").read_text()
    result = invoke(
        "report",
        files["profile"],
        "-o",
        tmp_path / "s.png",
        "--target-batch",
        "64",
        "--budget",
        "1GiB",
    )
    assert result.exit_code == 0, result.output
    assert png_size((tmp_path / "s.png").read_bytes())[0] == 1200


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-o", "{dir}/r.pdf"], "not '.pdf'"),
        (["-o", "{dir}/r"], "no suffix"),
        (["-o", "{dir}/r.html", "--target-batch", "64"], "go together"),
        (["-o", "{dir}/r.html", "--profile", "{dir}/missing.yaml"], "missing.yaml"),
    ],
)
def test_bad_input_exits_2(files, tmp_path, args, needle):
    source = files["profile"] if "--target-batch" in args else files["plan"]
    result = invoke("report", source, *[a.format(dir=tmp_path) for a in args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_existing_output_is_kept_and_a_lost_profile_named(files, tmp_path):
    out = tmp_path / "r.html"
    out.write_text("mine")
    result = invoke("report", files["plan"], "-o", out)
    assert result.exit_code == 2 and out.read_text() == "mine"
    assert invoke("report", files["plan"], "-o", out, "--force").exit_code == 0
    lonely = tmp_path / "plan.yaml"
    lonely.write_text(files["plan"].read_text())  # its profile is not beside it
    result = invoke("report", lonely, "-o", tmp_path / "x.html", "--profile", tmp_path / "no")
    assert result.exit_code == 2  # a profile named on the command line must exist


def test_a_plan_without_its_profile_still_draws_its_peak(files, tmp_path):
    from memplan.plan import load_plan

    lonely = tmp_path / "plan.yaml"
    lonely.write_text(files["plan"].read_text())  # its profile is not beside it
    plan = load_plan(lonely)
    report = build_report(lonely)
    assert report.timeline.peak_bytes == plan.predicted.peak_bytes
    assert "--profile" in report.notes[0]
    for suffix in ("html", "png"):
        result = invoke("report", lonely, "-o", tmp_path / f"x.{suffix}")
        assert result.exit_code == 0, result.output
    assert "--profile" in (tmp_path / "x.html").read_text()


def test_missing_matplotlib_is_exit_2_naming_the_extra(files, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    result = invoke("report", files["plan"], "-o", tmp_path / "r.png")
    assert result.exit_code == 2
    assert "pip install 'memplan[report]'" in " ".join(result.output.split())
    assert not (tmp_path / "r.png").exists()


def test_matplotlib_is_imported_only_when_drawing():
    code = (
        "import sys, memplan.report, memplan.cli, memplan.memory, memplan.solver; "
        "print(sorted(m for m in ('matplotlib', 'torch', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "matplotlib" not in out.stdout and "torch" not in out.stdout


def test_report_renders_bytes_in_both_formats(files):
    report = build_report(files["plan"])
    assert render_report(report, ".png")[:8] == PNG_SIGNATURE
    assert render_report(report, ".html").startswith(b"<!DOCTYPE html>")


# --------------------------------------------------------------------------- measured
STACK = Path(__file__).parent / "models" / "stack.py"


@pytest.fixture(scope="module")
def stack_plan(tmp_path_factory) -> Path:
    from memplan.probe import probe_model

    folder = tmp_path_factory.mktemp("measured")
    profile = probe_model(str(STACK), device="cpu", micro_batches=(1, 2, 4))
    (folder / "stack.profile.yaml").write_text(profile_to_yaml(profile))
    plan = solve(
        profile,
        SolveRequest(
            target_batch=8,
            budget_bytes=2**30,
            max_micro=2,
            profile_path=str(folder / "stack.profile.yaml"),
        ),
    ).plan
    assert (plan.micro_batch_size, plan.accumulation_steps) == (2, 4)
    (folder / "stack.plan.yaml").write_text(plan_to_yaml(plan))
    return folder / "stack.plan.yaml"


def test_verify_records_the_last_step_and_draws_it(stack_plan, tmp_path):
    from memplan.plan import load_plan
    from memplan.report import measured_timeline
    from memplan.verify import verify_plan

    plan = load_plan(stack_plan)
    result = verify_plan(str(STACK), plan, steps=1, check_gradients=False, record_timeline=True)
    assert len(result.timeline) == plan.accumulation_steps + 1  # 4 micro-steps, optimizer
    # Each micro-step's forward is seen, and ends before its backward does.
    assert len(result.timeline_forward_ops) == plan.accumulation_steps
    for ops, piece in zip(result.timeline_forward_ops, result.timeline, strict=False):
        assert ops is not None and 0 < ops < len(piece)
    measured = measured_timeline(result)
    # The steady step is the run's highest (the first lacks optimizer state); the model
    # predicts it within a few bytes on this stack (measured 4 bytes over, 0.01%).
    assert measured.peak_bytes == result.measured_peak_bytes
    assert abs(measured.peak_bytes - plan.predicted.peak_bytes) <= 0.01 * measured.peak_bytes

    out = tmp_path / "v.html"
    cli = invoke("verify", STACK, stack_plan, "--steps", "1", "--no-grad-check", "--report", out)
    assert cli.exit_code == 0, cli.output
    assert '<g id="measured' in out.read_text()
    again = invoke("verify", STACK, stack_plan, "--steps", "1", "--report", out)
    assert again.exit_code == 2 and "already exists" in again.output  # before running
    # the hint names verify's own options: it asked for --force, which verify lacked, and -o
    said = " ".join(again.output.split())
    assert "Pass --force to replace it, or choose another path with --report." in said
    out.write_text("old")
    forced = invoke("verify", STACK, stack_plan, "--steps", "1", "--report", out, "--force")
    assert forced.exit_code == 0, forced.output
    assert '<g id="measured' in out.read_text()
    suffix = invoke("verify", STACK, stack_plan, "--steps", "1", "--report", tmp_path / "r.txt")
    assert suffix.exit_code == 2 and "--report " in suffix.output and "-o " not in suffix.output


def test_last_step_is_cut_at_the_marks():
    from memplan.verify import last_step_timeline

    values = list(range(20))
    # Two optimizer steps of k = 2: micro-steps begin at 0, 4, 10, 13; optimizer at 8, 17.
    # The model's forward returned at 2, 6, 11 and 15.
    assert last_step_timeline(values, [0, 4, 10, 13], [8, 17], 2, [2, 6, 11, 15]) == (
        ((10, 11, 12), (13, 14, 15, 16), (17, 18, 19)),
        (1, 2),
    )
    assert last_step_timeline(values, [0, 4], [8], 1, [])[1] == (None,)
    assert last_step_timeline(values, [0], [], 1) == ((), ())


def test_the_worst_rank_is_drawn():
    from types import SimpleNamespace

    from memplan.report import measured_timeline

    ranks = [
        SimpleNamespace(
            rank=0, tracker_peak_bytes=90, timeline=((1, 90), (5,)), timeline_forward_ops=(1,)
        ),
        SimpleNamespace(
            rank=1, tracker_peak_bytes=120, timeline=((2, 120), (6,)), timeline_forward_ops=(1,)
        ),
    ]
    measured = measured_timeline(SimpleNamespace(ranks=ranks))
    assert measured.peak_bytes == 120 and "rank 1 of 2" in measured.label


def test_step_summary_section_holds_a_small_png(files):
    import base64

    from memplan.plan import load_plan
    from memplan.profile import load_profile
    from memplan.report import summary_markdown

    text = summary_markdown("tiny", load_profile(files["profile"]), load_plan(files["plan"]))
    encoded = re.search(r'src="data:image/png;base64,([^"]+)"', text).group(1)
    data = base64.b64decode(encoded)
    assert png_size(data) == (720, 576)  # 12 × 9.6 in at 60 dpi
    assert len(text) < 300 * 1024  # GitHub caps a step summary at 1 MiB


def test_a_corrupt_plan_or_foreign_layers_exit_2(files, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("target_batch: [unclosed\n")
    result = invoke("report", broken, "-o", tmp_path / "r.html")
    assert result.exit_code == 2 and "Traceback" not in result.output
    # A plan naming layers the profile does not have (another model's profile).
    other = uniform_chain(2, names=["enc.0", "enc.1"]).profile()
    (tmp_path / "other.yaml").write_text(profile_to_yaml(other))
    plan_text = files["plan"].read_text()
    result = invoke(
        "report", files["plan"], "-o", tmp_path / "r.html", "--profile", tmp_path / "other.yaml"
    )
    assert "checkpoint:" in plan_text
    assert result.exit_code == 2, result.output
    # said as what it is: the candidates differ from the plan's fingerprint
    assert "is the profile of another model than the plan's" in " ".join(result.output.split())


def test_check_puts_each_checks_png_in_the_step_summary(tmp_path):
    import base64

    import yaml

    small = str(Path(__file__).parent / "models" / "check_small.py")
    check = {"model": small, "target_batch": 32, "device": "cpu"}
    config = tmp_path / "memplan.yaml"
    checks = [
        {"name": "fits", "budget": "1GiB", **check},
        {"name": "too-small", "budget": "1KiB", **check},
    ]
    config.write_text(yaml.safe_dump({"checks": checks}))
    summary = tmp_path / "summary.md"
    result = runner.invoke(
        app, ["check", "--config", str(config)], env={"GITHUB_STEP_SUMMARY": str(summary)}
    )
    assert result.exit_code == 1, result.output  # the second check is over budget
    text = summary.read_text()
    # The summary writes names as escaped Markdown text (formats.markdown_text): the
    # hyphen of "too-small" comes out as "too\\-small".
    assert "fits" in text and "too\\-small" in text  # the check's own table comes first
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    # One image per check: the plan that fits, and the closest plan to the one that does not.
    assert len(images) == 2
    assert text.index("#### fits: where") < text.index("#### too\\-small: where")
    sizes = [png_size(base64.b64decode(encoded)) for encoded in images]
    # Timeline and candidates for the passing check; the timeline alone for the failing
    # one (no candidate fits its budget, so there is no candidates chart).
    assert sizes == [(720, 576), (720, 312)]
    # Without the variable, no images and nothing appended.
    again = runner.invoke(app, ["check", "--config", str(config), "--only", "fits"], env={})
    assert again.exit_code == 0 and summary.read_text() == text


def test_a_plan_below_the_batchnorm_floor_keeps_its_candidates(tmp_path):
    """A BatchNorm plan solved with --allow-small-bn-micro (micro-batch 4): the report
    solved its candidates again with the default floor of 16, refused them all, and told
    the user to pass --allow-small-bn-micro, which report does not take."""
    from memplan.report import plan_candidates

    spec = uniform_chain(3, saved=[100, 400, 100])
    spec = dataclasses.replace(spec, layer_has_batchnorm=[True, False, False])
    profile = spec.profile()
    assert profile.has_batchnorm
    request = SolveRequest(
        target_batch=8, budget_bytes=1 << 30, min_micro=4, max_micro=4, allow_small_bn_micro=True
    )
    plan = solve(profile, request).plan
    assert plan.micro_batch_size == 4
    rows, notes = plan_candidates(profile, plan, None)
    assert not any("could not be solved again" in n for n in notes), notes
    assert [r.micro_batch for r in rows if r.chosen] == [4]


def test_a_plan_with_a_profiles_options_is_refused(files):
    """report PLAN --target-batch 8 --budget 1GiB drew the plan's own batch and budget,
    exit 0, without a word."""
    result = CliRunner().invoke(
        app,
        [
            "report",
            str(files["plan"]),
            "-o",
            str(files["folder"] / "x.html"),
            "--target-batch",
            "8",
            "--budget",
            "1GiB",
        ],
    )
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "is a plan, drawn as it was solved; --target-batch, --budget solve a profile" in said
    assert not (files["folder"] / "x.html").exists()
