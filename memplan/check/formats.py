"""The check report as text for machines and CI pages: JSON (``--json``), JUnit XML
(``--junit``) and the GitHub step-summary Markdown. Pure text functions of a CheckReport.

JUnit XML is XML 1.0, which cannot carry most control characters even escaped: a check name
or message with one (``\\x01``) is written with it spelled out as ``\\x01``, so the file
always parses.
"""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from memplan.check.advice import failure_text, plan_text, verdict
from memplan.check.result import CheckReport
from memplan.units import format_bytes

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]

# Characters XML 1.0 does not allow (its Char production): C0 controls but tab, newline and
# carriage return; surrogates; U+FFFE and U+FFFF.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """``text`` with every character XML 1.0 cannot hold spelled as ``\\xNN``/``\\uNNNN``."""
    return _NOT_XML.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


# ----------------------------------------------------------------------------- JSON
def to_json_data(report: CheckReport) -> dict[str, JsonValue]:
    """The ``memplan check --json`` object (documented in docs/ci.md)::

        {
          "memplan_version": str, "config": str, "passed": bool, "exit_code": int,
          "summary": {"total": int, "passed": int, "failed": int, "errors": int,
                      "seconds": float},
          "checks": [{
            "name": str, "status": "pass" | "fail" | "error", "model": str,
            "device": str, "device_profile": str | null, "precision": str,
            "target_batch": int, "world_size": int,
            "budget_bytes": int, "margin": float, "usable_budget_bytes": int,
            "min_peak_bytes": int | null, "headroom_bytes": int | null,
            "exceeded_by_bytes": int | null,
            "plan": null | {"micro_batch_size": int, "accumulation_steps": int,
                            "world_size": int, "checkpointed": int, "n_layers": int,
                            "checkpoint_layers": [str],
                            "checkpoint": {layer: "selective" | "full" | "offload"},
                            "peak_bytes": int,
                            "step_seconds": float, "peak_phase": str,
                            "breakdown": {"params": int, "grads": int, "optimizer": int,
                                          "activations": int, "transient": int,
                                          "reserve": int}},
            "baseline": str | null, "baseline_updated": bool, "baseline_note": str,
            "growth": [{"name": str, "kind": "layer" | "fixed" | "total",
                        "quantity": "params_bytes" | "activation_bytes_per_sample"
                                    | "grad_bytes" | "optimizer_state_bytes",
                        "baseline": float | null, "current": float | null,
                        "delta": float}],
            "advice": [str], "message": str, "exit_code": int,
            "seconds": {"probe": float, "solve": float, "total": float}
          }]
        }

    ``plan`` is the plan a passing check would use, or the closest plan of a failing one.
    """
    from memplan.version import __version__

    checks: list[JsonValue] = []
    for r in report.results:
        plan: JsonValue = None
        if r.plan is not None:
            plan = {
                "micro_batch_size": r.plan.micro_batch_size,
                "accumulation_steps": r.plan.accumulation_steps,
                "world_size": r.plan.world_size,
                "checkpointed": r.plan.checkpointed,
                "n_layers": r.plan.n_layers,
                "checkpoint_layers": list(r.plan.checkpoint_layers),
                "checkpoint": dict(r.plan.checkpoint),
                "peak_bytes": r.plan.peak_bytes,
                "step_seconds": r.plan.step_seconds,
                "peak_phase": r.plan.peak_phase,
                "breakdown": dict(r.plan.breakdown),
            }
        checks.append(
            {
                "name": r.name,
                "status": r.status,
                "model": r.model,
                "device": r.device,
                "device_profile": r.device_profile,
                "precision": r.precision,
                "target_batch": r.target_batch,
                "world_size": r.world_size,
                "budget_bytes": r.budget_bytes,
                "margin": r.margin,
                "usable_budget_bytes": r.usable_budget_bytes,
                "min_peak_bytes": r.min_peak_bytes,
                "headroom_bytes": r.headroom_bytes,
                "exceeded_by_bytes": r.exceeded_by_bytes,
                "plan": plan,
                "baseline": r.baseline,
                "baseline_updated": r.baseline_updated,
                "baseline_note": r.baseline_note,
                "growth": [
                    {
                        "name": g.name,
                        "kind": g.kind,
                        "quantity": g.quantity,
                        "baseline": g.baseline,
                        "current": g.current,
                        "delta": g.delta,
                    }
                    for g in r.growth
                ],
                "advice": list(r.advice),
                "message": r.message,
                "exit_code": r.exit_code,
                "seconds": {"probe": r.probe_seconds, "solve": r.solve_seconds, "total": r.seconds},
            }
        )
    return {
        "memplan_version": __version__,
        "config": report.config,
        "passed": report.passed,
        "exit_code": report.exit_code,
        "summary": {
            "total": len(report.results),
            "passed": report.count("pass"),
            "failed": report.count("fail"),
            "errors": report.count("error"),
            "seconds": sum(r.seconds for r in report.results),
        },
        "checks": checks,
    }


def to_json(report: CheckReport) -> str:
    return json.dumps(to_json_data(report), indent=2)


# ----------------------------------------------------------------------------- JUnit
def to_junit_xml(report: CheckReport) -> str:
    """One ``<testcase>`` per check in one ``<testsuite name="memplan check">``; a check over
    budget is a ``<failure>``, one that could not be measured an ``<error>``."""
    suite = ET.Element(
        "testsuite",
        {
            "name": "memplan check",
            "tests": str(len(report.results)),
            "failures": str(report.count("fail")),
            "errors": str(report.count("error")),
            "skipped": "0",
            "time": f"{sum(r.seconds for r in report.results):.3f}",
        },
    )
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            {"classname": "memplan.check", "name": xml_safe(r.name), "time": f"{r.seconds:.3f}"},
        )
        if r.status == "fail":
            failure = ET.SubElement(
                case, "failure", {"message": xml_safe(verdict(r)), "type": "OverBudget"}
            )
            failure.text = xml_safe(failure_text(r))
        elif r.status == "error":
            error = ET.SubElement(
                case, "error", {"message": xml_safe(r.message), "type": "CannotCheck"}
            )
            error.text = xml_safe(r.message)
        else:
            out = ET.SubElement(case, "system-out")
            out.text = xml_safe(f"{verdict(r)}; plan {plan_text(r.plan)}")
    root = ET.Element(
        "testsuites",
        {
            "tests": suite.get("tests", "0"),
            "failures": suite.get("failures", "0"),
            "errors": suite.get("errors", "0"),
        },
    )
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# ----------------------------------------------------------------------------- markdown
_MD_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation character
_LINE_BREAKS = re.compile(r"[\r\n\x0b\x0c\x85\u2028\u2029]+")


def markdown_text(text: str) -> str:
    """``text`` (a check name, a layer name: anything a user wrote) as literal Markdown text
    on one line: line breaks become spaces and every ASCII punctuation character is
    backslash-escaped (CommonMark lets any of them be), so no heading, link, image, HTML
    tag, emphasis or table cell can come out of it."""
    return _MD_PUNCTUATION.sub(r"\\\1", _LINE_BREAKS.sub(" ", text))


def markdown_code_block(text: str) -> list[str]:
    """``text`` as the lines of a fenced code block that it cannot close: the fence is a
    run of backticks longer than any in ``text`` (a closing fence must be at least as long
    as the opening one)."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *_LINE_BREAKS.sub("\n", text).split("\n"), fence]


def to_markdown(report: CheckReport) -> str:
    """The GitHub step summary: a table of checks, then the details of each failure."""
    icon = {"pass": "✅ pass", "fail": "❌ fail", "error": "⚠️ error"}
    head = "passed" if report.passed else "failed"
    lines = [
        f"### memplan check: {head} ({report.count('pass')}/{len(report.results)})",
        "",
        "| check | result | min peak | budget | headroom | plan (micro × accum, ckpt) | time |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in report.results:
        peak = format_bytes(r.min_peak_bytes) if r.min_peak_bytes is not None else "-"
        headroom = format_bytes(r.headroom_bytes) if r.headroom_bytes is not None else "-"
        lines.append(
            f"| {markdown_text(r.name)} | {icon[r.status]} | {peak} | "
            f"{format_bytes(r.budget_bytes)} | {headroom} | {markdown_text(plan_text(r.plan))} | "
            f"{r.seconds:.1f} s |"
        )
    for r in report.results:
        if r.status == "pass":
            continue
        lines += [
            "",
            f"#### {markdown_text(r.name)}",
            "",
            *markdown_code_block(failure_text(r) if r.status == "fail" else r.message),
        ]
    return "\n".join(lines) + "\n"


def append_step_summary(
    report: CheckReport, path: str | os.PathLike[str] | None = None
) -> Path | None:
    """Append the markdown summary to ``$GITHUB_STEP_SUMMARY`` (or ``path``); None when
    neither is set. GitHub gives each step its own file and concatenates them, so append."""
    target = path or os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as handle:
        handle.write(to_markdown(report))
    return Path(target)
