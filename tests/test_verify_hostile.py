"""What a careless or hostile user found in ``show``, ``report`` and ``verify``: a plan edited
by hand to another micro-batch kept its old figures (``verify`` read the difference as
memplan's misprediction), ``report`` drew a plan over another model's profile, and nothing
said that the model file had changed since it was probed. Each is said now, by figures the
profile gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.plan import load_plan
from memplan.profile import load_profile
from memplan.report import build_report, report_for_plan

MODELS = Path(__file__).parent / "models"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def said(result) -> str:
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny GPT copied into a folder, probed on cpu and solved (micro-batches 1, 2, 4,
    target 8), and a second model's meta profile."""
    folder = tmp_path_factory.mktemp("hostile")
    model = folder / "tiny.py"
    shutil.copy(MODELS / "cli_tiny_gpt.py", model)
    profile = folder / "tiny.profile.yaml"
    done = invoke("probe", model, "--device", "cpu", "-o", profile, "--timing-rounds", "1")
    assert done.exit_code == 0, done.output
    plan = folder / "plan.yaml"
    done = invoke("solve", profile, "--target-batch", 8, "--budget", "1GiB", "-o", plan)
    assert done.exit_code == 0, done.output
    other = folder / "mlp.profile.yaml"
    mlp = Path(__file__).parent.parent / "examples" / "mlp.py"
    done = invoke("probe", mlp, "--device", "meta", "--micro-batches", "1,2", "-o", other)
    assert done.exit_code == 0, done.output
    return folder, model, profile, plan, other


def test_a_plan_edited_to_another_micro_batch_is_said_by_its_profiles_figures(files):
    folder, model, profile, plan_path, _ = files
    plan = load_plan(plan_path)
    assert plan.micro_batch_size > 1  # the edit below halves it, the product kept
    text = plan_path.read_text()
    edited = folder / "edited.yaml"
    edited.write_text(
        text.replace(
            f"micro_batch_size: {plan.micro_batch_size}",
            f"micro_batch_size: {plan.micro_batch_size // 2}",
        ).replace(
            f"accumulation_steps: {plan.accumulation_steps}",
            f"accumulation_steps: {plan.accumulation_steps * 2}",
        )
    )
    changed = load_plan(edited)
    truth = report_for_plan(changed, load_profile(profile), candidates=False).timeline.peak_bytes
    assert truth != plan.predicted.peak_bytes  # the edit moves the peak
    shown = invoke("show", edited)
    assert shown.exit_code == 0
    from memplan.units import format_bytes

    assert (
        f"says a peak of {format_bytes(plan.predicted.peak_bytes)}, and its profile "
        f"({profile}) predicts {format_bytes(truth)} for micro-batch "
        f"{changed.micro_batch_size} × {changed.accumulation_steps}"
    ) in said(shown).replace(f"{profile.parent}/ ", f"{profile.parent}/"), shown.output
    # the plan as solved: no such warning
    assert "edited by hand" not in said(invoke("show", plan_path))
    verified = invoke("verify", model, edited, "--steps", "1", "--no-grad-check")
    assert "the plan was edited by hand" in said(verified), verified.output
    again = invoke("verify", model, plan_path, "--steps", "1", "--no-grad-check")
    assert again.exit_code == 0, again.output
    assert "edited by hand" not in said(again) and "changed since" not in said(again)


def test_a_plan_edited_to_another_precision_is_said_before_verify_blames_the_prediction(files):
    # solve copies the profile's precision into the plan: an fp32 plan edited to bf16 was
    # shown without a word, and verify ran it in bf16 and said FAIL +54.5% as memplan's
    # misprediction
    folder, model, profile, plan_path, _ = files
    assert load_plan(plan_path).precision == "fp32"
    edited = folder / "bf16.yaml"
    edited.write_text(plan_path.read_text().replace("precision: fp32", "precision: bf16"))
    note = (
        f"says precision bf16 (autocast), and its profile ({profile}) was probed in fp32: the "
        "plan was edited by hand"
    )
    shown = invoke("show", edited)
    assert shown.exit_code == 0
    assert note in said(shown).replace(f"{profile.parent}/ ", f"{profile.parent}/")
    verified = invoke("verify", model, edited, "--steps", "1", "--no-grad-check")
    text = said(verified).replace(f"{profile.parent}/ ", f"{profile.parent}/")
    assert note in text, verified.output


def test_report_refuses_another_models_profile(files, tmp_path):
    _, _, _, plan_path, other = files
    done = invoke("report", plan_path, "--profile", other, "-o", tmp_path / "r.html")
    assert done.exit_code == 2
    text = said(done)
    assert "is the profile of another model than the plan's" in text
    assert not (tmp_path / "r.html").exists()
    # its own profile still reports
    report = build_report(plan_path)
    assert report.timeline.peak_bytes == load_plan(plan_path).predicted.peak_bytes


def test_verify_says_the_model_file_changed_since_it_was_probed(files):
    _, model, _, plan_path, _ = files
    before = model.read_text()
    try:
        model.write_text(before + "\n# edited after the probe\n")
        done = invoke("verify", model, plan_path, "--steps", "1", "--no-grad-check")
        assert done.exit_code == 0, done.output  # the same model: the verdict stands
        assert f"{model} changed since it was probed for this plan (sha256 " in said(done)
    finally:
        model.write_text(before)
