import json
import re
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
    (["--trainer", "fsdp=2,fsdp=4"], "axis 'fsdp' is given twice"),
    (["--rollout", "tp=3"], r"rollout tp=3: qwen3-4b has 32 attention heads, .* tp ∈ \{1, 2, 4, 8, 16, 32\}"),
    (["--trainer", "fsdp=2,tp=3"], "trainer tp=3: qwen3-4b has 32 attention heads"),
])
def test_plan_bad_input_named_in_one_line_exit_2(args, message, capsys):
    assert main(["plan", "--model", "qwen3-4b", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and "Traceback" not in err and len(err.splitlines()) <= 2, err


def test_plan_checks_a_small_models_heads_like_vllm(tmp_path, capsys):
    # a 4-head / 2-kv-head model from its config.json: tp=8 splits mid-head (vLLM refuses); tp=4 replicates kv
    cfg = {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 300,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for tp, rc in ((8, 2), (3, 2), (4, 0), (2, 0)):
        assert main(["plan", "--model", str(tmp_path), "--trainer", "fsdp=2", "--rollout", f"tp={tp}"]) == rc, tp
        err = capsys.readouterr().err
        assert (f"rollout tp={tp}: " in err and "4 attention heads" in err) if rc else not err


def test_kv_heads_must_divide_tp_or_be_divided_by_it():
    from dataclasses import replace

    from hyperrl.sharding.models import MODELS, check_tensor_parallel

    odd = replace(MODELS["qwen3-4b"], heads=24, kv_heads=8)
    check_tensor_parallel(odd, 4)  # 8 kv heads split over 4
    with pytest.raises(ValueError, match="tp=12: qwen3-4b has 8 key/value heads; tp must divide them or be a multiple"):
        check_tensor_parallel(odd, 12)


def test_user_errors_are_one_line_and_exit_2_with_the_traceback_behind_debug(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "1+1=", "answer": "2"}\n')
    cmd = [sys.executable, "-m", "hyperrl.cli", "train", f"--data.train_files=[{bad}]", f"--run.out_dir={tmp_path}/r",
           "--run.eval_every=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-2].startswith("data error: ") and "column 'prompt' missing" in lines[-2], out.stderr
    assert "set data.prompt_key" in lines[-2] and "--debug" in lines[-1] and "Traceback" not in out.stderr
    dbg = subprocess.run(cmd + ["--debug"], capture_output=True, text=True, timeout=300)
    assert dbg.returncode == 1 and "Traceback" in dbg.stderr and "DataError" in dbg.stderr
    cfg = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", "--rollout.n=1"], capture_output=True,
                         text=True, timeout=300)
    assert cfg.returncode == 2 and cfg.stderr.startswith("config error: rollout.n=1: ")


@pytest.mark.slow
def test_entry_point_demo_runs():
    out = subprocess.run([sys.executable, "-m", "hyperrl.cli", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gspo" in out.stdout and "max |diff|" in out.stdout
    from hyperrl.config import RECIPES
    from hyperrl.demo import DEMO_RECIPES

    assert set(DEMO_RECIPES) <= set(RECIPES.names())  # the demo binds the library's recipes, no copy of its own


@pytest.mark.parametrize("args, message", [
    (["--rollout", "tp=8,dp=100000"], r"--rollout tp=8,dp=100000: 800,000 ranks; the planner .* at most 16,384"),
    (["--bandwidth", "intra=nan,inter=50GB/s"], r"intra='nan': a bandwidth must be a finite rate > 0"),
    (["--bandwidth", "intra=0,inter=50GB/s"], r"intra='0': a bandwidth must be a finite rate > 0"),
    (["--bandwidth", "intra=400GB/s", "--latency", "inf"], r"--latency 'inf': must be a finite time"),
])
def test_impossible_plans_are_refused_before_any_work(args, message, capsys):
    import time

    t0 = time.perf_counter()
    assert main(["plan", "--model", "qwen3-4b", *args]) == 2
    assert re.search(message, capsys.readouterr().err) and time.perf_counter() - t0 < 30
