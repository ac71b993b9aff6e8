"""The delta publication's CPU kernels against what they replaced, side by side in one run (issue 33): on a bf16
tensor the size of Qwen3-0.6B's embedding (151,936 × 1,024, 297 MiB) with a fraction of its elements changed —
the checksum (zlib's Adler-32 against :func:`hyperrl.rollout.delta_kernels.checksum`, xxh3 by blocks), the scan
(torch's ``nonzero(new != base)``, the gather and the checksum, three whole-tensor passes, against
:func:`~hyperrl.rollout.delta_kernels.scan`) and the in-place write with its undo (torch's index gather + put +
checksum against :func:`~hyperrl.rollout.delta_kernels.swap`). Median of 5; checks both sides agree.

    python benchmarks/delta_kernels.py --fracs 0.03 0.1
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table, timeit  # noqa: E402


def run(frac: float, n: int = 151_936 * 1024, seed: int = 0) -> list[list]:
    from hyperrl.rollout import delta_kernels as kernels

    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16)
    new = base.clone()
    hit = torch.rand(n, generator=g) < frac
    new[hit] += 1
    nn, on = new.numpy(), base.numpy()

    def torch_scan():
        i = torch.nonzero(new != base).flatten()
        return i, new[i], zlib.adler32(nn.view(np.uint8))

    i, v, _ = torch_scan()
    ki, kv, k, _ = kernels.scan(nn, on, index_dtype=np.int32)
    assert k == i.numel() and np.array_equal(ki, i.numpy()) and np.array_equal(kv, v.numpy())
    idx32 = i.to(torch.int32)
    flat_t, flat_k = base.clone(), base.clone().numpy()

    def torch_swap():
        j = idx32.long()
        old = flat_t[j].clone()
        flat_t[j] = v
        return old, zlib.adler32(flat_t.numpy().view(np.uint8))

    rows = []
    for what, old_fn, new_fn in [
        ("checksum", lambda: zlib.adler32(nn.view(np.uint8)), lambda: kernels.checksum(nn.view(np.uint8))),
        ("scan (find, gather, checksum)", torch_scan, lambda: kernels.scan(nn, on, index_dtype=np.int32)),
        ("in-place write + undo + checksum", torch_swap, lambda: kernels.swap(flat_k, idx32.numpy(), v.numpy())),
    ]:
        t_old, t_new = timeit(old_fn), timeit(new_fn)
        rows.append([f"{frac:g}", what, t_old * 1e3, t_new * 1e3, t_old / t_new])
    assert np.array_equal(flat_k, flat_t.numpy())  # both writes left the same tensor
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.03, 0.1])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    rows = [r for f in args.fracs for r in run(f)]
    body = ("A 297 MiB bf16 tensor (Qwen3-0.6B's embedding) with `changed` of its elements changed; torch + zlib "
            "(what the delta used before) against hyperrl.rollout.delta_kernels, median of 5 each, in one run.\n\n"
            + table(["changed", "pass", "torch + Adler-32 ms", "kernels ms", "ratio"], rows))
    if args.no_record:
        print(body)
    else:
        append_results("delta kernels", body)


if __name__ == "__main__":
    main()
