"""``memplan show`` and ``memplan devices``: render a saved profile or plan again, and list
the GPU specs memplan can plan for."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memplan.cli.base import run_command
from memplan.cli.options import JsonOption
from memplan.files.schema import load_yaml_file, to_data


@run_command
def show(
    file: Annotated[Path, typer.Argument(help="A profile or plan YAML.")],
    as_json: JsonOption = False,
) -> None:
    """Render a profile or plan file again."""
    from memplan import render
    from memplan.plan import plan_from_data
    from memplan.profile import profile_from_data

    data = load_yaml_file(file, what="profile or plan")
    obj = (
        plan_from_data(data, source=str(file))
        if "target_batch" in data
        else profile_from_data(data, source=str(file))
    )
    if as_json:
        render.print_json(to_data(obj))
    elif "target_batch" in data:
        render.show_plan(obj)
    else:
        render.show_profile(obj)
    if "target_batch" in data:  # a plan whose figures are not its profile's (edited by hand)
        from memplan.report import plan_profile, stale_plan_note

        note = stale_plan_note(obj, file, plan_profile(obj, file))
        if note:
            render.warn(note)


@run_command
def devices(
    as_json: JsonOption = False,
) -> None:
    """List the GPU specs memplan can plan for (profiles/devices/)."""
    from memplan import render
    from memplan.devices import list_devices, load_device

    specs = [load_device(name) for name in list_devices()]
    if as_json:
        render.print_json([to_data(s) for s in specs])
    else:
        render.show_devices(specs)
