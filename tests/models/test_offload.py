"""optim.offload: cpu (issue 54, item 5) — AdamW's state in host memory: on this machine the "device" is the CPU and
the run is torch.optim.AdamW's bit for bit (weights, metrics, checkpoints, resume); a bf16 parameter keeps an fp32
master that a resume does not round."""

import pytest
import torch

from hyperrl.distributed.offload import HostAdamW


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_the_steps_are_adamws_bit_for_bit(wd):
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=wd)
    ob = HostAdamW(b.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=wd)
    g = torch.Generator().manual_seed(1)
    for k in range(5):
        x = torch.randn(6, 8, generator=g)
        for m, o in ((a, oa), (b, ob)):
            for grp in o.param_groups:  # the learner's schedule sets the lr on each step
                grp["lr"] = 3e-3 * (1 - 0.1 * k)
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) and torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])
               for i in sa)
    assert all(v.device.type == "cpu" for st in ob.state.values() for v in st.values())


def test_a_bf16_parameter_keeps_its_fp32_master_through_a_resume():
    m = _model(dtype=torch.bfloat16)
    o = HostAdamW(m.parameters(), lr=1e-4, weight_decay=0.0)
    m(torch.randn(3, 8).bfloat16()).float().pow(2).sum().backward()
    o.step()
    masters = [o.state[p]["master"].clone() for p in m.parameters()]
    assert all(x.dtype == torch.float32 for x in masters)
    assert any(not torch.equal(x, p.float()) for x, p in zip(masters, m.parameters()))  # finer than the bf16 weights
    o2 = HostAdamW(m.parameters(), lr=1e-4, weight_decay=0.0)
    o2.load_state_dict(o.state_dict())
    assert all(torch.equal(o2.state[p]["master"], x) for p, x in zip(m.parameters(), masters))


def test_a_run_with_the_state_offloaded_is_the_run_without(tmp_path):
    """The default job, 3 steps, checkpoint, 2 more after a resume: every metric and weight equals the
    non-offloaded run's."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    def cfg(name, *extra):
        return load_config(None, [f"--run.out_dir={tmp_path / name}", "--run.eval_every=0",
                                  "--rollout.prompts_per_step=4", "--rollout.n=4", *extra])

    runs = []
    for name, extra in (("plain", ()), ("offload", ("--optim.offload=cpu",))):
        tr = build_trainer(cfg(name, *extra))
        assert isinstance(tr.learner.modules["policy"].optimizer, HostAdamW) == bool(extra)
        ms = [tr.step() for _ in range(3)]
        tr.save()
        tr.close()
        tr = build_trainer(cfg(name, *extra))
        assert tr.resume()
        ms += [tr.step() for _ in range(2)]
        runs.append((ms, [p.detach().clone() for p in tr.policy.parameters()]))
        tr.close()
    (ma, wa), (mb, wb) = runs
    for x, y in zip(ma, mb):
        same = {k for k in x if not k.startswith("time_") and k != "tokens_per_s"}
        assert {k: x[k] for k in same} == {k: y[k] for k in same}
    assert all(torch.equal(p, q) for p, q in zip(wa, wb))


def _fsdp_worker(rank, world, out_dir, offload):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    tr = build_trainer(load_config(None, [f"--run.out_dir={out_dir}", "--run.eval_every=0", "--run.threads=1",
                                          "--rollout.prompts_per_step=4", "--rollout.n=4",
                                          f"--optim.offload={offload}"]))
    ms = [tr.step() for _ in range(2)]
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in tr.policy.named_parameters()}
    return {"loss": [m["loss_policy"] for m in ms], "weights": {k: v.numpy() for k, v in full.items()},
            "sharded": any(hasattr(p, "full_tensor") for p in tr.policy.parameters())}


def test_fsdp_ranks_step_their_shards_on_the_host(tmp_path):
    """2 gloo ranks under FSDP2: each rank's optimizer holds its local shards' state on the host; the weights after
    two steps equal the non-offloaded run's bit for bit."""
    from tests.dist_helpers import run_gloo

    on = run_gloo(_fsdp_worker, 2, str(tmp_path / "on"), "cpu", timeout=300)
    off = run_gloo(_fsdp_worker, 2, str(tmp_path / "off"), "none", timeout=300)
    assert on[0]["sharded"] and on[0]["loss"] == off[0]["loss"]
    assert all((on[0]["weights"][k] == off[0]["weights"][k]).all() for k in off[0]["weights"])
