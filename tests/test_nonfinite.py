"""NaN never passes (#10): a NaN loss or gradient fails verify's gradient check with no number
that reads as agreement (memplan.verify.grad_check, memplan.verify.plan_check), and a NaN
during the probe is a warning naming the step and the first layer that output it
(memplan.probe.nonfinite)."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_factory import hand_plan

MODELS = Path(__file__).parent / "models"
MISBEHAVE = str(MODELS / "trust_misbehave.py")


# ------------------------------------------------------------------ 2: NaN never passes
@pytest.mark.parametrize(("mode", "needle"), [("nan_loss_at_1", "NaN"), ("nan_grad_at_1", "NaN")])
def test_nan_in_losses_or_gradients_fails_the_gradient_check(monkeypatch, mode, needle):
    from memplan.verify import verify_plan

    monkeypatch.setenv("MEMPLAN_TEST_MISBEHAVE", mode)
    result = verify_plan(MISBEHAVE, hand_plan(MISBEHAVE), steps=1, device="cpu")
    check = result.gradient_check
    assert check.status == "fail", check
    assert "nan" in check.reason.lower()
    assert check.relative_error is None  # not a number that reads as "0.00e+00"
    assert not result.passed
    # The comparison itself, on fresh weights: accumulated micro-batch-1 gradients are NaN
    # while the full batch's are not; max() used to drop the NaN and report 0.00e+00.
    import torch

    from memplan.model.loader import load_model_file
    from memplan.verify.plan_check import check_gradients

    plan = hand_plan(MISBEHAVE)
    direct = check_gradients(load_model_file(MISBEHAVE), plan, torch.device("cpu"), 0)[0]
    assert direct.status == "fail" and needle in direct.reason, direct


def test_nan_loss_during_probe_is_a_warning_naming_the_step(monkeypatch):
    from memplan.probe import probe_model

    monkeypatch.setenv("MEMPLAN_TEST_MISBEHAVE", "nan_loss_at_1")
    profile = probe_model(MISBEHAVE, device="cpu", micro_batches=(1, 2))
    first = [w for w in profile.warnings if "loss was nan at micro-batch 1" in w]
    assert len(first) == 1, profile.warnings
    # the model's layers were finite: the NaN came from the loss's statistics over one sample
    assert "every module's output was finite: it arose in the loss computation" in first[0]
    # the file defines both functions: the warning asks the user to check each by its name
    assert "check the model, make_batch and training_loss for that size" in first[0]


def test_nan_loss_during_probe_names_the_first_layer_that_output_nan(monkeypatch):
    from memplan.probe import probe_model

    monkeypatch.setenv("MEMPLAN_TEST_MISBEHAVE", "nan_in_block_1_at_1")
    profile = probe_model(MISBEHAVE, device="cpu", micro_batches=(1, 2))
    first = [w for w in profile.warnings if "loss was nan at micro-batch 1" in w]
    assert len(first) == 1, profile.warnings
    # block 0 and block 1's Linear were finite; block 1's own forward made the NaN (named,
    # not the Sequential around it, and not 0.lin, whose weights the NaN step spoils later)
    assert "the first layer to output NaN or inf was 1 (Block)" in first[0]
    # the NaN step took another path, and the lines through 1 and 2 give negative bytes:
    # the writer refuses the profile, exit 3, saying what the probe saw at micro-batch 1
    from memplan.errors import CannotMeasureError
    from memplan.profile.read import profile_to_yaml

    with pytest.raises(CannotMeasureError) as refused:
        profile_to_yaml(profile)
    assert "micro-batches 1, 2 ran different op sequences" in str(refused.value)
    assert f"The probe also saw: {first[0]}" in str(refused.value)
