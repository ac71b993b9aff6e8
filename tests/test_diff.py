"""``hyperrl diff``: fingerprints recorded each step, and two runs compared — one change injected at step k in
stage s (a reward on one row, another sampling seed, one perturbed weight, a package's version) and the diff names
k, s and the row or tensor; a run without fingerprints, a step one run never reached, a killed-and-resumed run."""

import json
import shutil

import pytest
import torch

from hyperrl.cli import main
from hyperrl.config import load_config
from hyperrl.diff import DiffError, diff_runs, format_diff
from hyperrl.loop import collect as collect_mod
from hyperrl.loop import fingerprints as fp
from hyperrl.run import train

_ARGS = ["--task=modsum", "--rollout.max_new_tokens=4", "--rollout.prompts_per_step=4", "--rollout.n=4",
         "--run.eval_every=0", "--run.export=false", "--run.threads=1", "--run.steps=5"]


def _run(out, *extra, hooks=()):
    cfg = load_config(None, [*_ARGS, f"--run.out_dir={out}", *extra])
    train(cfg, resume=True, progress=False, extra_hooks=hooks)
    return out


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref") / "run")


def _at(event_step: int, fn, event: str = "step"):
    """A hook calling ``fn(trainer, payload)`` once, at ``event`` of step ``event_step``."""

    def hook(event_, trainer, payload):
        if event_ == event and payload["step"] == event_step:
            fn(trainer, payload)

    return hook


def test_the_same_run_twice_agrees_and_the_cli_exits_0(ref, tmp_path, capsys):
    b = _run(tmp_path / "b")
    d = diff_runs(ref, b)
    assert d.step is None and d.config == {} and d.versions == {} and d.steps == (5, 5)
    assert main(["diff", str(ref), str(b)]) == 0
    assert "no step differs" in capsys.readouterr().out


def test_a_reward_changed_on_one_row_at_step_3_is_named_with_both_values(ref, tmp_path, monkeypatch, capsys):
    calls, real = [], collect_mod.score_and_shape

    def wobble(batch, *a, **kw):  # the third training step's row 5 scores 0.5 more
        out = real(batch, *a, **kw)
        calls.append(1)
        if len(calls) == 3:
            out = out.copy().set("reward", out["reward"].clone().index_add_(0, torch.tensor([5]),
                                                                             torch.tensor([0.5])))
        return out

    monkeypatch.setattr(collect_mod, "score_and_shape", wobble)
    b = _run(tmp_path / "b")
    d = diff_runs(ref, b)
    assert (d.step, d.stage, d.n_rows) == (3, "rewards", 1)
    uid = d.rows[0]["sample_uid"]
    assert d.rows[0]["row_a"] == d.rows[0]["row_b"] == 5 and d.token["key"] == "reward"
    assert d.token["b"] == pytest.approx(d.token["a"] + 0.5)
    assert main(["diff", str(ref), str(b)]) == 1
    out = capsys.readouterr().out
    assert "first difference: step 3, rewards (prompts, completions, logprobs equal)" in out and str(uid) in out


def test_another_sampling_seed_from_step_4_parts_at_its_completions(ref, tmp_path):
    def reseed(trainer, _):
        trainer.generator.seed = 12345

    b = _run(tmp_path / "b", hooks=[_at(3, reseed)])
    d = diff_runs(ref, b)
    assert (d.step, d.stage) == (4, "completions") and d.n_rows > 0
    assert d.token is not None and d.token["key"] == "tokens" and d.token["a"] != d.token["b"]  # sampled ids


def test_one_perturbed_weight_after_step_2s_update_is_named_by_tensor(ref, tmp_path):
    def nudge(trainer, _):
        with torch.no_grad():
            dict(trainer.policy.named_parameters())["model.layers.0.mlp.up_proj.weight"][0, 0] += 1e-3

    b = _run(tmp_path / "b", hooks=[_at(2, nudge, event="batch")])  # before the fingerprints are taken
    d = diff_runs(ref, b, step=2)
    assert (d.step, d.stage, d.tensors) == (2, "weights", ["model.layers.0.mlp.up_proj.weight"])
    assert diff_runs(ref, b).step == 2  # and nothing earlier differs


def test_another_package_version_is_said_and_no_step_differs(ref, tmp_path, monkeypatch):
    real = fp.package_versions
    monkeypatch.setattr(fp, "package_versions", lambda: {**real(), "transformers": "9.9.9"})
    b = _run(tmp_path / "b")
    d = diff_runs(ref, b)
    assert d.versions == {"transformers": [real()["transformers"], "9.9.9"]} and d.step is None
    assert "packages: transformers " in format_diff(d)


def test_configs_steps_and_runs_without_fingerprints(ref, tmp_path, capsys):
    short = _run(tmp_path / "short", "--run.steps=3", "--optim.lr=0.5")  # another hyperparameter, fewer steps
    d = diff_runs(ref, short)
    assert d.config["optim.lr"][1] == 0.5 and d.steps == (5, 3)
    # step 1's rows, loss and gradient alike (the lr acts in the optimizer step): the weights part, every tensor
    assert (d.step, d.stage) == (1, "weights") and len(d.tensors) > 10
    bare = _run(tmp_path / "bare", "--run.fingerprints=false")
    d = diff_runs(ref, bare)
    assert d.source == "metrics" and d.step is None and "no fingerprints" in d.notes[0]
    assert d.config == {"run.fingerprints": [True, False]}
    d = diff_runs(ref, ref, step=9)
    assert d.step is None and "run a has no step 9 (it recorded steps 1–5)" in d.notes
    with pytest.raises(DiffError, match="no such run directory"):
        diff_runs(ref, tmp_path / "nowhere")
    assert main(["diff", str(ref), str(tmp_path / "nowhere")]) == 2
    assert "diff error:" in capsys.readouterr().err


def test_a_resumed_run_records_each_step_once_and_equals_the_uninterrupted_one(ref, tmp_path):
    c = tmp_path / "c"
    _run(c, "--run.steps=4", "--run.ckpt_every=2")  # checkpoints at 2 and 4
    shutil.rmtree(c / "checkpoints" / "step_4")  # as if killed after step 4 was recorded but before its checkpoint
    _run(c, "--run.ckpt_every=2")  # resumes from step 2: steps 3, 4 recorded again
    steps = [json.loads(x).get("step") for x in (c / "fingerprints.jsonl").read_text().splitlines()
             if "event" not in json.loads(x)]
    assert steps == [1, 2, 3, 4, 5]
    assert diff_runs(ref, c).step is None


def test_an_asynchronous_runs_event_logs_are_compared_call_by_call(tmp_path):
    """A free-running run's event log (every worker call: its uids and version): a copy of the run with one call
    made at another version is named by its line, both events shown."""
    a = _run(tmp_path / "a", "--async.max_staleness=1")
    assert fp.read_fingerprints(a).steps[5]["version"] == 5
    b = tmp_path / "b"
    shutil.copytree(a, b)
    lines = (b / "async_events.jsonl").read_text().splitlines()
    k = next(i for i, x in enumerate(lines) if "call" in json.loads(x) and json.loads(x)["version"] > 0)
    e = json.loads(lines[k])
    lines[k] = json.dumps({**e, "version": e["version"] - 1})
    (b / "async_events.jsonl").write_text("\n".join(lines) + "\n")
    d = diff_runs(a, b)
    assert d.step is None and d.events["line"] == k + 1 and d.events["b"]["version"] == e["version"] - 1
    assert f"async event logs part at line {k + 1}" in format_diff(d)


def test_a_moe_run_is_fingerprinted_diffed_traced_and_doctored(tmp_path, capsys):
    """A mixture of experts: its rows keep the engine's routes, so the doctor can replay them."""
    moe = ["--run.steps=3", "--model.layers=2", "--run.ckpt_every=2"]
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        train(load_config("configs/moe.yaml", [*_ARGS[1:], f"--run.out_dir={out}", *moe]), progress=False)
        runs.append(out)
    assert diff_runs(*runs).step is None
    assert main(["trace", str(runs[0])]) == 0
    assert main(["doctor", str(runs[0])]) == 0
    out = capsys.readouterr().out
    assert "step 3: no gap beyond float rounding" in out and "routes" in out.split("not applicable")[0]


def test_runs_of_different_tasks_and_models_say_what_differs_and_compare_the_rest(ref, tmp_path):
    other = _run(tmp_path / "other", "--task=arith", "--model.hidden=64", "--run.steps=2")
    d = diff_runs(ref, other)
    assert d.config["task.name"] == ["modsum", "arith"] and d.config["model.hidden"] == [128, 64]
    assert (d.step, d.stage) == (1, "prompts") and d.n_rows == 16 and d.steps == (5, 2)
    text = format_diff(d)
    assert "task.name: 'modsum' → 'arith'" in text and "first difference: step 1, prompts" in text
