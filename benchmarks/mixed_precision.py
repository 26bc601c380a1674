"""Plans of GPT-2 124M dims with and without a bf16 mixed-precision policy, side by side.

GPT-2 small dims (12 layers, width 768, vocabulary 50304), batch 16 × 1024, a (2, 4) mesh
priced by the h100 preset; one row per policy: the estimated step, its compute and
communication, the modelled peak and its breakdown (GiB per device), and the planning time.

    python benchmarks/mixed_precision.py

Nothing is allocated: the model is built on the meta device. The plan cache is off.
"""

import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers as T  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

import autoparallel  # noqa: E402

POLICIES = {
    "none (fp32)": None,
    "bf16, reduce fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16, reduce bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
}


def main():
    T.logging.set_verbosity_error()
    cfg = T.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, n_positions=1024, use_cache=False)
    with torch.device("meta"):
        model = T.GPT2LMHeadModel(cfg)
    ids = torch.empty(16, 1024, dtype=torch.long, device="meta")
    for name, policy in POLICIES.items():
        t0 = time.perf_counter()
        p = autoparallel.plan(model, {"input_ids": ids, "labels": ids}, mesh_shape=(2, 4), mp_policy=policy,
                              cost_model=autoparallel.CostModel("h100"), cache_dir=False)
        est = p.estimate
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in est.memory.breakdown.items() if v)
        print(f"{name:<18} step {est.step_time_s * 1e3:.1f} ms (compute {est.compute_s * 1e3:.1f}, "
              f"communication {est.comm_s * 1e3:.1f}), peak {est.peak_memory_bytes / 2**30:.2f} GiB "
              f"({parts}); planned in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
