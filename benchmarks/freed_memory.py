"""What glibc's default of returning freed memory to the kernel costs an iteration, against
grpo/cli.py:keep_freed_memory (which every stage's command calls first): page faults, system
time and seconds of each stage, and the peak resident set.

    python benchmarks/freed_memory.py               # SmolLM2-135M-Instruct, the default job's shape
    python benchmarks/freed_memory.py --iterations 5

Each setting runs in its own child process (mallopt holds for the whole process), one after the
other: the sampler as sample.rollout runs it, the reference pass and one update.train_policy step
(forward, backward, AdamW), on iteration.py's Table 1 shape (B = 4 × G = 8, 24 new tokens), for
--iterations iterations with a new seed each. For the last iteration, when the allocator has
settled: each stage's wall seconds, user and system CPU seconds (both threads) and minor page
faults; then the process's peak RSS. Prints a table, then one JSON line.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt


def measured(fn):
    """(fn()'s result, {wall_s, user_s, sys_s, minor_faults})."""
    before = usage()
    out = fn()
    after = usage()
    return out, dict(zip(("wall_s", "user_s", "sys_s", "minor_faults"), (b - a for a, b in zip(before, after))))


def child(args):
    from grpo import cli

    kept = args.child == "keep" and cli.keep_freed_memory()
    import torch

    from grpo import builders, modeling
    from iteration import B, G, iteration_stages, prompt_batch

    model_dir = args.model or builders.default_model_dir()
    tokenizer = modeling.load_tokenizer(model_dir)
    policy, ref = modeling.load_model(model_dir, "cpu"), modeling.load_model(model_dir, "cpu")
    prompt_ids, prompt_mask = prompt_batch(tokenizer, torch.device("cpu"), B, G)
    sampling, reference, update_step = iteration_stages(policy, ref, tokenizer, model_dir, prompt_ids, prompt_mask, G)
    for i in range(args.iterations):
        rollouts, stats_sample = measured(lambda: sampling(i))
        ref_logprobs, stats_ref = measured(lambda: reference(rollouts))
        _, stats_update = measured(lambda: update_step(rollouts, ref_logprobs))
    with open("/proc/self/status") as status:
        peak_mb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    print(json.dumps({"kept": kept, "threads": torch.get_num_threads(), "peak_rss_mb": peak_mb,
                      "stages": {"sampling": stats_sample, "reference pass": stats_ref, "update": stats_update}}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--iterations", type=int, default=3, help="iterations in each child; the last is shown (default 3)")
    p.add_argument("--child", choices=["plain", "keep"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    results = {}
    for setting in ("plain", "keep"):
        argv = [sys.executable, os.path.abspath(__file__), "--child", setting, "--iterations", str(args.iterations),
                *(["--model", args.model] if args.model else [])]
        out = subprocess.run(argv, check=True, capture_output=True, text=True,
                             env=dict(os.environ, TRANSFORMERS_VERBOSITY="error")).stdout
        results[setting] = json.loads(out.strip().splitlines()[-1])
    names = {"plain": "glibc's default", "keep": "keep_freed_memory"}
    print(f"{'stage':16s} {'setting':18s} {'wall s':>7s} {'user s':>7s} {'sys s':>6s} {'page faults':>11s}")
    for stage in results["plain"]["stages"]:
        for setting, r in results.items():
            s = r["stages"][stage]
            print(f"{stage:16s} {names[setting]:18s} {s['wall_s']:7.2f} {s['user_s']:7.2f} {s['sys_s']:6.2f} "
                  f"{s['minor_faults']:11,d}")
    for setting, r in results.items():
        wall = sum(s["wall_s"] for s in r["stages"].values())
        print(f"{names[setting]}: the three stages {wall:.2f} s; peak RSS {r['peak_rss_mb']:,.0f} MB")
    print(json.dumps({"iterations": args.iterations, **results}))


if __name__ == "__main__":
    main()
