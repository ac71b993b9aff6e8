"""All real-vLLM checks in one process (importing vLLM costs ≈25 s a process here), run by
tests/rollout/test_vllm.py in .venv-vllm. Each check starts and shuts down its own engine; one failing
check is reported under its name (``{"error": ...}``) and the others still run.

Prints one JSON line: ``RESULT {"check_vllm": {...}, "check_vllm_trainer": {...}, ...}``.
"""

import importlib
import json
import sys
import time
import traceback
from pathlib import Path

CHECKS = ("check_vllm", "check_vllm_trainer", "check_vllm_lora", "check_vllm_export", "check_vllm_stops",
          "check_vllm_async", "check_vllm_moe", "check_vllm_ray", "check_vllm_native", "check_vllm_tp",
          "check_vllm_tp_trainer", "check_vllm_colocated", "check_vllm_ray_tp")


def main(names=CHECKS):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            out[name] = importlib.import_module(name).run()
        except Exception:  # noqa: BLE001 — reported to the test, which fails with the traceback
            out[name] = {"error": traceback.format_exc()[-3000:]}
        out[name]["wall_s"] = time.perf_counter() - t0
        print(f"{name}: {out[name]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:] or CHECKS)
