import json
import subprocess
import sys

import pytest

from hyperrl.cli import main


def test_plan_table_and_json(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--trainer", "fsdp=8,ep=8", "--rollout", "tp=8,dp=2"]) == 0
    out = capsys.readouterr().out
    assert "wire / B_recv_min" in out and "1.000" in out
    main(["plan", "--model", "qwen3-4b", "--trainer", "fsdp=4", "--rollout", "tp=2,dp=2", "--fan-out", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["source_tensors"] == 398 and info["wire_bytes"] == info["recv_min_bytes"]
    assert info["egress_bytes"] == info["src_min_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--trainer", "fsdp=4,pp=2", "--rollout", "tp=2"], "unknown axis 'pp'"),
    (["--trainer", "fsdp=x"], "size of 'fsdp' must be a positive integer"),
    (["--trainer", "fsdp=2,ep=2"], "ep=2: qwen3-4b has no experts"),
])
def test_plan_bad_input_named(args, message):
    with pytest.raises(SystemExit, match=message):
        main(["plan", "--model", "qwen3-4b", *args])


@pytest.mark.slow
def test_entry_point_demo_runs():
    out = subprocess.run([sys.executable, "-m", "hyperrl.cli", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gspo" in out.stdout and "max |diff|" in out.stdout
    from hyperrl.config import RECIPES
    from hyperrl.demo import DEMO_RECIPES

    assert set(DEMO_RECIPES) <= set(RECIPES.names())  # the demo binds the library's recipes, no copy of its own
