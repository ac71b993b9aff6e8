"""What makes two runs the same run (hyperrl.config.compare): the keys a resume refuses to change, and how the
refusal reads — a changed parallel layout (run.tp, run.ep) named as such, not as another model or shard shapes."""

from hyperrl.config.compare import config_changes, loadability_changes, refuse_resume


def test_a_changed_expert_parallel_degree_is_named_as_a_layout_change():
    old = {"model": {"hidden": 64}, "run": {"ep": 2, "tp": 1, "steps": 10}, "optim": {"lr": 0.1}}
    new = {"model": {"hidden": 64}, "run": {"ep": 1, "tp": 1, "steps": 20}, "optim": {"lr": 0.2}}
    other = loadability_changes(old, new)
    assert other == {"run.ep": (2, 1)}
    assert config_changes(old, new) == {"optim.lr": (0.1, 0.2), "run.ep": (2, 1)}  # run.steps is bookkeeping
    msg = refuse_resume("runs/x", other)
    assert msg.startswith("runs/x was saved with another parallel layout (run.ep: 2 there, 1 here)")
    assert "resume with the same run.ep" in msg and "another model" not in msg


def test_another_model_is_still_another_models_run():
    old = {"model": {"hidden": 64}, "run": {"ep": 2}}
    new = {"model": {"hidden": 128}, "run": {"ep": 1}}
    msg = refuse_resume("runs/x", loadability_changes(old, new))
    assert "holds another model's run (model.hidden: 64 there, 128 here; run.ep: 2 there, 1 here)" in msg
