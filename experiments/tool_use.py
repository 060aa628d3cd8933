"""Does GRPO teach the default model to use a calculator? The products task (3-digit × 2-digit, exact
answer) on SmolLM2-135M-Instruct, with Toolformer's in-line calculator (`--env inline_calculator`) and
without a tool, one seed each: a demonstration for docs/environments.md, not one of the claims.

    python -m experiments.tool_use                    # both arms under runs/tool_use/
    python -m experiments.tool_use --iterations 2 --eval-prompts 4 --out /tmp/tool_use   # a smoke run

Stated before the runs (2026-12-07). Metric: on the held-out prompts, 8 sampled answers each at the
run's τ (--eval-samples 8), pass@1 (the mean over samples of exact_answer), pass@8 (Chen et al.'s
estimator), and the share of sampled episodes that called the tool; also the greedy accuracy, before
training and after it. Prediction: with the tool, the call rate and pass@1 rise, and pass@1 after
training is higher with the tool than without. Decision: "supported" when all three hold (any rise,
one seed: a demonstration, not a test of significance), else "not supported", naming which failed.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"tool": ["--env", "inline_calculator", "--max-turns", "4"], "no_tool": []}


def run(out, arm, args):
    run_dir = os.path.join(out, arm)
    final = os.path.join(run_dir, "eval", f"iter_{args.iterations:04d}_samples.jsonl")
    if not os.path.isfile(final):
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--task", "products", "--run-dir", run_dir,
                        "--iterations", str(args.iterations), "--max-new-tokens", "48", "--eval-samples", "8",
                        "--eval-every", str(args.iterations), "--eval-prompts", str(args.eval_prompts),
                        *ARMS[arm]], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return {step: evaluation(run_dir, step) for step in (0, args.iterations)}


def evaluation(run_dir, step):
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "eval", f"iter_{step:04d}_samples.jsonl"))]
    greedy = [json.loads(line) for line in open(os.path.join(run_dir, "eval", f"iter_{step:04d}.jsonl"))]
    return {"pass@1": sum(s["rewards"]["exact_answer"] for s in samples) / len(samples),
            "pass@8": pass_at_8(samples), "calls": sum(s.get("tool_calls", 0) > 0 for s in samples) / len(samples),
            "greedy": sum(r["reward"] == 1.0 for r in greedy) / len(greedy), "prompts": len(greedy)}


def pass_at_8(samples):
    from grpo.loop.evaluation import pass_at_k
    groups = {}
    for s in samples:
        groups.setdefault(s["group"], []).append(s["rewards"]["exact_answer"] == 1.0)
    return sum(pass_at_k(len(g), sum(g), 8) for g in groups.values()) / len(groups)


def verdict(rows, K):
    tool, plain = rows["tool"], rows["no_tool"]
    checks = {"the call rate rose": tool[K]["calls"] > tool[0]["calls"],
              "pass@1 rose with the tool": tool[K]["pass@1"] > tool[0]["pass@1"],
              "pass@1 after training is higher with the tool": tool[K]["pass@1"] > plain[K]["pass@1"]}
    failed = [name for name, ok in checks.items() if not ok]
    return "supported" if not failed else "not supported: " + "; ".join(f"not ({name})" for name in failed)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=15)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "tool_use"))
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    rows = {arm: run(args.out, arm, args) for arm in ARMS}
    K = args.iterations
    print("| arm | iteration | tool-call rate | pass@1 | pass@8 | greedy right | held-out prompts |")
    print("|---|---|---|---|---|---|---|")
    for arm, steps in rows.items():
        for step, r in steps.items():
            print(f"| {arm} | {step} | {r['calls']:.3f} | {r['pass@1']:.3f} | {r['pass@8']:.3f} | "
                  f"{r['greedy']:.3f} | {r['prompts']} |")
    print(f"verdict: {verdict(rows, K)}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
