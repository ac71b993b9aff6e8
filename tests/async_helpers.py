"""The kill-and-resume scaffold the asynchronous trainer's tests share (thread and Ray executors)."""


def kill_and_resume(make, steps: int = 3, after_resume=None):
    """``make()`` a trainer, run ``steps`` steps, checkpoint with groups in flight and throw the run
    away (``close``); ``make()`` a new one, resume, check the cursor, ``after_resume(b)``, run
    ``steps`` more. Returns ``(a, b, state, live_end)``: the two trainers, the checkpoint's async
    state and the prompt keys still live (buffered or requeued) at the end."""
    a = make()
    try:
        for _ in range(steps):
            a.step()
        a.save()
        state = a.collector.state()["async"]
    finally:
        a.close()
    assert state["live"], "nothing was in flight at the checkpoint: the test would prove nothing"
    b = make()
    try:
        assert b.resume() and b.step_idx == steps and b.collector.queue.next_key == state["next_key"]
        if after_resume is not None:
            after_resume(b)
        for _ in range(steps):
            b.step()
        live_end = {u.key for u in b.collector.queue.buffer.units} | set(b.collector.queue.requeue)
    finally:
        b.close()
    return a, b, state, live_end


def assert_every_sample_trained_once(cfg, a, b, state, live_end, steps: int = 3):
    """Accounting by ``sample_uid`` over both runs (``trained`` records ``(version, uids, …)``): nothing
    trained twice, every step's batch full, what was live at the kill trained or still live, and every
    admitted prompt accounted for. A uid is ``((step·G + attempt)·P + g)·n + j`` → the prompt's key
    ``step·P + g``."""
    r = cfg.rollout
    P, n = r.prompts_per_step, r.n
    stride = r.max_generation_batches * P * n
    uids = [u for t in (a.trained, b.trained) for rec in t for u in rec[1]]
    assert len(uids) == len(set(uids)) == 2 * steps * P * n
    trained = {(u // stride) * P + (u // n) % P for u in uids}
    assert set(state["live"]) <= trained | live_end
    assert trained | live_end == set(range(b.collector.queue.next_key))


def assert_trained_once_within_eta(trained, rows: int, eta: int) -> None:
    """``trained`` (``(version, uids, action versions, …)`` per step): ``rows`` samples, each trained in one step
    only (an agent's episode may leave several rows, all in that step), every token at most ``eta`` versions old."""
    seen = [u for _, uids, *_ in trained for u in set(uids)]
    assert len(seen) == len(set(seen)) == rows  # every sample trained once, none twice
    for version, _, versions, *_ in trained:
        assert all(0 <= version - v <= eta for v in versions)  # every token within η
