import os

import torch
from hypothesis import settings

from hyperrl.trajectory import make_trajectory

settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(1)


def random_batch(B=8, T=12, group_size=4, seed=0, holes=False, prompt_len=3):
    """A valid right-padded trajectory: prompt of `prompt_len`, random response length, optional
    observation holes (action mask 0 inside the response)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len + 1, T + 1, (B,), generator=g)
    ar = torch.arange(T)
    attn = ar[None] < lengths[:, None]
    act = attn & (ar[None] >= prompt_len)
    if holes:
        act = act & (torch.rand(B, T, generator=g) > 0.25)
    lp = torch.where(act, -torch.rand(B, T, generator=g) * 3, 0.0)
    return make_trajectory(
        tokens=torch.randint(0, 50, (B, T), generator=g) * attn,
        attention_mask=attn,
        action_mask=act,
        rollout_logprobs=lp,
        policy_version=torch.zeros(B, dtype=torch.int64),
        group_id=torch.arange(B) // group_size,
        reward=torch.randint(0, 2, (B,), generator=g).float(),
    )


def resign(checkpoint, *names):
    """Record the current checksums of ``names`` in a checkpoint's marker (a test that edits a
    checkpoint file on purpose — to reach the check behind the checksum)."""
    import hashlib
    import json
    from pathlib import Path

    marker = Path(checkpoint) / "COMPLETE"
    rec = json.loads(marker.read_text())
    for n in names:
        rec["sha256"][n] = hashlib.sha256((Path(checkpoint) / n).read_bytes()).hexdigest()
    marker.write_text(json.dumps(rec))
