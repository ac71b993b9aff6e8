"""``hyperrl trace``: a run's timeline as a Chrome / Perfetto trace — one track per learner stage and per rollout
worker — checked against what the run recorded: every step's stages in order, each publication's version, each
evaluation and checkpoint, and every worker call of the asynchronous event log with its version and requests."""

import json

from hyperrl.cli import main
from hyperrl.config import load_config
from hyperrl.loop.timeline import STAGE_TRACKS, chrome_trace, read_timeline
from hyperrl.run import train

_ARGS = ["--task=modsum", "--rollout.max_new_tokens=16", "--rollout.prompts_per_step=4", "--rollout.n=4",
         "--run.threads=1", "--run.steps=6", "--run.eval_every=3", "--run.eval_prompts=16", "--run.ckpt_every=3",
         "--run.export=false"]


def _trace(run, capsys) -> dict:
    assert main(["trace", str(run)]) == 0
    assert "open it in https://ui.perfetto.dev" in capsys.readouterr().out
    return json.loads((run / "trace.json").read_text())


def _tracks(trace) -> dict:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_an_asynchronous_runs_trace_holds_every_stage_and_every_logged_worker_call(tmp_path, capsys):
    run = tmp_path / "run"
    train(load_config(None, [*_ARGS, f"--run.out_dir={run}", "--async.max_staleness=1"]), progress=False)
    trace = _trace(run, capsys)
    ev = trace["traceEvents"]
    assert all({"ph", "pid", "name"} <= set(e) for e in ev)
    tracks = _tracks(trace)
    assert [tracks[(1, i + 1)] for i in range(len(STAGE_TRACKS))] == list(STAGE_TRACKS)
    spans = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    for step in range(1, 7):  # the step's stages on their tracks, in order, not overlapping
        mine = sorted((e for e in spans if e["args"]["step"] == step and e["name"] not in ("evaluate", "checkpoint")),
                      key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == ["wait", "reward", "logprob", "update", "publish"]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1.0 for a, b in zip(mine, mine[1:]))
    versions = [e["name"] for e in ev if e["ph"] == "i" and e["name"].startswith("version")]
    assert versions == [f"version {v}" for v in range(1, 7)]
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "evaluate") == [0, 3, 6]
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "checkpoint") == [3, 6]
    # every worker call the event log recorded before the last take, with its version and request count
    log = [json.loads(x) for x in (run / "async_events.jsonl").read_text().splitlines()]
    last_take = max(i for i, e in enumerate(log) if "take" in e)
    logged = {(e["call"], e["worker"], e["version"], len(e["uids"])) for e in log[:last_take] if "call" in e}
    calls = [e for e in ev if e["ph"] == "X" and e["pid"] == 2]
    seen = {(e["args"]["call"], tracks[(2, e["tid"])], e["args"]["version"], e["args"]["requests"]) for e in calls}
    assert logged and seen == logged and len(calls) == len(logged)


def test_a_synchronous_runs_trace_and_a_run_still_writing(tmp_path, capsys):
    run = tmp_path / "run"
    train(load_config(None, [*_ARGS, f"--run.out_dir={run}"]), progress=False)
    with (run / "timeline.jsonl").open("a") as f:
        f.write('{"step": 7, "spans": [["generate", 1.0')  # a record being written
    trace = _trace(run, capsys)
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["step"] == 2]
    assert names == ["generate", "reward", "logprob", "update", "publish"]
    assert not [e for e in trace["traceEvents"] if e["pid"] == 2 and e["ph"] == "X"]  # no rollout workers
    assert max(r["step"] for r in read_timeline(run)) == 6  # the torn record skipped
    assert chrome_trace([])["traceEvents"][0]["ph"] == "M"  # nothing recorded yet: a trace with only its tracks
    assert main(["trace", str(tmp_path / "nowhere")]) == 2
    assert "no timeline" in capsys.readouterr().err


def test_run_profile_writes_a_torch_profiler_trace_of_its_steps_only(tmp_path, capsys):
    run = tmp_path / "run"
    train(load_config(None, [*_ARGS, f"--run.out_dir={run}", "--run.steps=4", "--run.eval_every=0",
                             "--run.profile={steps: [2, 3]}"]), progress=False)
    assert "profile of steps 2–3:" in capsys.readouterr().err
    ev = json.loads((run / "profile_steps_2-3.json").read_text())["traceEvents"]
    ranges = sorted(e["name"] for e in ev if e.get("name", "").startswith("step "))
    assert ranges == ["step 2", "step 3"]
    assert any(e.get("name", "").startswith("aten::") for e in ev)  # the ops themselves


def test_a_bad_profile_window_is_refused_naming_it():
    import pytest

    from hyperrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"run.profile.steps=\[3, 2\]: give \[first, last\]"):
        load_config(None, ["--run.profile={steps: [3, 2]}"])
