"""The check result object and its renderings, with hand-built profiles and a stand-in
probe and solver: exit-code mapping, growth by layer name, JSON shape, JUnit counts and
the GitHub step summary. Milliseconds; the real probe runs in test_check_cli.py."""

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.check import (
    CheckReport,
    CheckResult,
    diff_profiles,
    load_config,
    run_checks,
    suggested_budget,
    to_json_data,
    to_junit_xml,
    to_markdown,
)
from memplan.check.formats import xml_safe
from memplan.errors import BadInputError, CannotMeasureError, ModelFileError, NoPlanFitsError
from memplan.plan import Breakdown, Plan, Prediction
from memplan.profile import (
    Affine,
    Environment,
    FixedPart,
    Layer,
    ModelRef,
    Profile,
    Segment,
    Totals,
    load_profile,
    profile_to_yaml,
)
from memplan.units import GiB, MiB

MODELS = Path(__file__).parent / "models"


# ----------------------------------------------------------------------------- JSON shape
NULLABLE = object()

CHECK_SHAPE = {
    "name": str,
    "status": str,
    "model": str,
    "device": str,
    "device_profile": (str, None),
    "precision": str,
    "target_batch": int,
    "world_size": int,
    "budget_bytes": int,
    "margin": float,
    "usable_budget_bytes": int,
    "min_peak_bytes": (int, None),
    "headroom_bytes": (int, None),
    "exceeded_by_bytes": (int, None),
    "plan": (dict, None),
    "baseline": (str, None),
    "baseline_updated": bool,
    "baseline_note": str,
    "growth": list,
    "advice": list,
    "message": str,
    "exit_code": int,
    "seconds": dict,
}
PLAN_SHAPE = {
    "micro_batch_size": int,
    "accumulation_steps": int,
    "world_size": int,
    "checkpointed": int,
    "n_layers": int,
    "checkpoint_layers": list,
    "checkpoint": dict,
    "peak_bytes": int,
    "step_seconds": float,
    "peak_phase": str,
    "breakdown": dict,
}
BREAKDOWN_SHAPE = {
    "params": int,
    "grads": int,
    "optimizer": int,
    "activations": int,
    "transient": int,
    "reserve": int,
}
GROWTH_SHAPE = {
    "name": str,
    "kind": str,
    "quantity": str,
    "baseline": (float, None),
    "current": (float, None),
    "delta": float,
}


def _check_keys(obj: dict, shape: dict, where: str) -> None:
    assert set(obj) == set(shape), f"{where}: keys {sorted(obj)} != {sorted(shape)}"
    for key, expected in shape.items():
        types = expected if isinstance(expected, tuple) else (expected,)
        value = obj[key]
        ok = any(
            (t is None and value is None)
            or (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (
                t not in (None, float)
                and isinstance(value, t)
                and not (t is int and isinstance(value, bool))
            )
            for t in types
        )
        assert ok, f"{where}.{key} = {value!r} is not {types}"


def validate_json_shape(data: dict) -> None:
    """The shape documented in docs/ci.md and memplan.check.to_json_data."""
    _check_keys(
        data,
        {
            "memplan_version": str,
            "config": str,
            "passed": bool,
            "exit_code": int,
            "summary": dict,
            "checks": list,
        },
        "report",
    )
    _check_keys(
        data["summary"],
        {"total": int, "passed": int, "failed": int, "errors": int, "seconds": float},
        "summary",
    )
    assert data["summary"]["total"] == len(data["checks"])
    for i, check in enumerate(data["checks"]):
        where = f"checks[{i}]"
        _check_keys(check, CHECK_SHAPE, where)
        assert check["status"] in ("pass", "fail", "error")
        assert check["exit_code"] in (0, 1, 2, 3)
        _check_keys(
            check["seconds"], {"probe": float, "solve": float, "total": float}, f"{where}.seconds"
        )
        if check["plan"] is not None:
            _check_keys(check["plan"], PLAN_SHAPE, f"{where}.plan")
            assert all(isinstance(n, str) for n in check["plan"]["checkpoint_layers"])
            assert check["plan"]["checkpointed"] == len(check["plan"]["checkpoint_layers"])
            assert list(check["plan"]["checkpoint"]) == check["plan"]["checkpoint_layers"]
            assert set(check["plan"]["checkpoint"].values()) <= {"selective", "full", "offload"}
            _check_keys(check["plan"]["breakdown"], BREAKDOWN_SHAPE, f"{where}.plan.breakdown")
        for j, growth in enumerate(check["growth"]):
            _check_keys(growth, GROWTH_SHAPE, f"{where}.growth[{j}]")
            assert growth["kind"] in ("layer", "fixed", "total")
            assert growth["quantity"] in (
                "params_bytes",
                "activation_bytes_per_sample",
                "grad_bytes",
                "optimizer_state_bytes",
            )
        assert all(isinstance(tip, str) for tip in check["advice"])
        if check["status"] == "pass":
            assert check["exit_code"] == 0 and check["headroom_bytes"] >= 0
    json.dumps(data)  # serialisable as is


# ----------------------------------------------------------------------------- fixtures
def layer(name: str, params: int, act_per_sample: float) -> Layer:
    zero = Affine.zero()
    return Layer(
        name=name,
        module_type="Block",
        params_trainable_bytes=params,
        params_frozen_bytes=0,
        grad_bytes=params,
        optimizer_state_bytes=2 * params,
        input_bytes=zero,
        output_bytes=zero,
        saved_bytes=Affine(intercept=0.0, slope=act_per_sample),
        savings_bytes=zero,
        fwd_transient_bytes=zero,
        bwd_transient_bytes=zero,
        recompute_transient_bytes=zero,
        fwd_seconds=zero,
        bwd_seconds=zero,
        fwd_flops=zero,
    )


def profile(layers: list[Layer]) -> Profile:
    params = sum(x.params_trainable_bytes for x in layers)
    # every segment a probe records (each layer's forward and backward), each holding the
    # state and gradients the totals count, as a probe's live bytes do
    live = ((100.0 + 3 * params, 2.0),)
    n = len(layers)
    order = [(0, "none")] + [(i + d, a) for i in range(n) for d, a in ((0, "fwd"), (1, "none"))]
    order += [(i, "bwd") for i in reversed(range(n))]
    seg = tuple(
        Segment(held=h, active=a, points=live, ckpt_points=() if a == "none" else live)  # type: ignore[arg-type]
        for h, a in order
    )
    return Profile(
        model=ModelRef(path="m.py"),
        environment=Environment(
            torch_version="2", memplan_version="0.1.0", device="meta", device_name="meta"
        ),
        micro_batches=(1, 2, 4),
        totals=Totals(
            params_trainable_bytes=params,
            params_frozen_bytes=0,
            buffer_bytes=0,
            grad_bytes=params,
            optimizer_state_bytes=2 * params,
        ),
        layers=tuple(layers),
        fixed=(),
        timeline={"no_grads": seg, "grads_resident": seg},
        optimizer_step_peak_bytes=Affine.constant(4 * params),
        optimizer_step_seconds=Affine.zero(),
        step_fixed_seconds=Affine.zero(),
    )


def small() -> Profile:
    return profile([layer(f"h.{i}", 1 * MiB, 64 * 1024) for i in range(4)])


def grown() -> Profile:
    layers = [layer(f"h.{i}", 1 * MiB, 64 * 1024) for i in range(4)]
    layers[2] = layer("h.2", 8 * MiB, 512 * 1024)
    return profile(layers)


def fake_plan(peak: int, budget: int, *, micro: int, target: int, ckpt: int) -> Plan:
    return Plan(
        target_batch=target,
        micro_batch_size=micro,
        accumulation_steps=target // micro,
        checkpoint=dict.fromkeys((f"h.{i}" for i in range(ckpt)), "full"),
        budget_bytes=budget,
        predicted=Prediction(
            peak_bytes=peak,
            step_seconds=0.1,
            breakdown=Breakdown(
                params=0, grads=0, optimizer=0, activations=peak, transient=0, reserve=0
            ),
        ),
        model="m.py",
    )


def fake_solver(min_peak_of):
    """A solver whose least peak is ``min_peak_of(profile)``; it fits when that is within
    budget × (1 − margin), as the real one does."""

    def solve(prof, request):
        need = min_peak_of(prof)
        target = request.target_batch
        if need <= request.budget_bytes * (1 - request.margin):
            return SimpleNamespace(
                plan=fake_plan(need, request.budget_bytes, micro=target, target=target, ckpt=0),
                candidates=(),
            )
        raise NoPlanFitsError(
            "nothing fits",
            min_peak_bytes=need,
            closest=fake_plan(need, request.budget_bytes, micro=2, target=target, ckpt=4),
        )

    return solve


def fakes(min_peak_of):
    """``run_checks`` keyword arguments for the stand-in solver and its least peak."""

    def least_peak(prof, request):
        need = min_peak_of(prof)
        target = request.target_batch
        plan = fake_plan(need, request.budget_bytes, micro=2, target=target, ckpt=4)
        return SimpleNamespace(peak_bytes=need, plan=plan)

    return {"solve_fn": fake_solver(min_peak_of), "least_peak_fn": least_peak}


def need_bytes(prof: Profile) -> int:
    return int(
        sum(4 * x.params_trainable_bytes for x in prof.layers)
        + 32 * sum(x.saved_bytes.slope for x in prof.layers)
    )


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "memplan.yaml"
    checks = [
        {
            "name": n,
            "model": str(MODELS / "check_small.py"),
            "target_batch": 32,
            "budget": "32MiB",
            "baseline": f"{n}.profile.yaml",
        }
        for n in ("a", "b")
    ]
    checks[1]["layers"] = "h.*"  # probed differently from "a": not one shared probe
    path.write_text(yaml.safe_dump({"checks": checks}), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- tests
def test_diff_profiles_names_the_grown_layer():
    growth = diff_profiles(small(), grown())
    layer_growth = [g for g in growth if g.kind == "layer"]
    assert {(g.name, g.quantity) for g in layer_growth} == {
        ("h.2", "params_bytes"),
        ("h.2", "activation_bytes_per_sample"),
    }
    params = next(g for g in layer_growth if g.quantity == "params_bytes")
    assert params.baseline == MiB and params.current == 8 * MiB and params.delta == 7 * MiB
    totals = {g.quantity: g.delta for g in growth if g.kind == "total"}
    assert totals["params_bytes"] == 7 * MiB
    assert totals["optimizer_state_bytes"] == 14 * MiB
    assert totals["activation_bytes_per_sample"] == (512 - 64) * 1024
    assert diff_profiles(small(), small()) == ()


def test_diff_profiles_reports_added_and_removed_layers():
    five = profile([layer(f"h.{i}", MiB, 1024) for i in range(5)])
    growth = diff_profiles(small(), five)
    added = [g for g in growth if g.name == "h.4"]
    assert added and all(g.baseline is None for g in added)
    removed = [g for g in diff_profiles(five, small()) if g.name == "h.4"]
    assert removed and all(g.current is None for g in removed)


def _with_fixed(base: Profile, parts: dict[str, tuple[int, float]]) -> Profile:
    zero = Affine.zero()
    fixed = tuple(
        FixedPart(
            name=name,
            module_type="ModuleList" if "." not in name[len("enc.") :] else "Attention",
            params_trainable_bytes=params,
            params_frozen_bytes=0,
            grad_bytes=params,
            optimizer_state_bytes=2 * params,
            saved_bytes=Affine(intercept=0.0, slope=slope),
            fwd_seconds=zero,
            bwd_seconds=zero,
            fwd_flops=zero,
        )
        for name, (params, slope) in parts.items()
    )
    return dataclasses.replace(base, fixed=fixed)


def test_a_container_split_into_its_children_is_compared_whole():
    """A baseline written before memplan split a plain ModuleList among the fixed parts into
    its children: ``enc.attn`` then, ``enc.attn.0`` and ``enc.attn.1`` now. Before, the diff
    said ``enc.attn`` was removed and two parts were new; now the children's sums are
    compared with the container: the same parameters are no growth, and the bytes the old
    profile could not see (a container has no forward to record) are growth of ``enc.attn``."""
    old = _with_fixed(small(), {"enc.attn": (2 * MiB, 0.0), "enc.norm": (4096, 0.0)})
    same = _with_fixed(
        small(), {"enc.attn.0": (MiB, 0.0), "enc.attn.1": (MiB, 0.0), "enc.norm": (4096, 0.0)}
    )
    assert [g for g in diff_profiles(old, same) if g.kind == "fixed"] == []
    seen = _with_fixed(
        small(),
        {"enc.attn.0": (MiB, 8192.0), "enc.attn.1": (MiB, 8192.0), "enc.norm": (4096, 0.0)},
    )
    fixed = [g for g in diff_profiles(old, seen) if g.kind == "fixed"]
    assert [(g.name, g.quantity, g.baseline, g.current) for g in fixed] == [
        ("enc.attn", "activation_bytes_per_sample", 0.0, 16384.0)
    ]
    # either way round; a new part inside a container both sides have is news
    assert [g for g in diff_profiles(same, old) if g.kind == "fixed"] == []
    extra = _with_fixed(small(), {"enc.attn": (2 * MiB, 0.0), "enc.attn.gate": (MiB, 0.0)})
    news = [g for g in diff_profiles(old, extra) if g.kind == "fixed"]
    assert sorted((g.name, g.baseline or 0, g.current or 0) for g in news) == [
        ("enc.attn.gate", 0, MiB),
        ("enc.norm", 4096, 0),
    ]


def test_growth_flips_pass_to_fail_and_names_the_layer(config):
    solve = fakes(need_bytes)
    report = run_checks(config, update_baseline=True, probe_fn=lambda *a, **k: small(), **solve)
    assert report.exit_code == 0 and report.passed
    assert all(r.baseline_updated for r in report.results)
    assert (config.parent / "a.profile.yaml").is_file()

    report = run_checks(config, probe_fn=lambda *a, **k: grown(), **solve)
    assert report.exit_code == 1
    result = report.results[0]
    assert result.status == "fail"
    assert result.exceeded_by_bytes == need_bytes(grown()) - int(32 * MiB * 0.97)
    assert result.grown[0].name == "h.2"
    assert any("raise the budget" in tip and "checks[0].budget" in tip for tip in result.advice)
    assert any("h.2" in tip for tip in result.advice)
    assert not any("checkpoint more" in tip for tip in result.advice)  # all 4 already are
    validate_json_shape(to_json_data(report))
    # The baseline was not touched by a run without --update-baseline.
    kept = load_profile(config.parent / "a.profile.yaml")
    assert kept.layers[2].params_trainable_bytes == MiB


def test_exit_code_over_budget_outranks_errors(config):
    """The run's exit code (memplan.check.result): 1 when any check is over budget, else 2
    when a check could not run, else 3 when one could not be measured."""

    def probe(request):
        raise CannotMeasureError("aten::nonzero has no meta kernel")

    report = run_checks(config, probe_fn=probe, **fakes(need_bytes))
    assert report.exit_code == 3
    assert {r.status for r in report.results} == {"error"}
    validate_json_shape(to_json_data(report))

    def by_model(outcomes):
        def probe(request):
            outcome = outcomes[Path(request.model_arg).name]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return probe

    data = yaml.safe_load(config.read_text())
    data["checks"][1]["model"] = str(MODELS / "check_grown.py")
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    broken = ModelFileError("m.py: make_batch() raised ValueError")
    probe = by_model({"check_small.py": grown(), "check_grown.py": broken})
    report = run_checks(config, probe_fn=probe, **fakes(need_bytes))
    assert [r.status for r in report.results] == ["fail", "error"]
    assert [r.exit_code for r in report.results] == [1, 2]
    assert report.exit_code == 1

    probe = by_model({"check_small.py": small(), "check_grown.py": broken})
    report = run_checks(config, probe_fn=probe, **fakes(need_bytes))
    assert [r.status for r in report.results] == ["pass", "error"]
    assert report.exit_code == 2

    cannot = CannotMeasureError("no GPU")
    probe = by_model({"check_small.py": cannot, "check_grown.py": broken})
    assert run_checks(config, probe_fn=probe, **fakes(need_bytes)).exit_code == 2


def test_identical_probes_are_shared(config, tmp_path):
    """Checks that probe the same model the same way probe it once; another device or
    precision is another probe."""
    data = yaml.safe_load(config.read_text())
    data["checks"] += [
        {**data["checks"][0], "name": "c", "target_batch": 64, "budget": "64MiB"},
        {**data["checks"][0], "name": "d", "precision": "bf16"},
    ]
    for check in data["checks"][2:]:  # each check its own baseline file (load_config)
        check["baseline"] = f"{check['name']}.profile.yaml"
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    seen = []

    def probe(request):
        seen.append(request)
        return small()

    report = run_checks(config, probe_fn=probe, **fakes(need_bytes))
    assert [r.status for r in report.results] == ["pass"] * 4
    # a and c share a probe; b (its own layers glob) and d (bf16) each have their own.
    assert [(r.settings.precision, r.settings.layers) for r in seen] == [
        ("fp32", None),
        ("fp32", "h.*"),
        ("bf16", None),
    ]


def test_only_runs_the_named_check(config):
    report = run_checks(config, only=["b"], probe_fn=lambda *a, **k: small(), **fakes(need_bytes))
    assert [r.name for r in report.results] == ["b"]
    assert report.results[0].baseline_note.startswith("baseline b.profile.yaml does not exist")


def test_junit_counts_failures_and_errors(config):
    probes = iter([small(), grown()])
    report = run_checks(config, probe_fn=lambda *a, **k: next(probes), **fakes(need_bytes))
    root = ET.fromstring(to_junit_xml(report))
    (suite,) = root.findall("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    assert suite.get("errors") == "0"
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["a", "b"]
    assert cases[0].find("failure") is None
    failure = cases[1].find("failure")
    assert "exceeded by" in failure.get("message")
    assert "what to do" in failure.text


def test_markdown_summary(config, monkeypatch, tmp_path):
    probes = iter([small(), grown()])
    report = run_checks(config, probe_fn=lambda *a, **k: next(probes), **fakes(need_bytes))
    text = to_markdown(report)
    assert "| a | ✅ pass |" in text and "| b | ❌ fail |" in text
    assert "exceeded by" in text
    from memplan.check import append_step_summary

    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert append_step_summary(report) == summary
    assert summary.read_text().startswith("earlier step\n### memplan check: failed")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    assert append_step_summary(report) is None


def test_suggested_budget_rounds_up_and_fits():
    for peak in (1, 5 * MiB, 700 * MiB, 3 * GiB, 21 * GiB + 1):
        from memplan.units import parse_size

        budget = parse_size(suggested_budget(peak, 0.03))
        assert budget * 0.97 >= peak
    assert suggested_budget(21 * GiB, 0.03) == "22GiB"


def test_config_loaded_once_is_reusable(config):
    loaded = load_config(config)
    report = run_checks(loaded, probe_fn=lambda *a, **k: small(), **fakes(need_bytes))
    assert report.results[0].probe_seconds >= 0 and report.results[0].seconds >= 0
    assert dataclasses.is_dataclass(report)


# ----------------------------------------------------------------------------- hostile input
def test_control_characters_in_a_name_still_make_valid_junit(config):
    """XML 1.0 cannot hold \\x01 even escaped: the name is written with it spelled out."""
    data = yaml.safe_load(config.read_text())
    data["checks"][0]["name"] = "evil\x01name\x1b[31m"
    data["checks"][1]["name"] = "bad\ufffe"
    config.write_text(yaml.safe_dump(data), encoding="utf-8")

    def probe(request):
        if request.settings.layers:
            raise ModelFileError("m.py: raised ValueError: \x00\x07 in a message")
        return grown()

    report = run_checks(config, probe_fn=probe, **fakes(need_bytes))
    assert [r.status for r in report.results] == ["fail", "error"]
    suite = ET.fromstring(to_junit_xml(report)).find("testsuite")
    names = [case.get("name") for case in suite.iter("testcase")]
    assert names == ["evil\\x01name\\x1b[31m", "bad\\ufffe"]
    error = suite.find("testcase/error")
    assert error.get("message") == "m.py: raised ValueError: \\x00\\x07 in a message"
    assert (suite.get("failures"), suite.get("errors")) == ("1", "1")


@settings(max_examples=200, deadline=None)
@given(name=st.text(min_size=1), message=st.text())
def test_any_name_or_message_makes_parseable_junit(name, message):
    """Whatever a check is called and whatever its error says, the JUnit file parses and
    keeps every character XML can hold."""
    common = {
        "model": "m.py",
        "device": "meta",
        "device_profile": None,
        "precision": "fp32",
        "target_batch": 8,
        "world_size": 1,
        "budget_bytes": MiB,
        "margin": 0.03,
    }
    report = CheckReport(
        config="memplan.yaml",
        results=(
            CheckResult(name=name, status="error", message=message, exit_code=2, **common),
            CheckResult(name=name + "2", status="pass", min_peak_bytes=1, **common),
        ),
    )
    suite = ET.fromstring(to_junit_xml(report).encode("utf-8")).find("testsuite")
    names = [case.get("name") for case in suite.iter("testcase")]
    # ElementTree writes tab, newline and carriage return in attributes as character
    # references, so they survive the parser's attribute normalisation.
    assert names == [xml_safe(name), xml_safe(name + "2")]
    assert suite.find("testcase/error").get("message") == xml_safe(message)


@pytest.mark.parametrize(
    "target",
    ["../outside/victim.txt", "model.py", "memplan.yaml", "folder", "link.yaml"],
)
def test_update_baseline_never_writes_outside_the_tree_or_over_a_non_profile(tmp_path, target):
    """#10 item 5: --update-baseline refuses a baseline outside the config's folder, a
    model's source, the config itself, a folder and a link out of the tree, before probing."""
    root = tmp_path / "repo"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("keep me\n", encoding="utf-8")
    model = root / "model.py"
    model.write_text((MODELS / "check_small.py").read_text(), encoding="utf-8")
    (root / "folder").mkdir()
    (root / "link.yaml").symlink_to(victim)
    config = root / "memplan.yaml"
    checks = [{"name": "a", "model": "model.py", "target_batch": 32, "budget": "32MiB"}]
    checks[0]["baseline"] = target
    config.write_text(yaml.safe_dump({"checks": checks}), encoding="utf-8")
    before = {p: p.read_bytes() for p in (victim, model, config)}
    probed = []

    def probe(request):
        probed.append(request)
        return small()

    with pytest.raises(BadInputError, match=r"checks\[0\]\.baseline"):
        run_checks(config, update_baseline=True, probe_fn=probe, **fakes(need_bytes))
    assert probed == []
    assert {p: p.read_bytes() for p in before} == before
    assert (root / "folder").is_dir() and (root / "link.yaml").is_symlink()

    # Without --update-baseline the same config only reads (and says the file is no profile).
    report = run_checks(config, probe_fn=probe, **fakes(need_bytes))
    assert report.results[0].status == "pass"
    assert {p: p.read_bytes() for p in before} == before


def test_update_baseline_writes_inside_the_tree_and_over_a_profile(config):
    (config.parent / "a.profile.yaml").write_text(profile_to_yaml(grown()), encoding="utf-8")
    report = run_checks(
        config, update_baseline=True, probe_fn=lambda request: small(), **fakes(need_bytes)
    )
    assert [r.baseline_updated for r in report.results] == [True, True]
    assert load_profile(config.parent / "a.profile.yaml").layers[2].params_trainable_bytes == MiB
