"""``hf:`` references stay on this machine and run no code of the model's (#23,
memplan.model.hf): a config naming custom code is refused before anything runs, and a
local-looking reference never asks the Hub."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


# ------------------------------------------------------------------ 4. hf: custom code
def test_an_hf_config_naming_custom_code_is_refused_and_nothing_runs(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "vocab_size": 100,
                "auto_map": {
                    "AutoConfig": "configuration_evil.EvilConfig",
                    "AutoModelForCausalLM": "modeling_evil.EvilModel",
                },
            }
        )
    )
    for name in ("configuration_evil", "modeling_evil"):
        (folder / f"{name}.py").write_text(f"open({str(tmp_path / name)!r}, 'w').close()\n")
    for ref in (f"hf:{folder}", f"hf:{folder}/config.json"):
        proc = subprocess.run(
            [sys.executable, "-m", "memplan.cli", "probe", f"{ref}?task=causal-lm&seq-len=8",
             "--device", "meta", "-o", str(tmp_path / "p.yaml")],
            input="y\ny\ny\n", capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "auto_map" in proc.stderr
    assert not (tmp_path / "configuration_evil").exists()
    assert not (tmp_path / "modeling_evil").exists()


def test_a_local_looking_hf_reference_never_goes_to_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("memplan asked the Hub about a local path")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.chdir(tmp_path)
    result = invoke("probe", "hf:./x.json?task=causal-lm&seq-len=8", "--device", "meta")
    assert result.exit_code == 2 and "does not exist" in result.output
