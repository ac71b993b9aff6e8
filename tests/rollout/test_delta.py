"""Delta publication (issue 33, item 1, one process): only the elements whose bits changed, checksummed, against a
named base version — bit-identical to a full publication after N steps, a refused base falling back to a full
publication, a damaged delta failing the transaction with the engine still serving its version."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.rollout.delta import DeltaError, apply_delta, encode_delta, tensor_checksum


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.floats(0.0, 1.0), st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
       st.integers(0, 2**16))
def test_apply_of_encode_is_the_new_tensor_bit_for_bit(n, frac, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    new = base.clone()
    hit = torch.rand(n, generator=g) < frac
    new[hit] = torch.randn(int(hit.sum()), generator=g).to(dtype)
    d = encode_delta(new, base)
    out = apply_delta(base, d)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       new.view(torch.int16 if dtype != torch.float32 else torch.int32))
    changed = int((new.view(torch.uint8).view(-1, new.element_size()) !=
                   base.view(torch.uint8).view(-1, new.element_size())).any(-1).sum())
    assert d.changed == changed and d.nbytes <= n * new.element_size()  # never more than the dense tensor
    assert d.kind == ("dense" if changed * (4 + new.element_size()) >= n * new.element_size() else "sparse")


def test_bits_not_values_decide_what_changed():
    base = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)  # −0.0 == 0.0 as floats, not as bits
    d = encode_delta(new, base)
    assert d.changed == 1 and torch.equal(apply_delta(base, d).view(torch.int16), new.view(torch.int16))


def test_a_damaged_delta_names_the_tensor():
    base = torch.zeros(100, dtype=torch.bfloat16)
    new = base.clone()
    new[3] = 1.0
    d = encode_delta(new, base)
    bad = d._replace(values=d.values + 1)
    with pytest.raises(DeltaError, match="layers.0.w: checksum mismatch"):
        apply_delta(base, bad, "layers.0.w")
    assert tensor_checksum(new) == d.checksum


def _trainer(tmp_path, *extra):
    from hyperrl.compose import build
    from hyperrl.config import load_config

    return build(load_config(None, [f"--run.out_dir={tmp_path}", "--task=modsum", "--rollout.prompts_per_step=4",
                                    "--rollout.n=4", "--rollout.max_new_tokens=2", "--model.dtype=bfloat16",
                                    "--run.threads=1", "--rollout.delta_publication=true", "--optim.lr=1e-5", *extra]))


def _engine_equals_a_full_publication(tr):
    served = tr.engine.model.state_dict()
    for k, p in tr.policy.named_parameters():
        full = p.detach().to(served[k].dtype)  # what a full publication casts and sends
        assert torch.equal(served[k].view(torch.int16), full.view(torch.int16)), k


def test_after_n_delta_publications_the_engine_is_bit_identical_to_a_full_publication(tmp_path):
    tr = _trainer(tmp_path)
    fracs = []
    for _ in range(6):
        m = tr.step()
        fracs.append(m["delta_frac"])
        _engine_equals_a_full_publication(tr)
    assert fracs[0] == 1.0  # the first publication is full: no base yet
    print("delta_frac per step", fracs)
    assert all(0.0 < f < 0.2 for f in fracs[1:]), fracs  # bf16 engine, fp32 master at lr 1e-5: a fraction changes
    assert m["publish_bytes"] < m["publish_full_bytes"] / 2 and tr.engine.policy_version == 6


def test_an_engine_at_another_version_gets_a_full_publication(tmp_path):
    tr = _trainer(tmp_path)
    tr.step()
    tr.step()
    v = tr.engine.policy_version
    with torch.no_grad():  # somebody else published to the engine: it no longer holds the publisher's base
        tr.engine.load_weights({k: t.clone() for k, t in tr.engine.model.state_dict().items()}, v + 1)
    tr.version = v + 1
    m = tr.step()
    assert "delta_fallback" in tr.publisher.publisher.last and m["delta_frac"] == 1.0
    said = tr.publisher.publisher.last["delta_fallback"]
    assert "a delta against version 2, but this engine serves version 3" in said
    _engine_equals_a_full_publication(tr)
    assert tr.step()["delta_frac"] < 0.5  # deltas again, against the full publication


def test_a_checksum_failure_fails_closed_and_the_engine_keeps_serving(tmp_path):
    from hyperrl.rollout.delta import encode_delta as enc

    tr = _trainer(tmp_path)
    tr.step()
    before = {k: v.clone() for k, v in tr.engine.model.state_dict().items()}
    eng, v = tr.engine, tr.engine.policy_version
    name = next(iter(before))
    new = before[name].clone()
    new.view(-1)[0] += 1
    d = enc(new, before[name])
    eng.begin(v + 1, base=v)
    with pytest.raises(DeltaError, match=f"{name}: checksum mismatch"):
        eng.stage_deltas({name: d._replace(checksum=d.checksum ^ 1)})
    assert eng.policy_version == v and eng._txn is None
    assert all(torch.equal(before[k], t) for k, t in eng.model.state_dict().items())


def test_delta_publication_is_refused_where_it_does_not_run_yet():
    from hyperrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout.delta_publication with asynchronous rollout workers"):
        load_config(None, ["--rollout.delta_publication=true", "--async.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"rollout.delta_publication with an engine sharing the trainer's weights"):
        load_config(None, ["--rollout.delta_publication=true", "--rollout.engine={name: transformers, "
                                                               "share_weights: true}"])
