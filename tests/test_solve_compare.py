"""``memplan solve --compare`` (issue 34): one request solved on profiles of one model probed
different ways (bf16 and float8), the fastest that fits chosen. Brute force is the oracle:
each profile solved alone, the least step time among those that fit, ties to the first."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import uniform_chain
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.plan import load_plan
from memplan.profile import Environment, Float8, ModelRef, Profile, profile_to_yaml
from memplan.solver import SolveRequest, least_peak, solve
from memplan.solver.compare import comparison_rows, solve_compared
from memplan.units import format_bytes, format_seconds

runner = CliRunner()
MODEL = ModelRef(path="model.py", sha256="ab" * 32)


def _env(float8: bool, device: str = "cpu", **kwargs) -> Environment:
    return Environment(
        torch_version="test",
        memplan_version="test",
        device=device,
        device_name=kwargs.pop("device_name", device),
        precision="bf16",
        float8=Float8(converted=4) if float8 else None,
        **kwargs,
    )


def _profile(*, float8: bool, saved: float, fwd: float, n: int = 4, **env) -> Profile:
    spec = uniform_chain(n, saved=[saved] * n, fwd_seconds=[fwd] * n)
    return dataclasses.replace(spec.profile(), model=MODEL, environment=_env(float8, **env))


# float8: faster matmuls, more bytes held (its casts' saved tensors): the trade the option
# exists to weigh
BF16 = _profile(float8=False, saved=100, fwd=0.25)
FLOAT8 = _profile(float8=True, saved=140, fwd=0.15)


def _request(budget: int, **kwargs) -> SolveRequest:
    return SolveRequest(target_batch=8, budget_bytes=budget, margin=0.0, **kwargs)


def _alone(profile: Profile, request: SolveRequest):
    try:
        return solve(profile, request)
    except NoPlanFitsError:
        return None


def _least(profile: Profile, request: SolveRequest) -> int:
    return least_peak(profile, request).peak_bytes


def test_a_budget_both_fit_picks_the_faster_and_says_so_with_figures():
    request = _request(1 << 30)
    compared = solve_compared([("bf16.yaml", BF16), ("float8.yaml", FLOAT8)], request)
    bf16, float8 = solve(BF16, request).plan, solve(FLOAT8, request).plan
    # no checkpointing at this budget: 8 samples, micro-batch 8; forward 4 × 0.15 × 8,
    # backward twice that, fixed 0.125 per micro-step, the optimizer 0.5 once
    assert float8.predicted.step_seconds == pytest.approx(3 * 4 * 0.15 * 8 + 0.125 + 0.5)
    assert bf16.predicted.step_seconds == pytest.approx(3 * 4 * 0.25 * 8 + 0.125 + 0.5)
    assert compared.chosen == 1
    plan = compared.result.plan
    assert plan.profile == "float8.yaml"
    assert plan.predicted == float8.predicted and plan.checkpoint == float8.checkpoint
    assert plan.reasons[:-1] == float8.reasons
    ratio = bf16.predicted.step_seconds / float8.predicted.step_seconds
    assert plan.reasons[-1] == (
        f"float8 tensorwise (float8.yaml) is the fastest of 2 profiles solved alike "
        f"(--compare): {format_seconds(float8.predicted.step_seconds)} a step, peak "
        f"{format_bytes(float8.predicted.peak_bytes)}; bf16 (bf16.yaml) "
        f"{format_seconds(bf16.predicted.step_seconds)} a step ({ratio:.2f}× the chosen one's "
        f"time), peak {format_bytes(bf16.predicted.peak_bytes)}"
    )
    rows = comparison_rows(compared)
    assert [r["time_vs_chosen"] for r in rows] == [pytest.approx(ratio), 1.0]
    assert [r["peak_bytes"] for r in rows] == [
        bf16.predicted.peak_bytes,
        float8.predicted.peak_bytes,
    ]


def test_a_budget_only_the_smaller_peak_fits_picks_it_though_slower():
    probe = _request(1 << 30)
    low, high = _least(BF16, probe), _least(FLOAT8, probe)
    assert low < high  # float8 holds 140 bytes a sample a block, bf16 100
    request = _request(low)  # bf16's least peak exactly: float8 has no plan
    compared = solve_compared([("float8.yaml", FLOAT8), ("bf16.yaml", BF16)], request)
    assert compared.chosen == 1
    assert compared.result.plan.predicted == solve(BF16, request).plan.predicted
    assert compared.rows[0].result is None
    assert compared.rows[0].no_fit.min_peak_bytes == high
    assert (
        "float8 tensorwise (float8.yaml) has no plan that fits: needs"
        in (compared.result.plan.reasons[-1])
    )
    row = comparison_rows(compared)[0]
    assert (row["fits"], row["min_peak_bytes"], row["time_vs_chosen"]) == (False, high, None)


def test_none_fits_leaves_no_choice_and_every_row_says_why():
    request = _request(_least(BF16, _request(1 << 30)) - 1)
    compared = solve_compared([("bf16.yaml", BF16), ("float8.yaml", FLOAT8)], request)
    assert compared.chosen is None and compared.result is None
    assert [r.no_fit.min_peak_bytes for r in compared.rows] == [
        _least(BF16, request),
        _least(FLOAT8, request),
    ]


def test_a_tie_goes_to_the_main_profile():
    twin = dataclasses.replace(BF16)
    request = _request(1 << 30)
    assert solve_compared([("a.yaml", BF16), ("b.yaml", twin)], request).chosen == 0
    assert solve_compared([("b.yaml", twin), ("a.yaml", BF16)], request).chosen == 0


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5),
    saved=st.lists(st.integers(20, 300), min_size=3, max_size=3),
    fwd=st.lists(st.sampled_from([0.05, 0.1, 0.15, 0.25]), min_size=3, max_size=3),
    budget_at=st.floats(0.0, 1.2),
    target=st.sampled_from([4, 6, 8]),
)
def test_the_choice_is_brute_forces(n, saved, fwd, budget_at, target):
    """Each profile solved alone; the least step time among those that fit, ties to the
    first, is the comparison's plan, to the byte and the second."""
    profiles = [
        (f"p{i}.yaml", _profile(float8=i > 0, saved=s, fwd=f, n=n))
        for i, (s, f) in enumerate(zip(saved, fwd, strict=True))
    ]
    wide = SolveRequest(target_batch=target, budget_bytes=1 << 40, margin=0.0)
    peaks = [_least(p, wide) for _, p in profiles]
    budget = int(min(peaks) + budget_at * (max(peaks) - min(peaks) + 4000))
    request = dataclasses.replace(wide, budget_bytes=budget)
    alone = [_alone(p, request) for _, p in profiles]
    fitting = [(r.plan.predicted.step_seconds, i) for i, r in enumerate(alone) if r]
    compared = solve_compared(profiles, request)
    if not fitting:
        assert compared.chosen is None
        return
    expected = min(fitting)[1]
    assert compared.chosen == expected
    plan = compared.result.plan
    assert plan.predicted == alone[expected].plan.predicted
    assert plan.checkpoint == alone[expected].plan.checkpoint
    assert plan.micro_batch_size == alone[expected].plan.micro_batch_size
    assert [r.result is not None for r in compared.rows] == [r is not None for r in alone]


# ------------------------------------------------------------------ refusals (library)
def _refusal(other: Profile, request: SolveRequest | None = None) -> str:
    with pytest.raises(BadInputError) as info:
        solve_compared([("bf16.yaml", BF16), ("other.yaml", other)], request or _request(1 << 30))
    return str(info.value)


def test_the_same_file_however_spelled_is_refused_by_the_library_too():
    # solve_compared refuses what the CLI refuses (solver.compare.same_file_problem): the
    # main profile again as ./bf16.yaml, or a compared file named twice.
    with pytest.raises(BadInputError, match=r"\./bf16\.yaml is the same file as the main"):
        solve_compared([("bf16.yaml", BF16), ("./bf16.yaml", FLOAT8)], _request(1 << 30))
    with pytest.raises(BadInputError, match=r"same file as --compare f8\.yaml"):
        solve_compared(
            [("bf16.yaml", BF16), ("f8.yaml", FLOAT8), ("sub/../f8.yaml", FLOAT8)],
            _request(1 << 30),
        )


def test_another_model_is_refused_naming_the_file():
    other = dataclasses.replace(FLOAT8, model=ModelRef(path="model.py", sha256="cd" * 32))
    text = _refusal(other)
    assert text.startswith("other.yaml profiles another model: model.py (sha256 cdcdcdcdcdcd…)")
    renamed = dataclasses.replace(FLOAT8, layers=tuple(
        dataclasses.replace(layer, name=f"blocks.{i}") for i, layer in enumerate(FLOAT8.layers)
    ))  # fmt: skip
    text = _refusal(renamed)
    assert text.startswith(
        "other.yaml has other checkpoint candidates than bf16.yaml: 'blocks.0' where "
        "bf16.yaml has 'h.0'."
    )


def test_times_of_another_device_are_refused():
    meta = dataclasses.replace(
        FLOAT8,
        environment=_env(
            True, device="meta", device_name="meta (timed as h100-80gb)",
            device_profile="h100-80gb",
        ),
    )  # fmt: skip
    assert _refusal(meta).startswith(
        "other.yaml's step times are meta clock against h100-80gb, bf16.yaml's measured on "
        "cpu: the times are not comparable."
    )


def test_a_float8_profile_retimed_by_roofline_is_refused():
    from memplan.devices import load_device

    def on_meta(profile: Profile, float8: bool) -> Profile:
        env = _env(float8, device="meta", device_profile="a100-80gb")
        return dataclasses.replace(profile, environment=env)

    request = _request(1 << 30, device_spec=load_device("h100-80gb"))
    with pytest.raises(BadInputError) as info:
        solve_compared(
            [("bf16.yaml", on_meta(BF16, False)), ("float8.yaml", on_meta(FLOAT8, True))], request
        )
    assert "would both be timed roofline from FLOPs against h100-80gb" in str(info.value)
    # the same precision retimed alike compares
    other = dataclasses.replace(on_meta(BF16, False), micro_batches=(1, 2))
    compared = solve_compared([("a.yaml", on_meta(BF16, False)), ("b.yaml", other)], request)
    assert compared.chosen == 0


# ------------------------------------------------------------------ the command line
@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, profile in (("bf16", BF16), ("float8", FLOAT8)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(profile_to_yaml(profile))
    return paths


def _solve(*args) -> object:
    return runner.invoke(app, ["solve", *map(str, args)], catch_exceptions=False)


def test_cli_writes_the_faster_plan_and_prints_every_profile(files, tmp_path):
    out = tmp_path / "plan.yaml"
    result = _solve(
        files["bf16"], "--compare", files["float8"], "--target-batch", 8, "--budget", "1GiB",
        "--margin", 0, "-o", out, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    request = _request(1 << 30)
    bf16, float8 = solve(BF16, request).plan, solve(FLOAT8, request).plan
    assert [r["profile"] for r in data["compared"]] == [str(files["bf16"]), str(files["float8"])]
    assert [r["precision"] for r in data["compared"]] == ["bf16", "float8 tensorwise"]
    assert [r["chosen"] for r in data["compared"]] == [False, True]
    assert [r["step_seconds"] for r in data["compared"]] == [
        pytest.approx(bf16.predicted.step_seconds),
        pytest.approx(float8.predicted.step_seconds),
    ]
    assert [r["micro_batch"] for r in data["compared"]] == [8, 8]
    assert data["compared"][0]["time_vs_chosen"] == pytest.approx(
        bf16.predicted.step_seconds / float8.predicted.step_seconds
    )
    written = load_plan(out)
    assert written.profile == str(files["float8"])
    assert written.float8 is not None
    assert written.predicted.peak_bytes == float8.predicted.peak_bytes
    assert "is the fastest of 2 profiles solved alike" in written.reasons[-1]
    table = _solve(
        files["bf16"], "--compare", files["float8"], "--target-batch", 8, "--budget", "1GiB",
    )  # fmt: skip
    assert table.exit_code == 0
    assert "profiles compared" in table.output and "float8 tensorwise" in table.output


def test_cli_none_fits_is_the_main_profiles_error(files, tmp_path):
    budget = _least(BF16, _request(1 << 30)) - 1
    out = tmp_path / "plan.yaml"
    result = _solve(
        files["bf16"], "--compare", files["float8"], "--target-batch", 8, "--budget", budget,
        "--margin", 0, "-o", out, "--json",
    )  # fmt: skip
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["feasible"] is False
    assert data["min_peak_bytes"] == _least(BF16, _request(budget))
    assert [r["fits"] for r in data["compared"]] == [False, False]
    assert not out.exists()


@pytest.mark.parametrize("how", ["itself", "spelled", "twice"])
def test_cli_the_same_file_twice_is_exit_2(files, tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    main, other = files["bf16"], files["float8"]
    again = {
        "itself": [main],
        "spelled": [tmp_path / "." / main.name],
        "twice": [other, f"./{other.name}"],
    }[how]
    extra = [a for path in again for a in ("--compare", path)]
    out = tmp_path / "plan.yaml"
    result = _solve(main, *extra, "--target-batch", 8, "--budget", "1GiB", "-o", out)
    assert result.exit_code == 2, result.output
    assert "is the same file as" in result.output
    assert not out.exists()


def test_cli_another_model_or_device_is_exit_2_and_writes_nothing(files, tmp_path):
    out = tmp_path / "plan.yaml"
    other = tmp_path / "other.yaml"
    other.write_text(profile_to_yaml(dataclasses.replace(FLOAT8, model=ModelRef(path="x.py"))))
    result = _solve(files["bf16"], "--compare", other, "--target-batch", 8, "--budget", "1GiB",
                    "-o", out)  # fmt: skip
    assert result.exit_code == 2
    assert f"{other} profiles another model: x.py" in " ".join(result.output.split())
    meta = tmp_path / "meta.yaml"
    env = _env(True, device="meta", device_profile="h100-80gb")
    meta.write_text(profile_to_yaml(dataclasses.replace(FLOAT8, environment=env)))
    result = _solve(files["bf16"], "--compare", meta, "--target-batch", 8, "--budget", "1GiB",
                    "-o", out, "--json")  # fmt: skip
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["exit_code"] == 2
    assert data["error"].startswith(f"{meta}'s step times are meta clock against h100-80gb")
    assert not out.exists()


# ------------------------------------------------------------------ real probes
@pytest.mark.slow  # two meta probes of a tiny model (torchao's Float8Linear), ~10 s each
def test_real_bf16_and_float8_probes_compare_as_each_solved_alone(tmp_path):
    """tests/models/float8_block.py probed on meta against h100-80gb in bf16 and in float8
    (FSDP's mixed-precision policy, as torchtitan trains): the same model file (one sha256),
    one timing basis. ``solve --compare`` writes the plan of the faster that fits, as each
    solved alone says; at a budget between their least peaks, the one that fits."""
    pytest.importorskip("torchao.float8", reason="the 'float8' extra (torchao) is not installed")
    from pathlib import Path

    from memplan.devices import load_device
    from memplan.profile import load_profile

    model = Path(__file__).resolve().parent / "models" / "float8_block.py"
    paths = {}
    for precision in ("bf16", "float8"):
        paths[precision] = tmp_path / f"{precision}.yaml"
        probed = runner.invoke(
            app,
            ["probe", str(model), "--device", "meta", "--precision", precision,
             "--mixed-precision", "params", "--device-profile", "h100-80gb",
             "--micro-batches", "1,2,4", "-o", str(paths[precision])],
        )  # fmt: skip
        assert probed.exit_code == 0, probed.output
    profiles = {name: load_profile(path) for name, path in paths.items()}
    assert profiles["bf16"].model.sha256 == profiles["float8"].model.sha256
    spec = load_device("h100-80gb")
    base = SolveRequest(
        target_batch=16, budget_bytes=spec.memory_bytes, world_size=2, strategy="fsdp",
        device_spec=spec, min_micro=2, max_micro=2, margin=0.0,
    )  # fmt: skip
    alone = {name: solve(p, base).plan for name, p in profiles.items()}
    faster = min(alone, key=lambda name: (alone[name].predicted.step_seconds, name != "bf16"))
    out = tmp_path / "plan.yaml"
    args = [
        "solve", str(paths["bf16"]), "--compare", str(paths["float8"]), "--target-batch", "16",
        "--world-size", "2", "--strategy", "fsdp", "--device-profile", "h100-80gb",
        "--min-micro", "2", "--max-micro", "2", "--margin", "0", "--json",
    ]  # fmt: skip
    result = runner.invoke(app, [*args, "--budget", "100%", "-o", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["compared"]
    assert [r["step_seconds"] for r in rows] == [
        pytest.approx(alone["bf16"].predicted.step_seconds),
        pytest.approx(alone["float8"].predicted.step_seconds),
    ]
    assert [r["peak_bytes"] for r in rows] == [
        alone["bf16"].predicted.peak_bytes,
        alone["float8"].predicted.peak_bytes,
    ]
    written = load_plan(out)
    assert written.profile == str(paths[faster])
    assert written.predicted.peak_bytes == alone[faster].predicted.peak_bytes
    assert (written.float8 is not None) == (faster == "float8")
    # a budget only the smaller least peak fits
    least = {name: _least(p, base) for name, p in profiles.items()}
    assert least["bf16"] != least["float8"]
    small = min(least, key=least.get)
    budget = min(least.values())
    only = runner.invoke(app, [*args, "--budget", str(budget)])
    assert only.exit_code == 0, only.output
    rows = json.loads(only.stdout)["compared"]
    assert [r["fits"] for r in rows] == [small == "bf16", small == "float8"]
    assert json.loads(only.stdout)["plan"]["profile"] == str(paths[small])
