"""AsyncTrainer (one process, a rollout-worker thread): η = 0 equals SyncTrainer bit for bit; at
η > 0 every trained token is within η, requests are resumed across publications, nothing is lost
or duplicated; a bad, dead or stuck worker fails the step naming it."""

import json
import threading
import time

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.loop.collect_async import AsyncCollector
from hyperrl.loop.trainer import AsyncTrainer
from hyperrl.rollout import LocalWorker
from hyperrl.rollout.workers import WorkerError
from tests.async_helpers import assert_every_sample_trained_once, assert_trained_once_within_eta, kill_and_resume


def _cfg(tmp_path, *extra):
    return load_config(None, ["--task=modsum", "--rollout.max_new_tokens=1", f"--run.out_dir={tmp_path}",
                              "--run.eval_every=0", "--rollout.prompts_per_step=8", "--rollout.n=4", *extra])


def _assert_same_run(sync, asyn, ms, ma):
    """Every step's metrics (the clocks aside) and the final weights equal, step for step."""
    for s, a in zip(ms, ma):
        same = {k: s[k] for k in s if not k.startswith("time_") and k != "tokens_per_s"}
        assert same == {k: a[k] for k in same}
        assert a["staleness_max"] == 0 and a["async_evicted"] == 0
    assert all(torch.equal(p, q) for p, q in zip(sync.policy.parameters(), asyn.policy.parameters()))


def test_eta_zero_is_the_sync_trainer_bit_for_bit(tmp_path):
    sync = build_trainer(_cfg(tmp_path / "s"))
    asyn = build_trainer(_cfg(tmp_path / "a"), trainer=AsyncTrainer, max_staleness=0)
    try:
        ms, ma = [sync.step() for _ in range(5)], [asyn.step() for _ in range(5)]
    finally:
        asyn.close()
    _assert_same_run(sync, asyn, ms, ma)


def test_eta_zero_is_the_sync_trainer_bit_for_bit_with_process_credit_and_shaping(tmp_path):
    """Per-token credit (grpo_process) with reward shaping that changes the reward: the asynchronous
    collector scores and shapes through the synchronous one's code (score_and_shape), so the
    token_rewards fix-up — what shaping changed lands on the last token — cannot drift between them
    (it once did: the asynchronous copy skipped it)."""
    args = ["--task=arith", "--task.max_operand=9", "--task.rewards=[digit_credit, exact_answer]",
            "--algo.advantage=grpo_process", "--algo.shaping=[{name: clip, lo: 0.25, hi: 0.5}]",
            "--rollout.max_new_tokens=3", "--rollout.prompts_per_step=4", "--model.hidden=32", "--model.layers=1",
            "--model.intermediate=64"]
    sync = build_trainer(_cfg(tmp_path / "s", *args))
    asyn = build_trainer(_cfg(tmp_path / "a", *args), trainer=AsyncTrainer, max_staleness=0)
    seen = []
    collect = asyn.collector.collect

    def recording(step, version, timer):  # the batch the learner trains on, to check the credit sums to the reward
        got = collect(step, version, timer)
        seen.append(got.batch)
        return got

    asyn.collector.collect = recording
    try:
        ms, ma = [sync.step() for _ in range(4)], [asyn.step() for _ in range(4)]
    finally:
        asyn.close()
    _assert_same_run(sync, asyn, ms, ma)
    assert any(float(b["reward"].min()) == 0.25 for b in seen)  # the clip binds
    for b in seen:  # shaping's change is on the last token: the credit still sums to the shaped reward
        torch.testing.assert_close(b["token_rewards"].sum(-1), b["reward"])


# what depends on timing, not on what was generated and trained: how many groups were in flight or
# ready (admitted) when the learner took its batch, and the clocks
_TIMING = {"tokens_per_s", "async_admitted", "async_in_flight", "async_ready"}


class _Recording(AsyncTrainer):
    """Keeps every trained batch's uids and token versions (the test's accounting)."""

    def collect(self, timer):
        got = super().collect(timer)
        batch = got.batch
        self.trained = getattr(self, "trained", []) + [(self.version, batch["sample_uid"].tolist(),
                                                        batch["token_version"][batch["action_mask"]].tolist(),
                                                        batch["token_version"].clone(), batch["action_mask"].clone())]
        return got


@pytest.mark.parametrize("eta", [1, 2])
def test_partial_rollouts_stay_within_eta_and_lose_nothing(tmp_path, eta):
    # 16-token responses (the random policy rarely stops); the first call at version 1 is held
    # mid-generation, so the next publication interrupts it whatever the machine's load
    cfg = _cfg(tmp_path, "--rollout.max_new_tokens=16", "--rollout.prompts_per_step=4")
    tr = build_trainer(cfg, trainer=_Recording, max_staleness=eta)
    _restart_worker(tr, "hold")
    try:
        ms = [tr.step() for _ in range(8)]
    finally:
        tr.close()
    assert_trained_once_within_eta(tr.trained, 8 * 4 * 4, eta)
    partial = [bool(((tv.masked_fill(~act, 10**9).amin(-1) != tv.masked_fill(~act, -1).amax(-1)))
                    .any()) for _, _, _, tv, act in tr.trained]
    assert any(partial), "no request was resumed across a publication"  # one row, several versions
    assert max(m["staleness_max"] for m in ms) <= eta and ms[-1]["async_evicted"] == 0
    b = tr.collector.queue.buffer
    assert b.admitted == b.consumed + b.evicted + b.in_flight + b.ready
    assert len(tr.collector.queue.draws) <= eta + 2  # the task's draws of consumed steps are forgotten


class _HeldFlag:
    """The engine's stop flag, holding the call before its 5th decode step until the worker is
    interrupted or asked to park (``async.kv_cache=keep``), 30 s at most: a publication is sure to
    land mid-generation, whatever the machine's load. It polls the worker itself, so the flag it
    wraps counts decode steps as before (the event log records 4)."""

    def __init__(self, inner, worker, at: int = 5):
        self.inner, self.worker, self.steps, self.at = inner, worker, 0, at

    def is_set(self):
        self.steps += 1
        deadline = time.monotonic() + 30
        while (self.steps == self.at and not (self.worker._flag.is_set() or self.worker._hold._asked)
               and time.monotonic() < deadline):
            time.sleep(0.002)
        return self.inner.is_set()


class _FaultyEngine:
    """Wraps the engine: ``mode`` = "corrupt" (one row's versions wiped once), "die", "hang" or
    "hold" (the first call at version ≥ 1 held mid-generation until a publication interrupts it)."""

    def __init__(self, engine, mode):
        self.engine, self.mode, self.done, self.release = engine, mode, False, threading.Event()
        self.hold_at = 5  # "hold": the decode step held
        self.hold_when = lambda: True  # "hold": and only a call that starts when this holds

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate_requests(self, reqs, sp, abort=None, **kw):
        if self.mode == "hold" and not self.done and self.engine.policy_version >= 1 and self.hold_when():
            self.done = True
            return self.engine.generate_requests(reqs, sp, abort=_HeldFlag(abort, self.worker, self.hold_at), **kw)
        out = self.engine.generate_requests(reqs, sp, abort=abort, **kw)
        if self.mode == "corrupt" and not self.done:
            self.done = True
            tv = out["token_version"].clone()
            tv[0] = -1
            return out.set("token_version", tv)
        if self.mode == "die":
            raise RuntimeError("CUDA error: an illegal memory access")
        if self.mode == "hang":
            self.release.wait(30)
        return out


def _restart_worker(tr, mode):
    tr.collector.stop_workers()
    c = tr.collector
    c.engine = _FaultyEngine(c.engine, mode)
    c.workers = [LocalWorker(c.engine)]
    c.engine.worker = c.workers[0]
    c.workers[0].keep_kv = c.keep_kv
    c.start_workers()
    return c.engine


def test_a_unit_breaking_the_contract_is_evicted_and_its_prompt_readmitted(tmp_path):
    tr = build_trainer(_cfg(tmp_path), trainer=_Recording, max_staleness=1)
    _restart_worker(tr, "corrupt")  # the first generation's row 0 comes back without versions
    try:
        ms = [tr.step() for _ in range(4)]
    finally:
        tr.close()
    (uid, key, why), = tr.collector.queue.buffer.evictions
    assert why.startswith("rollout-worker-0: token_version: action token") and ms[-1]["async_evicted"] == 1
    uids = [u for _, us, _, _, _ in tr.trained for u in us]
    assert len(uids) == len(set(uids)) == 4 * 8 * 4  # 4 steps × 8 groups × 4 samples, none twice
    groups = {u // 4 for u in uids}  # uid = (step·4 + 0)·32 + g·4 + j: the prompt (step, g) is u // 4
    assert len(groups) == 32 and key in {(u // 32 // 4) * 8 + (u // 4) % 8 for u in uids}  # re-admitted, trained
    b = tr.collector.queue.buffer
    assert b.admitted == b.consumed + b.evicted + b.in_flight + b.ready


def test_a_dead_worker_fails_the_step_naming_it(tmp_path):
    tr = build_trainer(_cfg(tmp_path), trainer=AsyncTrainer, max_staleness=1, timeout_s=20)
    _restart_worker(tr, "die")
    with pytest.raises(WorkerError, match="rollout-worker-0 died: RuntimeError: CUDA error"):
        tr.step()
    tr.close()


def test_a_stuck_worker_fails_the_step_and_the_old_version_keeps_serving(tmp_path):
    tr = build_trainer(_cfg(tmp_path), trainer=AsyncTrainer, max_staleness=1, timeout_s=2)
    eng = _restart_worker(tr, "hang")
    with pytest.raises(WorkerError, match=r"rollout-worker-0: no progress in 2 s .* still serving version 0"):
        tr.step()
    assert eng.policy_version == 0 and tr.version == 0
    eng.release.set()
    tr.close()


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="async.max_staleness"):
        build_trainer(_cfg(tmp_path), trainer=AsyncTrainer, max_staleness=-1)
    with pytest.raises(ValueError, match="group filters"):
        build_trainer(_cfg(tmp_path / "f", "--algo.filter=dynamic_sampling"), trainer=AsyncTrainer, max_staleness=1)


def test_kill_and_resume_loses_nothing_and_trains_nothing_twice(tmp_path):
    """Save at step 3 with groups in flight and ready, throw the trainer away (a killed run), resume
    from the checkpoint: the live groups are admitted again first (same sample_uids, regenerated
    under the resumed weights), the data cursor continues exactly, every sample is trained once."""
    cfg = _cfg(tmp_path, "--rollout.max_new_tokens=8", "--async.max_staleness=2")
    a, b, state, live_end = kill_and_resume(lambda: build_trainer(cfg, trainer=_Recording, max_staleness=2))
    assert_every_sample_trained_once(cfg, a, b, state, live_end)


def test_the_cli_config_runs_the_async_loop(tmp_path):
    from hyperrl.run import train

    cfg = _cfg(tmp_path, "--async.max_staleness=1", "--run.steps=6", "--run.eval_every=3", "--run.eval_prompts=16",
               "--run.export=false")
    t = build_trainer(cfg)
    assert isinstance(t.collector, AsyncCollector) and t.collector.eta == 1
    t.close()
    out = train(cfg, resume=False, progress=False)
    assert out["steps"] == 6 and out["final_eval_reward"] is not None
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "staleness_max" in r]
    assert len(steps) == 6 and max(r["staleness_max"] for r in steps) <= 1


def test_a3po_interpolates_the_proximal_policy_in_the_loss_without_a_forward(tmp_path):
    """``algo.proximal=interpolate``: prepare runs no proximal forward, and the loss's old_logprobs are
    log π_behav + α(log π_θ − log π_behav) with α = (V − v_t)/(V + 1 − v_t) — checked against a forward
    of the policy at the moment the loss ran (first and only mini-batch: π_θ is version V)."""
    import hyperrl.transforms as T
    from hyperrl.loop.forward import plain_logprobs_and_entropy

    seen = []

    @T.register_correction("_record_a3po", needs=("old_logprobs",))
    def _record(batch):
        seen.append(batch)
        return T.Correction(batch["action_mask"].float(), batch["action_mask"])

    try:
        cfg = _cfg(tmp_path, "--rollout.max_new_tokens=8", "--algo.proximal=interpolate",
                   "--algo.correction=_record_a3po")
        tr = build_trainer(cfg, trainer=AsyncTrainer, max_staleness=2)
        checked = 0
        try:
            for _ in range(6):
                before = {k: v.clone() for k, v in tr.policy.state_dict().items()}
                calls = len(seen)
                m = tr.step()
                part = seen[calls]
                assert m.get("time_logprob_s", 0.0) < 0.05  # no proximal forward in prepare
                now = {k: v.clone() for k, v in tr.policy.state_dict().items()}
                tr.policy.load_state_dict(before)  # θ as the loss saw it
                with torch.no_grad():
                    lp, _ = plain_logprobs_and_entropy(tr.policy, part, 1.0)
                tr.policy.load_state_dict(now)
                want = T.interpolated_proximal_logprobs(part["rollout_logprobs"], lp, part["token_version"],
                                                        part["action_mask"], m["policy_version"] - 1)
                assert (want - part["old_logprobs"])[part["action_mask"]].abs().max() < 1e-5
                checked += int((part["token_version"][part["action_mask"]] < m["policy_version"] - 1).sum())
        finally:
            tr.close()
        assert checked > 0, "no stale token: the interpolation was never exercised"
    finally:
        T.CORRECTIONS._items.pop("_record_a3po", None)


@pytest.mark.parametrize("eta", [1, 2])
def test_the_gated_schedule_generates_each_batch_at_one_version_and_reproduces_bit_for_bit(tmp_path, eta):
    """``async.schedule=gated``: batch k is generated whole at version max(0, k − η) — no request is
    interrupted — so two runs give the same metrics and weights, bit for bit."""
    runs = []
    for name in ("a", "b"):
        cfg = _cfg(tmp_path / name, "--rollout.max_new_tokens=16", "--rollout.prompts_per_step=4",
                   f"--async.max_staleness={eta}", "--async.schedule=gated")
        tr = build_trainer(cfg, trainer=_Recording)
        try:
            ms = [tr.step() for _ in range(5)]
        finally:
            tr.close()
        for k, (version, _, versions, _, _) in enumerate(tr.trained):
            assert version == k and set(versions) == {max(0, k - eta)}  # one version per batch, exactly k − η
        assert all(m["partial_rows_frac"] == 0 for m in ms)
        runs.append((ms, {k: v.clone() for k, v in tr.policy.state_dict().items()}))
    (ma, wa), (mb, wb) = runs
    # the buffer's occupancy when the step reports (rows still generating vs ready) is a snapshot of the
    # workers' progress at that instant — wall-clock, not a result (seen to differ under a loaded machine)
    for a, b in zip(ma, mb):
        same = {k: a[k] for k in a if not k.startswith("time_") and k not in _TIMING}
        assert same == {k: b[k] for k in same}
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resumed_gated_run_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    """Gated, η = 2, checkpoint after step 2 (version 2): batches 2 and 3 are ready, generated at versions 0 and
    1 — weights the resumed run no longer has. Their rows travel in the checkpoint (``state.safetensors``) and are
    ready again on resume; only batch 4 (admitted at version 2) is generated again, under the resumed weights,
    with the same sample_uids and calls: every metric and weight equals the uninterrupted run's, and each batch k
    still comes whole from version k − η."""
    from hyperrl.loop.checkpoint import read_state

    def cfg(name):
        return _cfg(tmp_path / name, "--rollout.max_new_tokens=16", "--rollout.prompts_per_step=4",
                    "--async.max_staleness=2", "--async.schedule=gated")

    def run(tr, steps):
        try:
            return [tr.step() for _ in range(steps)], tr
        finally:
            tr.close()

    ma, a = run(build_trainer(cfg("a"), trainer=_Recording), 5)
    first, b = run(build_trainer(cfg("b"), trainer=_Recording), 2)
    kept = read_state(b.save())["async"]["ready"]
    assert sorted(r["key"] // 4 for r in kept) == [2] * 4 + [3] * 4  # batches 2, 3: their 4 groups each
    assert {r["version"] for r in kept} == {0, 1} and all(r["rows"]["tokens"].shape[0] == 4 for r in kept)
    c = build_trainer(cfg("b"), trainer=_Recording)
    assert c.resume() and c.collector.queue.buffer.ready == 8
    rest, c = run(c, 3)
    for k, (version, _, versions, _, _) in enumerate(b.trained + c.trained):
        assert version == k and set(versions) == {max(0, k - 2)}
    for x, y in zip(ma, first + rest):
        same = {k: x[k] for k in x if not k.startswith("time_") and k not in _TIMING}
        assert same == {k: y[k] for k in same}
    assert all(torch.equal(p, q) for p, q in zip(a.policy.parameters(), c.policy.parameters()))


def test_gated_needs_whole_steps_in_flight(tmp_path):
    with pytest.raises(ValueError, match=r"async.max_concurrent=3: the gated schedule admits whole steps"):
        build_trainer(_cfg(tmp_path, "--async.max_staleness=1", "--async.schedule=gated", "--async.max_concurrent=3"))


def test_a_free_running_run_replays_from_its_event_log_bit_for_bit(tmp_path):
    """A free-running run (η = 2, publications and an evaluation interrupting generation at whatever
    decode step they land on) writes out_dir/async_events.jsonl; ``async.replay`` runs the same
    worker calls — each stopped after the recorded number of decode steps — and takes the same
    batches: the same metrics and weights, bit for bit."""
    runs = []
    for name, extra in (("free", ()), ("replay", (f"--async.replay={tmp_path / 'free' / 'async_events.jsonl'}",))):
        cfg = _cfg(tmp_path / name, "--rollout.max_new_tokens=16", "--rollout.prompts_per_step=4",
                   "--async.max_staleness=2", "--run.eval_prompts=8", *extra)
        tr = build_trainer(cfg)
        if name == "free":  # a call held mid-generation until the next publication interrupts it
            _restart_worker(tr, "hold")
        try:
            ms = [tr.step() for _ in range(3)] + [tr.evaluate()] + [tr.step() for _ in range(3)]
        finally:
            tr.close()
        runs.append((ms, {k: v.clone() for k, v in tr.policy.state_dict().items()}))
    events = [json.loads(x) for x in (tmp_path / "free" / "async_events.jsonl").read_text().splitlines()]
    assert any(e.get("steps") is not None for e in events), "no call was interrupted: the test would prove nothing"
    assert any(m.get("partial_rows_frac", 0) > 0 for m in runs[0][0])
    (ma, wa), (mb, wb) = runs
    for a, b in zip(ma, mb):
        same = {k: a[k] for k in a if k not in _TIMING and not k.startswith("time_")}
        assert same == {k: b[k] for k in same}
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="async.replay: .* does not exist"):
        build_trainer(_cfg(tmp_path / "x", "--async.max_staleness=2", f"--async.replay={tmp_path / 'none.jsonl'}"))


def test_kv_cache_keep_continues_each_generation_over_its_cache_across_publications(tmp_path):
    """``async.kv_cache=keep``: a publication parks the running generation at its next decode step,
    replaces the weights in place and lets it go on — nothing is interrupted or resumed, the tokens
    after the switch carry the new version, and ``kv_version`` records that they were sampled over a
    cache of the older version."""
    cfg = _cfg(tmp_path, "--rollout.max_new_tokens=16", "--rollout.prompts_per_step=4", "--async.max_staleness=1",
               "--async.kv_cache=keep")
    seen = []

    class _Kv(AsyncTrainer):
        def collect(self, timer):
            got = super().collect(timer)
            batch = got.batch
            seen.append((self.version, batch.clone()))
            return got

    tr = build_trainer(cfg, trainer=_Kv)
    _restart_worker(tr, "hold")  # a call held mid-generation until the next publication parks it
    try:
        ms = [tr.step() for _ in range(6)]
    finally:
        tr.close()
    uids = [u for _, b in seen for u in b["sample_uid"].tolist()]
    assert len(uids) == len(set(uids)) == 6 * 4 * 4
    assert max(m["staleness_max"] for m in ms) <= 1
    spanned = 0
    for _, b in seen:
        act, tv, kv = b["action_mask"], b["token_version"], b["kv_version"]
        assert set(b["finish_reason"].tolist()) <= {0, 1}  # nothing interrupted
        first = torch.where(act, tv, 10**9).amin(-1)
        assert bool((kv[act] == first[:, None].expand_as(act)[act]).all())  # the cache of the row's first version
        spanned += int((act & (kv < tv)).any(-1).sum())  # rows whose later tokens met newer weights
    assert spanned > 0, "no generation was parked across a publication"
    with pytest.raises(ValueError, match="async.kv_cache=keep with async.replay"):
        build_trainer(_cfg(tmp_path / "r", "--async.max_staleness=1", "--async.kv_cache=keep",
                           f"--async.replay={tmp_path / 'x.jsonl'}"))


def test_a_synchronous_run_refuses_an_asynchronous_checkpoint(tmp_path):
    """Resume never mixes runs: a checkpoint carrying an asynchronous buffer is not silently resumed by a
    synchronous trainer (its buffered prompts would be dropped)."""
    a = build_trainer(_cfg(tmp_path, "--async.max_staleness=1"))
    try:
        a.step()
        a.save()
    finally:
        a.close()
    with pytest.raises(ValueError, match=r"resume: the checkpoint was written by an asynchronous run"):
        build_trainer(_cfg(tmp_path)).resume()
