"""How much of each stage of an iteration is matrix products, measured where they run: the share a
code change that leaves the products alone can remove at most.

    python benchmarks/matmul_share.py               # SmolLM2-135M-Instruct, the default job's shape
    python benchmarks/matmul_share.py --reps 3

On the default job's shape (iteration.py's Table 1: B = 4 × G = 8, 24 new tokens, τ = 0.7,
β = 0.01), in this process: the project's sampler as sample.rollout runs it, the reference pass,
and one update.train_policy step (forward, backward, AdamW), each under torch.profiler after a
warm-up, median of --reps; and the naive floor (iteration.floor_once: generate, a reference
forward, a forward + backward + AdamW step, unshared), median of --reps. For each stage: its
seconds, the self CPU seconds of its matrix-product kernels (aten::mm, addmm, bmm, baddbmm and
oneDNN's linear; attention's fused kernel is not counted), their share, and the four other
kernels that took the most self time (of the last measured run). The last line: the
iteration with every other cost at zero, over the naive floor, the lowest ratio to the naive
floor these products allow at the rate they run here.
Prints a table, then one JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from grpo import builders, modeling  # noqa: E402
from iteration import B, G, floor_once, iteration_stages, prompt_batch  # noqa: E402

PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_linear",
            "mkldnn::_linear_pointwise"}                     # the last: modeling.decode_linears


def profiled(fn):
    """(seconds, matmul self-CPU seconds, {other kernel: self-CPU seconds}) of fn() under torch.profiler."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    seconds = time.perf_counter() - start
    kernels = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    return seconds, sum(v for k, v in kernels.items() if k in PRODUCTS), {
        k: v for k, v in kernels.items() if k not in PRODUCTS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--reps", type=int, default=2, help="measured runs of each stage and of the floor (default 2)")
    args = p.parse_args(argv)
    model_dir = args.model or builders.default_model_dir()
    tokenizer = modeling.load_tokenizer(model_dir)
    policy, ref = modeling.load_model(model_dir, "cpu"), modeling.load_model(model_dir, "cpu")
    prompt_ids, prompt_mask = prompt_batch(tokenizer, torch.device("cpu"), B, G)
    sampling, reference, update_step = iteration_stages(policy, ref, tokenizer, model_dir, prompt_ids, prompt_mask, G)
    out = {}
    stages = {"sampling": lambda: out.update(rollouts=sampling(0)),                 # each on the last's output
              "reference pass": lambda: out.update(ref=reference(out["rollouts"])),
              "update": lambda: update_step(out["rollouts"], out["ref"])}
    measured = {name: [] for name in stages}
    for rep in range(args.reps + 1):                                      # the first round warms up
        for name, fn in stages.items():
            result = profiled(fn)
            if rep:
                measured[name].append(result)
    floor_optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    floor = statistics.median(floor_once(policy, ref, floor_optimizer, prompt_ids, prompt_mask, torch.device("cpu"))
                              ["total"] for _ in range(args.reps))

    results = {}
    print(f"{'stage':16s} {'s':>7s} {'matmul s':>9s} {'share':>6s}   the other kernels that took the most")
    for name, runs in measured.items():
        seconds, matmul = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        others = sorted(runs[-1][2].items(), key=lambda kv: -kv[1])[:4]
        results[name] = {"seconds": seconds, "matmul_s": matmul, "top_other_s": dict(others)}
        print(f"{name:16s} {seconds:7.2f} {matmul:9.2f} {matmul / seconds:6.1%}   "
              + ", ".join(f"{k} {v:.2f} s" for k, v in others))
    total, matmul = sum(r["seconds"] for r in results.values()), sum(r["matmul_s"] for r in results.values())
    print(f"{'the three':16s} {total:7.2f} {matmul:9.2f} {matmul / total:6.1%}")
    print(f"naive floor {floor:.2f} s: the three stages over it {total / floor:.3f}; their matrix products alone "
          f"{matmul / floor:.3f}")
    print(json.dumps({"stages": results, "naive_floor_s": floor, "ratio": total / floor, "matmul_ratio": matmul / floor,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
