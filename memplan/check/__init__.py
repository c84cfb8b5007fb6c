"""The CI memory-budget gate: does every check in ``memplan.yaml`` still fit its budget?

For each check: probe the model (on ``meta`` or ``cpu`` in CI) in a child process, solve for
the target batch against the budget, and compare the new profile with a committed baseline
profile by layer name, so a failure can say *what grew*. Everything here returns data (a
``CheckReport``); ``memplan.cli.check`` renders it (``memplan.render.check``) and exits with
``CheckReport.exit_code`` (the rule is in ``memplan.check.result``). One job per module:

* ``config``   memplan.yaml, read through the schema and resolved against its folder;
* ``isolate``  one probe in a child process, so a model file cannot end the run;
* ``run``      probe, solve, compare: ``run_checks`` → ``CheckReport``;
* ``result``   the result types and the run's exit-code rule;
* ``baseline`` diff against a committed profile; where ``--update-baseline`` may write;
* ``advice``   the words of a verdict and what to do about a failure;
* ``formats``  JSON, JUnit XML and the GitHub step-summary Markdown;
* ``init``     ``memplan init-check``'s starter config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memplan.check.advice import (
        describe_growth,
        failure_text,
        plan_text,
        suggested_budget,
        verdict,
    )
    from memplan.check.baseline import diff_profiles
    from memplan.check.config import (
        DEFAULT_CONFIG,
        CheckConfig,
        CheckSpec,
        ResolvedCheck,
        load_config,
    )
    from memplan.check.formats import (
        append_step_summary,
        to_json,
        to_json_data,
        to_junit_xml,
        to_markdown,
    )
    from memplan.check.init import make_starter, starter_config
    from memplan.check.result import CheckReport, CheckResult, Growth, PlanSummary
    from memplan.check.run import check_model, run_check, run_checks

_WHERE = {
    "CheckConfig": "config",
    "CheckReport": "result",
    "CheckResult": "result",
    "CheckSpec": "config",
    "DEFAULT_CONFIG": "config",
    "Growth": "result",
    "PlanSummary": "result",
    "ResolvedCheck": "config",
    "append_step_summary": "formats",
    "check_model": "run",
    "describe_growth": "advice",
    "diff_profiles": "baseline",
    "failure_text": "advice",
    "load_config": "config",
    "make_starter": "init",
    "plan_text": "advice",
    "run_check": "run",
    "run_checks": "run",
    "starter_config": "init",
    "suggested_budget": "advice",
    "to_json": "formats",
    "to_json_data": "formats",
    "to_junit_xml": "formats",
    "to_markdown": "formats",
    "verdict": "advice",
}
"""Each name's module: loaded on first use, so that ``memplan solve`` (whose command line
registers ``check``) does not import the gate's modules."""


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'memplan.check' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memplan.check.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_CONFIG",
    "CheckConfig",
    "CheckReport",
    "CheckResult",
    "CheckSpec",
    "Growth",
    "PlanSummary",
    "ResolvedCheck",
    "append_step_summary",
    "check_model",
    "describe_growth",
    "diff_profiles",
    "failure_text",
    "load_config",
    "make_starter",
    "plan_text",
    "run_check",
    "run_checks",
    "starter_config",
    "suggested_budget",
    "to_json",
    "to_json_data",
    "to_junit_xml",
    "to_markdown",
    "verdict",
]
