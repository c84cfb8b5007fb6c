"""`memplan check` against a hostile model file and a careless memplan.yaml (the hostile-user
report, items 1, 4, 5 and 9): a model cannot choose the gate's exit code through the result
pipe (the parent never unpickles what the child sends), two checks cannot share a baseline
file, a model that kills memplan's fork server fails its own check only, and the config's
messages say what is wrong with the value."""

import dataclasses
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from multiprocessing import forkserver
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import yaml

from memplan.check import isolate as iso
from memplan.check import load_config
from memplan.check.baseline import compare_with_baseline
from memplan.check.isolate import ChildError, IsolatedProbeError, Phase, ProbeRequest
from memplan.check.run import probe_request
from memplan.errors import BadInputError
from memplan.probe.settings import ProbeSettings
from memplan.profile import Profile, load_profile, profile_to_yaml

MODELS = Path(__file__).parent / "models"
SMALL = MODELS / "check_small.py"
GROWN = MODELS / "check_grown.py"
BASELINE = Path(__file__).parent.parent / "examples" / "ci" / "baselines" / "gpt.profile.yaml"

# Appended to the small model: at import, find the probe child's result pipe and write to it.
FIND_PIPE = """
import gc as _gc
import os as _os
from multiprocessing.connection import Connection as _Connection

_PIPES = [
    o for o in _gc.get_objects()
    if isinstance(o, _Connection) and o.writable and not o.readable
]
"""
PICKLE_FORGER = (
    FIND_PIPE
    + """
class _Boom:
    def __reduce__(self):
        return (_os._exit, (0,))  # runs wherever this is unpickled


for _pipe in _PIPES:
    _pipe.send(_Boom())
"""
)
FRAME_FORGER = (
    FIND_PIPE
    + """
import struct as _struct

_payload = {payload!r}
for _pipe in _PIPES:
    _os.write(_pipe.fileno(), _struct.pack("!cQ", {tag!r}, len(_payload)) + _payload)
"""
)


def forger(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(SMALL.read_text(encoding="utf-8") + code, encoding="utf-8")
    return str(path)


def entry(name: str, model: str, budget: str = "1GiB") -> dict:
    return {"name": name, "model": model, "target_batch": 8, "budget": budget, "device": "meta"}


# ------------------------------------------------------------------ 1. the result pipe
def test_a_model_cannot_choose_the_gate_s_exit_code_through_the_result_pipe(tmp_path):
    """A pickle whose __reduce__ is os._exit(0), sent down the pipe, ended memplan with exit
    0 and no report although another check was over budget. Now it is that check's error;
    so is a well-framed message that does not read as a profile or an error."""
    checks = [
        entry("over", str(GROWN), "64KiB"),
        entry("pickle", forger(tmp_path, "pickle", PICKLE_FORGER)),
        entry("yaml", forger(tmp_path, "yaml", FRAME_FORGER.format(tag=b"P", payload=b"[1, 2"))),
        entry("error", forger(tmp_path, "err", FRAME_FORGER.format(tag=b"E", payload=b'{"a":1}'))),
        entry("small", str(SMALL)),
    ]
    config = tmp_path / "memplan.yaml"
    config.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False), encoding="utf-8")
    junit = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "memplan.cli", "check", "--config", str(config), "--json"]
    proc = subprocess.run(
        [*cmd, "--junit", str(junit)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr  # "over" is over budget, whatever else ran
    data = json.loads(proc.stdout)
    by_name = {c["name"]: c for c in data["checks"]}
    assert {n: c["status"] for n, c in by_name.items()} == {
        "over": "fail",
        "pickle": "error",
        "yaml": "error",
        "error": "error",
        "small": "pass",
    }
    for name in ("pickle", "yaml", "error"):
        assert by_name[name]["exit_code"] == 2
        assert "result pipe" in by_name[name]["message"]
        assert f"{name if name != 'error' else 'err'}.py" in by_name[name]["message"]
    assert "cannot read" in by_name["yaml"]["message"]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("1", "3")


def _inbox_reading(data: bytes, close: bool = True) -> tuple[object, Phase, bool]:
    """What the parent makes of ``data`` written to the result pipe (by a thread: a pipe
    holds 64 KiB, a profile more)."""
    receive, send = multiprocessing.Pipe(duplex=False)

    def write() -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(send.fileno(), view) :]
        if close:
            send.close()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    inbox = iso._Inbox(receive, "m.py")
    reply, phase = None, Phase("importing m.py")
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready = wait([receive], timeout=0.2)
            inbox.fill()
            reply, phase = inbox.take(phase)
            if reply is not None or inbox.closed or (not ready and not writer.is_alive()):
                break
        return reply, phase, inbox.garbled
    finally:
        receive.close()
        writer.join(timeout=5)
        if not send.closed:
            send.close()


def frame(tag: bytes, payload: bytes) -> bytes:
    return struct.pack("!cQ", tag, len(payload)) + payload


def test_the_result_pipe_carries_plain_data_read_strictly():
    text = BASELINE.read_text(encoding="utf-8")
    reply, phase, garbled = _inbox_reading(
        frame(b"S", "measuring ✓".encode()) + frame(b"P", text.encode())
    )
    assert isinstance(reply, Profile) and not garbled
    assert reply == load_profile(BASELINE)
    assert phase.text == "measuring ✓"
    error = json.dumps({"message": "m.py: no build_model", "exit_code": 2}).encode()
    assert _inbox_reading(frame(b"E", error))[0] == ChildError(message="m.py: no build_model")
    # Half a message while the child still writes: nothing yet, and no error.
    assert _inbox_reading(frame(b"P", text.encode())[:100], close=False)[:1] == (None,)
    for data in (
        b"\x80\x04\x95" + b"x" * 40,  # a pickle, not a message
        frame(b"P", text.encode())[:100],  # half a message, then the pipe closed
        frame(b"P", text.replace("layers:", "layerz:").encode()),  # unknown key
        frame(b"P", b"\xff\xfe"),  # not UTF-8
        frame(b"P", b"[" * 100_000),  # nesting past the parser's limits
        frame(b"E", b'{"message": "x", "exit_code": "0"}'),  # a code that is no int
        frame(b"E", b'{"message": "x", "exit_code": true}'),
        frame(b"X", b""),  # an unknown tag
        struct.pack("!cQ", b"P", 1 << 62),  # a length past any profile
    ):
        reply, _, garbled = _inbox_reading(data)
        assert isinstance(reply, ChildError) and garbled, data[:20]
        assert reply.message.startswith("m.py: ") and "result pipe" in reply.message
        assert reply.exit_code == 2


def test_a_profile_survives_the_pipe_unchanged():
    # The child sends profile_to_yaml's text; the parent's profile equals the child's.
    profile = load_profile(BASELINE)
    reply, _, _ = _inbox_reading(frame(b"P", profile_to_yaml(profile).encode()))
    assert reply == profile


# ------------------------------------------------------------------ 5. the fork server
def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_dead_fork_server_is_replaced_before_the_next_check(monkeypatch):
    """A model that SIGTERMs its parent (memplan's fork server) made the next check fail as
    "memplan failed ... EOFError": the server was dead but not yet reaped, so multiprocessing
    took it for alive. That moment is held here: the server is killed, and waitpid(WNOHANG)
    still says it runs. The next probe starts on a fresh server and succeeds."""
    iso.start_fork_server()
    server = forkserver._forkserver
    pid = server._forkserver_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    real_waitpid = os.waitpid

    def waitpid(target: int, options: int):
        if target == pid and options & os.WNOHANG:
            return 0, 0  # "still running": dead, not yet reaped
        return real_waitpid(target, options)

    monkeypatch.setattr(os, "waitpid", waitpid)
    request = ProbeRequest(
        model_arg=str(SMALL), settings=ProbeSettings(device="meta"), timeout_s=120
    )
    profile = iso.probe_isolated(request)
    assert [layer.name for layer in profile.layers] == [f"blocks.{i}" for i in range(4)]
    assert server._forkserver_pid not in (None, pid)


def test_a_fork_server_that_fails_twice_is_memplan_s_exit_3(monkeypatch):
    def broken(process):
        raise EOFError("unexpected EOF")

    restarts = []
    monkeypatch.setattr(iso, "_start", broken)
    monkeypatch.setattr(iso, "restart_fork_server", lambda: restarts.append(1))
    request = ProbeRequest(model_arg="m.py", settings=ProbeSettings(device="meta"))
    with pytest.raises(IsolatedProbeError) as info:
        iso.probe_isolated(request)
    assert info.value.exit_code == 3 and restarts == [1]
    assert info.value.message.startswith("m.py: ") and "fork server" in info.value.message


# ------------------------------------------------------------------ 4. shared baselines
def write_config(tmp_path: Path, checks: list[dict]) -> Path:
    path = tmp_path / "memplan.yaml"
    path.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("spelling", ["./shared.profile.yaml", "link.profile.yaml", "hard"])
def test_two_checks_naming_one_baseline_file_are_refused(tmp_path, spelling):
    (tmp_path / "shared.profile.yaml").write_text(BASELINE.read_text(encoding="utf-8"))
    if spelling == "link.profile.yaml":
        (tmp_path / spelling).symlink_to(tmp_path / "shared.profile.yaml")
    elif spelling == "hard":
        spelling = "hard.profile.yaml"
        os.link(tmp_path / "shared.profile.yaml", tmp_path / spelling)
    a = {**entry("gpt", str(SMALL)), "baseline": "shared.profile.yaml"}
    b = {**entry("mlp", str(GROWN)), "baseline": spelling}
    with pytest.raises(BadInputError) as info:
        load_config(write_config(tmp_path, [a, b]))
    message = info.value.message
    assert "'checks[1].baseline'" in message and "checks[0].baseline" in message
    assert "'gpt'" in message and spelling in message
    assert "mlp.profile.yaml" in (info.value.hint or "")
    b["baseline"] = "mlp.profile.yaml"  # each its own: fine
    assert len(load_config(write_config(tmp_path, [a, b])).checks) == 2


def test_a_baseline_of_another_model_is_a_note_not_growth(tmp_path):
    baseline = tmp_path / "b.profile.yaml"
    baseline.write_text(BASELINE.read_text(encoding="utf-8"))  # examples/gpt.py's profile
    (tmp_path / "m.py").write_text(SMALL.read_text(encoding="utf-8"))
    config = write_config(tmp_path, [{**entry("m", "m.py"), "baseline": "b.profile.yaml"}])
    check = load_config(config).checks[0]
    gpt = load_profile(BASELINE)

    def of(path: str, factory: str = "build_model", sha: str = "0") -> Profile:
        model = dataclasses.replace(gpt.model, path=path, factory=factory, sha256=sha * 64)
        return dataclasses.replace(gpt, model=model)

    growth, note = compare_with_baseline(check, of("m.py"))
    assert growth == ()
    assert "another model (examples/gpt.py, not m.py)" in note and "b.profile.yaml" in note
    # The same model, spelled another way and edited since (another sha256), is compared.
    baseline.write_text(profile_to_yaml(of("./m.py")), encoding="utf-8")
    assert compare_with_baseline(check, of("m.py", sha="1")) == ((), "")
    growth, note = compare_with_baseline(check, of("m.py", factory="build_big"))
    assert growth == () and "another model (./m.py:build_model, not m.py:build_big)" in note


# ------------------------------------------------------------------ 9. what the messages say
@pytest.mark.parametrize(
    ("field", "value", "says", "not_says"),
    [
        ("target_batch", "32", "quoted text '32'", "exponent"),
        ("world_size", " 1 ", "Write 1 without quotes", "exponent"),
        ("margin", "0.05", "Write 0.05 without quotes", "exponent"),
        ("model", "models dir", "is a folder", "does not exist"),
        ("budget", "90%", "device_profile: NAME", "--device-profile"),
        ("budget", 99999999999999999999999, "larger than any device", "must be a string"),
        ("budget", "1000000000PiB", "larger than any device", "is not a size"),
        ("budget", float("nan"), "not a finite size", "must be a string"),
        ("budget", float("inf"), "not a finite size", "must be a string"),
        ("budget", 1.0e30, "larger than any device", "must be a string"),
        ("budget", 1.5e9, "whole bytes (1500000000)", "must be a string"),
    ],
)
def test_config_messages_say_what_is_wrong(tmp_path, field, value, says, not_says):
    (tmp_path / "models dir").mkdir()
    check = {**entry("a", str(SMALL)), field: value}
    with pytest.raises(BadInputError) as info:
        load_config(write_config(tmp_path, [check]))
    text = f"{info.value.message} {info.value.hint or ''}"
    assert f"'checks[0].{field}'" in text
    assert says in text and not_says not in text, text


def test_a_probe_request_still_goes_through_the_check(tmp_path):
    # The messages' pre-check leaves a valid check alone.
    check = load_config(write_config(tmp_path, [entry("a", str(SMALL))])).checks[0]
    assert probe_request(check).model_arg == str(SMALL)
