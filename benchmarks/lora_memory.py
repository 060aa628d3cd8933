"""Peak memory, checkpoint size and time of the default job, full fine-tune against LoRA.

    python benchmarks/lora_memory.py                      # SmolLM2-135M-Instruct, --lora-r 16
    python benchmarks/lora_memory.py --lora-r 8 --iterations 3
    python benchmarks/lora_memory.py --config tiny        # any other flag goes to train.py in both runs

Each setting runs `python train.py` in its own child process, exactly as a user runs it: the default
job's shape (B = 4 × G = 8, 24 new tokens, τ 0.7, β 0.01), --iterations iterations with a save
after each (--save-every 1) and no held-out evaluation. Peak memory is the child's VmHWM, polled
(benchmarks/iteration.py:run_train); a full fine-tune holds the policy, a second copy as
π_ref and AdamW's two moments of every weight, a LoRA run one copy of the weights and AdamW's state
of the adapters alone. The checkpoint is policy/ as the run leaves it (weights or adapters, AdamW's
state, tokenizer). Seconds per iteration are the median of iter_XXXX/metrics.json's
perf/iteration_s. Prints a table and one JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from iteration import run_train  # noqa: E402

from grpo.disk import files  # noqa: E402


def folder_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names) / 2 ** 20


def run(model, run_dir, iterations, extra):
    peak_rss_mb = run_train(["--run-dir", run_dir, "--iterations", str(iterations), "--eval-every", "0",
                             "--save-every", "1", *(["--model", model] if model else []), *extra],
                            f"train.py {' '.join(extra)}")
    seconds = [files.read_json(os.path.join(run_dir, f"iter_{i:04d}", "metrics.json"))["perf/iteration_s"]
               for i in range(iterations)]
    return {"peak_rss_mb": peak_rss_mb, "checkpoint_mb": folder_mb(os.path.join(run_dir, "policy")),
            "iteration_s": statistics.median(seconds), "flags": extra}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lora-r", type=int, default=16, help="the LoRA run's rank (default 16)")
    p.add_argument("--iterations", type=int, default=3, help="iterations of each run (default 3)")
    args, extra = p.parse_known_args(argv)           # any other flag goes to train.py in both runs
    with tempfile.TemporaryDirectory() as tmp:
        results = {"full": run(args.model, os.path.join(tmp, "full"), args.iterations, extra),
                   "lora": run(args.model, os.path.join(tmp, "lora"), args.iterations,
                               extra + ["--lora-r", str(args.lora_r)])}
    print(f"{'':8} {'peak RSS MiB':>13} {'policy/ MiB':>12} {'s / iteration':>14}")
    for name, r in results.items():
        print(f"{name:8} {r['peak_rss_mb']:13,.0f} {r['checkpoint_mb']:12,.1f} {r['iteration_s']:14.2f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
