"""The source article's claims about GRPO, one experiment each, run through train.py.

    python -m experiments.claims c1              # one claim: every arm × 3 seeds, then its PNG and table
    python -m experiments.claims all             # the seven, one after the other
    python -m experiments.claims c3 --seeds 5 --iterations 60
    python -m experiments.claims c1 --smoke      # 2 iterations, 1 seed (what the tests run)

Every arm is `train.py --config tiny` (the 2-layer Llama learning character classes from scratch;
CLAIMS says what each arm changes) with seeds 0..S−1, in experiments/runs/CLAIM/ARM_seedS. Each
run is a child process forked from a fork server that has imported train.py once; the child
reports its own peak RSS. Then experiments/results/CLAIM.png (the claim's metrics against the iteration, mean ±
std over the seeds, drawn by experiments.plot) and CLAIM.md (per arm, mean ± std over the seeds:
each metric's final value, the mean of the last five iterations, and its area under the curve,
the mean over all iterations; wall time; peak RSS). The verdicts are written in the README by a
person reading these; nothing here decides them.
"""

import argparse
import json
import os
import queue
import shutil
import sys
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
RUNS = os.path.join(ROOT, "experiments", "runs")
LENGTH_REWARD = "experiments/rewards.py:class_chars"


@dataclass
class Claim:
    text: str                       # the claim, as the article makes it
    arms: dict                      # arm name -> train.py flags on top of --config tiny
    metrics: list                   # what the figure and the table show
    common: list = field(default_factory=list)     # flags of every arm


CLAIMS = {
    "c1": Claim("The group z-score must be taken per group: a batch-wide normalisation learns worse.",
                {"grpo": [], "batch": ["--estimator", "batch"]},
                ["charts/reward_mean", "charts/frac_zero_std"]),
    "c2": Claim("With β = 0 the policy drifts into repetition within a few updates; β = 0.01 holds it.",
                {"beta0": ["--beta", "0"], "beta0.01": ["--beta", "0.01"]},
                ["charts/reward_mean", "diversity/distinct_2", "diversity/repeat_4gram", "losses/kl"],
                common=["--max-new-tokens", "24"]),
    "c3": Claim("G from 4 to 8 helps clearly, from 8 to 16 less.",
                {"G4": ["--group-size", "4"], "G8": ["--group-size", "8"], "G16": ["--group-size", "16"]},
                ["charts/reward_mean", "diag/reward_std_mean", "charts/frac_zero_std", "perf/iteration_s"]),
    "c4": Claim("With the same samples per iteration (B·G = 64), a larger G beats more prompts.",
                {"B16xG4": ["--num-prompts", "16", "--group-size", "4"],
                 "B8xG8": ["--num-prompts", "8", "--group-size", "8"],
                 "B4xG16": ["--num-prompts", "4", "--group-size", "16"]},
                ["charts/reward_mean", "eval/reward_mean"]),
    "c5": Claim("GRPO is at least as good as PPO with a critic, steadier, and cheaper in memory.",
                {"grpo": ["--algo", "grpo"], "ppo": ["--algo", "ppo"]},
                ["charts/reward_mean", "eval/reward_mean", "losses/value_loss", "perf/iteration_s"]),
    "c6": Claim("A reward that correlates with length makes answers grow; the length penalty and the "
                "length-stratified advantage curb it.",
                {"plain": [], "penalty0.1": ["--length-penalty", "0.1"],
                 "penalty0.5": ["--length-penalty", "0.5"], "length_strata": ["--length-strata", "2"]},
                ["charts/completion_len", "charts/reward/class_chars", "diag/length_reward_corr"],
                common=["--reward", LENGTH_REWARD, "--max-new-tokens", "24"]),
    "c7": Claim("Too high a learning rate at fixed β fixes a template and shortens answers.",
                {"lr3e-3": ["--lr", "3e-3"], "lr1.2e-2": ["--lr", "1.2e-2"], "lr3e-2": ["--lr", "3e-2"]},
                ["charts/reward_mean", "charts/completion_len", "diversity/distinct_2"],
                common=["--max-new-tokens", "16"]),
}


# Imported once by the fork server, so that no run pays for them again (a tiny run takes about a
# second; these imports take several).
PRELOAD = ["train", "torch.utils.tensorboard", "transformers.models.llama.modeling_llama",
           "transformers.generation.utils"]


def child_run(argv, log_path, usage):
    """One training run in a child of the fork server: train.py's main with its output in log_path;
    puts the child's peak RSS (MiB) into `usage`."""
    import resource

    import train
    from grpo.cli import run_cli

    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = ["train.py", *argv]
    try:
        run_cli(lambda: train.main(argv))
    finally:
        usage.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run_child(argv, log_path):
    """train.main(argv) in a child of a fork server; returns (exit code, seconds, peak RSS in MiB).

    Not os.fork() of this process: after torch has run here (as in the test suite), its thread pools'
    locks can be held at the fork and the child would hang. The fork server is a fresh process that
    has imported PRELOAD and never computed; each run is a fork of it."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    usage = context.Queue()
    start = time.perf_counter()
    child = context.Process(target=child_run, args=(argv, log_path, usage))
    child.start()
    child.join()
    seconds = time.perf_counter() - start
    try:
        rss = usage.get(timeout=10)
    except queue.Empty:                               # the child died before it could say
        rss = float("nan")
    return child.exitcode, seconds, rss


def run_claim(name, seeds, iterations, runs_root=RUNS, results=RESULTS):
    """Every arm × seed of a claim (a finished run is not run again), then its PNG and table."""
    from experiments import plot

    claim = CLAIMS[name]
    os.makedirs(os.path.join(runs_root, name), exist_ok=True)
    stats = {}
    for arm, flags in claim.arms.items():
        for seed in range(seeds):
            run_dir = os.path.join(runs_root, name, f"{arm}_seed{seed}")
            argv = ["--config", "tiny", *claim.common, *flags, "--seed", str(seed), "--iterations",
                    str(iterations), "--eval-every", str(max(iterations // 3, 1)), "--run-dir", run_dir]
            done = os.path.join(run_dir, "experiment.json")
            if os.path.isfile(done) and json.load(open(done))["argv"] == argv:     # this very run, done
                stats[run_dir] = json.load(open(done))
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            code, seconds, rss = run_child(argv, run_dir + ".log")
            if code != 0:
                raise SystemExit(f"{name} {arm} seed {seed}: train.py failed; see {run_dir}.log")
            os.replace(run_dir + ".log", os.path.join(run_dir, "train.log"))
            stats[run_dir] = {"argv": argv, "iterations": iterations, "wall_s": seconds, "peak_rss_mb": rss}
            with open(done, "w") as f:
                json.dump(stats[run_dir], f, indent=1)
            print(f"{name} {arm} seed {seed}: {seconds:.1f} s, peak RSS {rss:.0f} MiB", flush=True)
    run_dirs = list(stats)
    curves = plot.arms(run_dirs, claim.metrics, strict=False)
    os.makedirs(results, exist_ok=True)
    plot.plot(curves, claim.metrics, os.path.join(results, f"{name}.png"),
              title=f"{name.upper()}: {claim.text}" if len(claim.text) < 90 else name.upper())
    table = summary_table(name, claim, run_dirs, stats, seeds, iterations)
    with open(os.path.join(results, f"{name}.md"), "w") as f:
        f.write(table)
    return table


def per_iteration(run_dir, metric):
    """The metric's value at each iteration that has it, from iter_XXXX/metrics.json."""
    values = []
    for entry in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, entry, "metrics.json")
        if entry.startswith("iter_") and os.path.isfile(path):
            value = json.load(open(path)).get(metric)
            if isinstance(value, (int, float)):
                values.append(value)
    return values


def mean_std(values):
    values = np.array(values, dtype=np.float64)
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.3f} ± {std:.3f}"


def summary_table(name, claim, run_dirs, stats, seeds, iterations):
    """The claim's markdown table: per arm, mean ± std over the seeds."""
    from experiments.plot import arm_of

    lines = [f"# {name.upper()}: {claim.text}", "",
             f"`python -m experiments.claims {name} --seeds {seeds} --iterations {iterations}`: "
             f"train.py --config tiny{''.join(' ' + f for f in claim.common)}; "
             f"mean ± std over {seeds} seed(s). "
             f"final = mean of the last 5 iterations, AUC = mean over all {iterations}. Peak RSS is the "
             f"forked run's, which counts pages it shares with the fork server: compare arms "
             f"within a claim, not across claims.", ""]
    logged = [m for m in claim.metrics if not m.startswith("eval/")]
    header = ["arm"] + [f"{m} {k}" for m in logged for k in ("final", "AUC")] + ["wall s", "peak RSS MiB"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm in claim.arms:
        runs = [d for d in run_dirs if arm_of(d) == arm]
        cells = [arm]
        for metric in logged:
            curves = [per_iteration(d, metric) for d in runs]
            if not all(curves):
                cells += ["–", "–"]
                continue
            cells += [mean_std([np.mean(c[-5:]) for c in curves]), mean_std([np.mean(c) for c in curves])]
        cells += [mean_std([stats[d][k] for d in runs]) for k in ("wall_s", "peak_rss_mb")]
        lines.append("| " + " | ".join(cells) + " |")
    evals = [m for m in claim.metrics if m.startswith("eval/")]
    if evals:
        lines += ["", "Held-out (greedy, 12 prompts) at the end, mean ± std over the seeds:", ""]
        for arm in claim.arms:
            runs = [d for d in run_dirs if arm_of(d) == arm]
            finals = [last_logged(d, evals[0]) for d in runs]
            lines.append(f"- {arm}: {evals[0]} {mean_std(finals)}")
    return "\n".join(lines) + "\n"


def last_logged(run_dir, metric):
    """The metric at the end of the run: the last held-out evaluation, read from the event files."""
    from experiments.plot import read_scalars

    values = read_scalars(run_dir, [metric])[metric]
    return values[max(values)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("claim", choices=[*CLAIMS, "all"])
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    p.add_argument("--iterations", type=int, default=30, help="iterations per run (default 30, tiny's)")
    p.add_argument("--smoke", action="store_true",
                   help="2 iterations, 1 seed, in --out (default experiments/smoke: the results stay apart)")
    p.add_argument("--out", default=None, help="one folder for the runs and the results (default: "
                                                "experiments/runs and experiments/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.iterations = 1, 2
        args.out = args.out or os.path.join(ROOT, "experiments", "smoke")
    runs = os.path.join(args.out, "runs") if args.out else RUNS
    results = os.path.join(args.out, "results") if args.out else RESULTS
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    for name in CLAIMS if args.claim == "all" else [args.claim]:
        print(run_claim(name, args.seeds, args.iterations, runs, results))


if __name__ == "__main__":
    main()
