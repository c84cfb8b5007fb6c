"""What people read in a log: tables keep every digit and every name when piped, sizes
name their unit, and a warning is said once."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import ChainSpec, uniform_chain
from rich.console import Console

from memplan import render
from memplan.solver import SolveRequest, solve

# ViT- and LoRA-style names: long, equal up to their last characters.
VIT = [f"encoder.layers.encoder_layer_{i}" for i in range(12)]
LORA = [f"base_model.model.transformer.h.{i}" for i in range(12)]


def piped(table) -> str:
    out = io.StringIO()
    Console(file=out, width=render.PIPED_WIDTH, highlight=False).print(table)
    return out.getvalue()


def row_names(text: str) -> list[str]:
    """First-column text of each table row, joining the lines a wrapped name runs over (a
    continuation line has an empty second cell)."""
    names: list[str] = []
    for line in text.splitlines():
        cells = line.split("│")
        if len(cells) < 3:
            continue
        if cells[2].strip():
            names.append(cells[1].strip())
        elif names:
            names[-1] += cells[1].strip()
    return names


def test_piped_output_is_120_columns_unless_columns_says_otherwise(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert render._width(io.StringIO()) == render.PIPED_WIDTH == 120
    monkeypatch.setenv("COLUMNS", "200")
    assert render._width(io.StringIO()) is None  # rich reads $COLUMNS itself


def test_profile_table_keeps_names_and_numbers_whole_when_piped():
    for names in (VIT, LORA):
        # saved bytes alternate, so no three neighbours are alike and grouped into one row
        saved = [3_000_000 * (1 + i % 2) for i in range(12)]
        spec = uniform_chain(12, names=names, params=[123_456_789] * 12, saved=saved)
        text = piped(render.profile_table(spec.profile(), width=render.PIPED_WIDTH))
        assert "…" not in text
        assert max(len(line) for line in text.splitlines()) <= render.PIPED_WIDTH
        assert set(names) <= set(row_names(text))  # every name whole, once its wraps join
        # 123,456,789 bytes = 117.7 MiB, shown as 118MiB: the unit named
        assert "118MiB" in text


def test_candidates_table_keeps_numbers_when_the_note_is_long():
    rows = [
        {
            "micro_batch": 4096,
            "accumulation_steps": 1024,
            "n_checkpointed": 128,
            "peak_bytes": 123_456_789_012,
            "step_seconds": 12.345,
            "feasible": False,
            "note": "over budget by 12.3 GiB; below the BatchNorm floor of 16 " * 2,
        }
    ]
    text = piped(render.candidates_table(rows, None))
    assert "…" not in text
    for cell in ("4096", "1024", "128", "115.0 GiB", "12.35 s"):
        assert cell in text


def test_a_warning_is_said_once_per_command(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(render, "console", Console(file=out, width=120))
    render.reset_warnings()
    for _ in range(3):
        render.warn("the model has BatchNorm")
    assert out.getvalue().count("BatchNorm") == 1
    render.reset_warnings()
    render.warn("the model has BatchNorm")
    assert out.getvalue().count("BatchNorm") == 2


def test_batchnorm_is_warned_once_per_plan():
    spec = ChainSpec(
        layer_has_batchnorm=[True, False, False, False],
        profile_kwargs={
            "has_batchnorm": True,
            "warnings": (
                "The model has BatchNorm: its statistics come from the micro-batch.",
                "something else the probe noticed",
            ),
        },
    )
    plan = solve(
        spec.profile(), SolveRequest(target_batch=32, budget_bytes=2**30, bn_min_micro=4)
    ).plan
    assert sum("BatchNorm" in w for w in plan.warnings) == 1
    assert "profile: something else the probe noticed" in plan.warnings


def test_alike_neighbours_share_one_row():
    spec = uniform_chain(1000, params=[1000] * 1000, saved=[100] * 1000)
    text = piped(render.profile_table(spec.profile(), width=render.PIPED_WIDTH))
    names = row_names(text)
    assert any("× " in n for n in names) and len(names) < 10


def test_a_loss_that_frees_more_than_it_keeps_reads_as_frees_not_a_negative_size():
    import dataclasses

    from memplan.profile import Affine, FixedPart

    profile = uniform_chain(4).profile()
    loss = FixedPart(
        name="(loss)",
        module_type="training_loss",
        params_trainable_bytes=0,
        params_frozen_bytes=0,
        grad_bytes=0,
        optimizer_state_bytes=0,
        saved_bytes=Affine(intercept=0.0, slope=-65536.0),
        fwd_seconds=Affine.zero(),
        bwd_seconds=Affine.zero(),
        fwd_flops=Affine.zero(),
    )
    profile = dataclasses.replace(profile, fixed=(*profile.fixed, loss))
    text = piped(render.profile_table(profile, width=render.PIPED_WIDTH))
    row = next(line for line in text.splitlines() if "(loss)" in line)
    assert "frees 64.0KiB" in row
    assert "-64.0KiB" not in row


_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and the infinities too: printed as null
    | st.text(max_size=8)
)
_JSON_DATA = st.recursive(
    _JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(data=_JSON_DATA)
def test_print_json_prints_what_json_dumps_would_with_nan_as_null(data):
    # print_json encodes piece by piece (a 10,000-layer profile's --json peaked 220 MiB
    # higher through json.dumps' joined list, bench 'Scale'); the text must stay dumps'.
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # render.stdout follows sys.stdout (set nothing)
        render.print_json(data)
    expected = json.dumps(render.json_safe(data), indent=2, default=str, allow_nan=False)
    assert out.getvalue() == expected + "\n"
    assert json.loads(out.getvalue()) == render.json_safe(data)


def test_print_json_writes_nothing_when_encoding_fails():
    # a key JSON cannot hold (a tuple) fails the encoder after part of the object is
    # encoded: no half object reaches stdout
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(TypeError):
        render.print_json({"a": list(range(100_000)), (1, 2): 3})
    assert out.getvalue() == ""
