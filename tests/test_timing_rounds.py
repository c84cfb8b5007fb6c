"""``probe --timing-rounds``: how many interleaved timing rounds a cpu probe runs per size,
recorded in the profile, refused where it means nothing, and never moving a byte."""

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import BadInputError, MemplanError
from memplan.probe import probe_model
from memplan.probe.backends import make_backend
from memplan.probe.session import Session
from memplan.profile import load_profile

MODEL = str(Path(__file__).parent / "models" / "cli_tiny_gpt.py")
SIZES = (1, 2)
runner = CliRunner()
QUICK = ["probe", MODEL, "--device", "cpu", "--micro-batches", "1,2", "--timing-rounds", "1"]


def _counted_probe(monkeypatch: pytest.MonkeyPatch, rounds: int):
    """The profile, and how many untracked micro-steps and timed optimizer steps ran."""
    counts = {"untracked": 0, "optimizer": 0}
    micro_step, timed_optimizer_step = Session.micro_step, Session.timed_optimizer_step

    def counting_micro_step(self, batch, tracker, **kwargs):
        counts["untracked"] += tracker is None
        return micro_step(self, batch, tracker, **kwargs)

    def counting_optimizer_step(self):
        counts["optimizer"] += 1
        return timed_optimizer_step(self)

    monkeypatch.setattr(Session, "micro_step", counting_micro_step)
    monkeypatch.setattr(Session, "timed_optimizer_step", counting_optimizer_step)
    profile = probe_model(MODEL, device="cpu", micro_batches=SIZES, timing_rounds=rounds)
    monkeypatch.undo()
    return profile, counts


def _bytes(parts):
    """Each part with every measured time blanked: what the rounds must not move."""
    return [
        dataclasses.replace(
            part, **{f.name: None for f in dataclasses.fields(part) if "seconds" in f.name}
        )
        for part in parts
    ]


def test_each_round_runs_one_plain_full_and_selective_micro_step_per_timed_size(monkeypatch):
    one, ran_one = _counted_probe(monkeypatch, 1)
    three, ran_three = _counted_probe(monkeypatch, 3)
    # Timed sizes: each probed size plus the timing-only size (4 × the largest). Each round
    # runs plain, all-checkpointed and all-selective back to back, then an optimizer step.
    timed_sizes = len(SIZES) + 1
    assert one.environment.timing_rounds == 1 and three.environment.timing_rounds == 3
    assert ran_three["untracked"] - ran_one["untracked"] == 2 * 3 * timed_sizes
    assert ran_three["optimizer"] - ran_one["optimizer"] == 2 * timed_sizes
    # the rounds time the step; they measure no byte
    assert one.totals == three.totals
    assert one.timeline == three.timeline
    assert one.optimizer_step_peak_bytes == three.optimizer_step_peak_bytes
    assert _bytes(one.layers) == _bytes(three.layers)
    assert _bytes(one.fixed) == _bytes(three.fixed)


def test_the_default_is_five_rounds_and_meta_records_none() -> None:
    meta = probe_model(MODEL, device="meta", micro_batches=SIZES)
    assert meta.environment.timing_rounds is None
    assert make_backend("cpu", "fp32", None).timing_rounds == 5


def test_the_cli_writes_the_rounds_and_refuses_what_means_nothing(tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    result = runner.invoke(app, [*QUICK, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "timing_rounds: 1" in out.read_text()
    assert load_profile(out).environment.timing_rounds == 1

    for args, words in (
        (["--device", "meta", "--timing-rounds", "2"], "meta probe computes its times"),
        (["--device", "cpu", "--timing-rounds", "0"], "0 is not from 1 to 100"),
        (["--device", "cpu", "--timing-rounds", "-3"], "-3 is not from 1 to 100"),
        # a typo that would probe for days is refused, not run
        (["--device", "cpu", "--timing-rounds", "10" * 12], "is not from 1 to 100"),
    ):
        refused = tmp_path / "refused.yaml"
        result = runner.invoke(app, ["probe", MODEL, *args, "-o", str(refused)])
        assert result.exit_code == 2, result.output
        assert words in " ".join(result.output.split())
        assert not refused.exists()
    result = runner.invoke(app, ["probe", MODEL, "--device", "cpu", "--timing-rounds", "two"])
    assert result.exit_code == 2 and "timing-rounds" in result.output


def test_a_profile_written_before_the_field_reads_as_unrecorded(tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    result = runner.invoke(app, [*QUICK, "-o", str(out)])
    assert result.exit_code == 0, result.output
    old = tmp_path / "old.yaml"
    old.write_text(
        "".join(line for line in out.read_text().splitlines(True) if "timing_rounds" not in line)
    )
    assert load_profile(old).environment.timing_rounds is None
    for bad in (0, -2):
        edited = tmp_path / f"bad{bad}.yaml"
        edited.write_text(out.read_text().replace("timing_rounds: 1", f"timing_rounds: {bad}"))
        with pytest.raises(MemplanError, match=r"environment\.timing_rounds.*not from 1 to 100"):
            load_profile(edited)
    edited.write_text(out.read_text().replace("timing_rounds: 1", "timing_rounds: true"))
    with pytest.raises(MemplanError, match="timing_rounds"):
        load_profile(edited)


@settings(max_examples=40, deadline=None)
@given(
    st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=101),
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=3),
        st.none(),
    )
)
def test_the_api_refuses_any_round_count_but_a_positive_whole_number(rounds) -> None:
    with pytest.raises(BadInputError, match="timing-rounds"):
        make_backend("cpu", "fp32", None, timing_rounds=rounds)


@given(st.integers(min_value=1, max_value=100))
def test_the_api_takes_any_positive_whole_number(rounds: int) -> None:
    assert make_backend("cpu", "fp32", None, timing_rounds=rounds).timing_rounds == rounds


def test_progress_names_the_phase_under_way_not_the_one_just_done(monkeypatch):
    """The progress display shows the last label as the phase under way ("now X for N s")
    and charges the time until the next label to it, so the probe names each phase as it
    starts: while the timing rounds run, the label says timing and how many rounds."""
    from memplan.probe import sizes

    labels: list[str] = []
    seen: dict[str, str] = {}
    time_size, tracked_optimizer_step = sizes.time_size, Session.tracked_optimizer_step

    def timing(session, batch):
        seen.setdefault("timing", labels[-1])
        return time_size(session, batch)

    def optimizer_step(self, batch):
        seen.setdefault("optimizer", labels[-1])
        return tracked_optimizer_step(self, batch)

    monkeypatch.setattr(sizes, "time_size", timing)
    monkeypatch.setattr(Session, "tracked_optimizer_step", optimizer_step)
    probe_model(
        MODEL,
        device="cpu",
        micro_batches=SIZES,
        timing_rounds=2,
        on_progress=lambda done, total, what: labels.append(what),
    )
    assert labels[0] == "building the model" and labels[1] == "warm-up step"
    assert seen == {"timing": "b=1: timing (2 rounds)", "optimizer": "b=1: optimizer step"}
    assert "b=8: timing only (2 rounds)" in labels  # the timing-only size, 4 × the largest
    assert labels.index("b=8: timing only (2 rounds)") < labels.index("fitting the timeline")
