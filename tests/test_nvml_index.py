"""NVML numbers every GPU on the machine; CUDA only the visible ones. memplan's GPU facts (the
free memory of ``--budget auto``, the capacity a probe records, calibrate's power note) must
come from the GPU the run uses, not from NVML's GPU of the same number."""

import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.devices import local_gpu, nvml_handle

GIB = 1024**3
UUIDS = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(8)]


class NVMLError(Exception):
    pass


def fake_pynvml(free_gib: list[int]) -> types.ModuleType:
    """Eight GPUs: GPU i has ``free_gib[i]`` GiB free of 80 and draws 300 + i W."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None

    def by_index(i):
        if not 0 <= i < len(free_gib):
            raise NVMLError("Invalid Argument")
        return i

    def by_uuid(uuid):
        if uuid not in UUIDS:
            raise NVMLError("Not Found")
        return UUIDS.index(uuid)

    nvml.nvmlDeviceGetHandleByIndex = by_index
    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetName = lambda h: f"GPU number {h}"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=80 * GIB, free=free_gib[h] * GIB
    )
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: (300 + h) * 1000
    return nvml


@pytest.fixture
def nvml(monkeypatch):
    module = fake_pynvml([10, 11, 12, 13, 14, 15, 16, 17])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU machine's answer
    return module


@pytest.mark.parametrize(
    ("visible", "index", "gpu"),
    [
        (None, 0, 0),
        (None, 5, 5),
        ("3", 0, 3),
        ("3,5", 1, 5),
        (" 6 , 2", 0, 6),
        (UUIDS[7], 0, 7),
        (f"1,{UUIDS[4]}", 1, 4),
    ],
)
def test_the_visible_devices_entry_names_nvmls_gpu(nvml, monkeypatch, visible, index, gpu):
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    info = local_gpu(index)
    assert info.name == f"GPU number {gpu}" and info.free_bytes == (10 + gpu) * GIB


@pytest.mark.parametrize(
    "visible", ["MIG-0a1b2c3d-0000-0000-0000-000000000000", "GPU-0000", "", "2", "²"]
)
def test_a_device_nvml_cannot_place_is_not_guessed(nvml, monkeypatch, visible):
    """A MIG slice, a UUID prefix, no GPU visible, an index past the list, or a digit that is
    not an ASCII one (str.isdigit says yes to "²", int() refuses it): no NVML figures
    (torch's are asked, and on this CPU machine there are none)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert local_gpu(1 if visible == "2" else 0) is None
    assert nvml_handle(nvml, 1 if visible == "2" else 0) is None


def test_torchs_uuid_wins_where_torch_sees_cuda(nvml, monkeypatch):
    """CUDA_DEVICE_ORDER can number devices unlike NVML even with every GPU visible; torch's
    UUID for the device is exact."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = {0: UUIDS[2].removeprefix("GPU-"), 1: UUIDS[0], 2: UUIDS[1]}
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=props[i])
    )
    assert nvml_handle(nvml, 0) == 2 and nvml_handle(nvml, 1) == 0


def test_calibrates_power_note_names_the_gpu_it_measured(nvml, monkeypatch):
    from memplan.probe import calibrate

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert calibrate._power_note(1) == (
        "Enforced power limit while measuring: 306 W (NVML, device 1)."
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0a1b2c3d-0000-0000-0000-000000000000")
    assert calibrate._power_note(0) is None


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    visible=st.text(
        st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30
    ),
    index=st.integers(min_value=0, max_value=9),
)
def test_any_visible_devices_string_gives_a_listed_gpu_or_none(nvml, visible, index):
    """Whatever CUDA_VISIBLE_DEVICES holds, memplan names one of NVML's GPUs, the one that
    entry names, or none; it never raises and never falls back to NVML's GPU ``index``."""
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        handle = nvml_handle(nvml, index)
    except NVMLError:  # an index or UUID NVML does not have: local_gpu gives none
        handle = "refused"
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    entries = [entry.strip() for entry in visible.split(",")]
    entry = entries[index] if index < len(entries) else ""
    if entry.isascii() and entry.isdigit():
        assert handle == (int(entry) if int(entry) < 8 else "refused")
    elif entry.startswith("GPU-") and len(entry) == 40:
        assert handle == (UUIDS.index(entry) if entry in UUIDS else "refused")
    else:
        assert handle is None
