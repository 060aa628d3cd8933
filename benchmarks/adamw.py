"""One AdamW step over the default model's weights: torch's for-loop default, foreach, and fused.

    python benchmarks/adamw.py                    # SmolLM2-135M-Instruct, 2 threads, 6 steps each
    python benchmarks/adamw.py --model DIR --threads 1

Each implementation steps the same weights from the same start with the same seeded gradients
(lr 1e-5, weight decay 0.01); the first step (which allocates the two moments) is left out of the
median. It prints each one's median seconds a step and the largest difference of any weight from
the for-loop's after the steps, then one JSON line. update.py and train.py use fused
(grpo/optim.py:adamw); the naive floor of benchmarks/iteration.py keeps torch's default, as its
peers run it.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo import builders, modeling  # noqa: E402

KINDS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def run(model, kind, steps):
    """Median seconds of a step after the first, and the weights after `steps` steps."""
    weights = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=1e-5, weight_decay=0.01, **KINDS[kind])
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(steps):
        for w in weights:
            w.grad = torch.randn(w.shape, generator=generator) * 1e-3
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), weights


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--steps", type=int, default=6, help="steps of each implementation (default 6)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = modeling.load_model(args.model or builders.default_model_dir(), "cpu")
    results, reference = {}, None
    for kind in KINDS:
        seconds, weights = run(model, kind, args.steps)
        reference = reference or weights
        gap = max((w - r).abs().max().item() for w, r in zip(weights, reference))
        results[kind] = {"step_s": seconds, "max_abs_diff_vs_for_loop": gap}
        print(f"{kind:9s} {seconds:7.3f} s a step   max |Δw| against for-loop after {args.steps} steps: {gap:.1e}",
              flush=True)
    print(json.dumps({"threads": args.threads, "steps": args.steps, **results}))


if __name__ == "__main__":
    main()
