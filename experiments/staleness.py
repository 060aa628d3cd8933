"""The default job with --staleness 0 and 1, seeds 0..S−1: an observation, not a claim (no rule decides
anything; docs/performance.md shows the table with its command and date).

    python -m experiments.staleness                   # 3 seeds of each K under runs/staleness/
    python -m experiments.staleness --seeds 1 --out /tmp/staleness

Each run is `python train.py --seed S --staleness K --run-dir OUT/kK_seedS` in a child process, one at a
time (a finished run is read, not run again). Per run: the held-out answers right (of the evaluation's
prompts) at each evaluation, the last iteration's KL to π_ref (losses/kl), the mean over iterations of
the update's π_prox/π_behav weights (diag/rollout_is_weight_mean, _max, _beyond_cap; K = 0 trains on
its own samples and logs none), and the median seconds of an iteration.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out, K, seed):
    run_dir = os.path.join(out, f"k{K}_seed{seed}")
    if not os.path.isfile(os.path.join(run_dir, "eval", "iter_0015.jsonl")):
        resume = ["--resume"] if os.path.isdir(run_dir) else []
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--seed", str(seed), "--staleness", str(K),
                        "--run-dir", run_dir, *resume], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return summary(run_dir)


def summary(run_dir):
    right = [sum(r["reward"] == 1.0 for r in map(json.loads, open(path)))
             for path in sorted(glob.glob(os.path.join(run_dir, "eval", "iter_*.jsonl")))]
    metrics = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(run_dir, "iter_*", "metrics.json")))]
    weights = {k: statistics.mean(m[f"diag/rollout_is_weight_{k}"] for m in metrics)
               if all(f"diag/rollout_is_weight_{k}" in m for m in metrics) else None
               for k in ("mean", "max", "beyond_cap")}
    return {"held_out_right": right, "kl": metrics[-1]["losses/kl"], "weights": weights,
            "iteration_s": statistics.median(m["perf/iteration_s"] for m in metrics)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "staleness"))
    args = p.parse_args()
    rows = {(K, s): run(args.out, K, s) for s in range(args.seeds) for K in (0, 1)}
    print("| K | seed | held-out right at 0, 5, 10, 15 | KL at the end | weight mean | weight max | beyond cap | s/iteration |")
    print("|---|---|---|---|---|---|---|---|")
    for (K, s), r in sorted(rows.items()):
        w = r["weights"]
        cells = ["—"] * 3 if w["mean"] is None else [f"{w['mean']:.3f}", f"{w['max']:.3f}", f"{w['beyond_cap']:.4f}"]
        print(f"| {K} | {s} | {', '.join(map(str, r['held_out_right']))} | {r['kl']:.3f} | {' | '.join(cells)} | "
              f"{r['iteration_s']:.1f} |")
    print(json.dumps({f"k{K}_seed{s}": r for (K, s), r in rows.items()}))


if __name__ == "__main__":
    main()
