"""One episode's one-token call while another episode sends 8 MiB bodies (issue 55, item 3): the call's latency
alone and under the flood, side by side in one run, and how long each hostile body takes to be refused (413: a
body larger than the context can hold is refused as it arrives, never parsed, rendered or tokenised; renders run
off the event loop). Target: ≤ 50 ms added to the one-token call.

    python benchmarks/gateway_hostile.py --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402


def main():
    import httpx
    import torch

    from hyperrl.agents import Gateway
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams, TransformersEngine
    from hyperrl.tokenizer import char_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = char_tokenizer()
    engine = TransformersEngine(tiny_qwen3(len(tok), hidden=128, intermediate=256))
    sp = SamplingParams(max_new_tokens=1, eos_id=tok.eos_token_id, seed=1)
    call = {"model": "hyperrl-policy", "messages": [{"role": "user", "content": "347*28="}], "max_tokens": 1}
    big = (b'{"model": "hyperrl-policy", "messages": [{"role": "user", "content": "'
           + b"x" * (args.mib << 20) + b'"}]}')
    with Gateway(engine, tok, sp, tool_format="qmark", max_model_len=args.context) as gw:
        client = httpx.Client()

        def one_token(i: int) -> float:
            ep = gw.open(i)
            t = time.perf_counter()
            r = client.post(f"{ep.base_url}/chat/completions", json=call,
                            headers={"Authorization": f"Bearer {ep.api_key}"})
            dt = time.perf_counter() - t
            assert r.status_code == 200, r.text
            gw.finish(ep)
            return dt * 1e3

        stop, refused = threading.Event(), []

        def flood() -> None:
            hostile = gw.open(10**6)
            with httpx.Client() as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    r = c.post(f"{hostile.base_url}/chat/completions", content=big,
                               headers={"Authorization": f"Bearer {hostile.api_key}",
                                        "Content-Type": "application/json"})
                    refused.append(((time.perf_counter() - t) * 1e3, r.status_code))

        for i in range(10):
            one_token(i)
        alone = [one_token(i) for i in range(args.calls)]
        th = threading.Thread(target=flood, daemon=True)
        th.start()
        while not refused:
            time.sleep(0.01)
        under = [one_token(args.calls + i) for i in range(args.calls)]
        stop.set()
        th.join(60)
    codes = sorted({c for _, c in refused})
    rows = [["alone", round(statistics.median(alone), 2), round(sorted(alone)[int(0.95 * len(alone))], 2), "—"],
            [f"while another episode sends {args.mib} MiB bodies", round(statistics.median(under), 2),
             round(sorted(under)[int(0.95 * len(under))], 2),
             f"{len(refused)} refused ({codes}), median {statistics.median(t for t, _ in refused):.1f} ms each"]]
    added = statistics.median(under) - statistics.median(alone)
    body = table(["one-token call", "median ms", "p95 ms", "the hostile bodies"], rows)
    body += (f"\n\nReading: the one-token call gains {added:.2f} ms (median) under the flood (target ≤ 50 ms); "
             f"each {args.mib} MiB body is refused with a 413 (the gateway's body bound at a {args.context}-token "
             f"context: {gw.max_body} bytes) as it arrives.")
    append_results("the gateway under hostile bodies (benchmarks/gateway_hostile.py)", body)


if __name__ == "__main__":
    main()
