"""The source article's claims about GRPO, each an experiment on the default model, decided by a rule
stated before the runs.

    python -m experiments.claims c3                  # one claim: every arm × 3 seeds, then its PNG and table
    python -m experiments.claims all                 # the ten, in ORDER, then more seeds where unclear
    python -m experiments.claims c3 c9 --seeds 5     # several claims; more seeds
    python -m experiments.claims c3 --jobs 2         # two runs at once, one torch thread each
    python -m experiments.claims c1 --smoke          # --config tiny, 2 iterations, 1 seed (the tests)
    python -m experiments.claims c2 --config gpu --iterations 200 --seeds 5     # the article's scale

Every arm is `train.py` with the default job (SmolLM2-135M-Instruct, two-digit sums, exact-answer
reward, B = 4, G = 8, 24 new tokens, lr 1e-5, β = 0.01) under the claim's flags (CLAIMS), for K = 20
iterations (10 for C8), a greedy held-out evaluation of 48 prompts every 5, a resume point every 5,
seeds 0..S−1. Where the default task cannot show a claim, the claim brings its own prompts
(experiments/data.py) or reward (experiments/rewards.py); its docstring (`doc`) says which.

The rule. Each claim states its tests before any run: a per-run metric (held-out accuracy, or a
named diagnostic), a contrast of arms (a − b, or a difference of differences), and the sign the
article predicts. A test's 95% interval is Welch's over the seeds (experiments/stats.py); it is
"reproduced" when the interval excludes 0 on the predicted side, "refuted" when it excludes 0 on
the other, else "not distinguishable at this scale". The first test is the claim's verdict; the
table writes every test's interval and verdict, computed here, never by hand. More seeds for a test
not distinguishable at 3 are a second look at the same data: experiments/second_look.json states,
before its runs, which tests get how many seeds and the rule that keeps the two looks' error at
0.05; --second-look runs them, and the table reads the pre-stated tests on the first --seeds seeds
and both looks in a section of its own (second_look). --max-seeds, the extra seeds of `all`, is off
by default.

Metrics of a run (METRIC in a test or a table): `acc` the held-out accuracy at the end (exact answer,
greedy, rescored from eval/iter_XXXX.jsonl, so a shaped or noisy training reward does not enter it);
`acc_auc` the area under its curve over iterations 0..K divided by K (trapezoid over the
evaluations); `acc[D]`, `acc_auc[D]` the same on the held-out prompts of difficulty D; `last5(KEY)`,
`mean(KEY)`, `growth(KEY)` of a per-iteration key of iter_XXXX/metrics.json: the mean of the last
5 iterations, of all, and the last 5 minus the first 3; `same_as_ref` the share of held-out answers
identical to the reference's at the end; `peak_rss_gb`; `cpu_s_per_iter`, the CPU seconds of the
attempt that finished the run over the iterations it ran (Run.cpu_s).

Runs and resuming. A run is named by its train.py flags: it lives in RUNS/pool/HASH, and each claim
that uses it links it as RUNS/CLAIM/ARM_seedS (with its log ARM_seedS.log), so an arm shared by
several claims (the default job is in C3, C4, C5, C9 and C10) runs once. A run with experiment.json
is finished and never run again; a run cut short is finished with `train.py --resume` from its last
save; one that never saved starts over. A finished run keeps its iterations' files, eval/ and tb/;
its policy/, checkpoints/ and critic_init/ (1.6 GB a save) are deleted. What its table and figure
read (experiment.json, config.json, iter_XXXX/metrics.json, eval/) is also kept as one JSON line, by
the run's HASH, in RECORDS/CLAIM.jsonl.gz (the claim that first asked for it; about 10 kB a run), which
is committed: a fresh checkout, whose RUNS is empty, takes a finished run from there instead of
running it again, and a reader can recompute every table from it (`zcat RECORDS/c1.jsonl.gz | jq`
reads one; tests/test_experiments.py rebuilds each table from them). experiment.json records the
run's wall and CPU seconds (user + sys of the child, on --threads torch threads, summed over its
attempts; an attempt killed with this process is not counted, so the tables take a run's CPU
seconds at the rate of the attempt that finished it: Run.cpu_s) and peak RSS (the child's, which
counts pages it shares with the fork server: compare arms within a claim). Each claim's results/CLAIM.png and CLAIM.md are written as soon
as its runs are done (--commit commits them, with the runs' records).

Plan, on this 2-core machine when it is quiet: the default job about 12 s an iteration (README), a
held-out evaluation of 48 prompts a few seconds; PPO 1.65× (README), G = 16 about 1.8×, 48 or 64
tokens 1.3–1.8× when answers grow, μ = 4 about 2.5×. Minutes of new runs (wall, if nothing else runs):

| order | claim | new runs (arms × seeds, K iterations) | minutes |
|---|---|---|---|
| 1 | C3 G ∈ {4, 8, 16} (G = 8 is the default job) | 3 × 3, K = 20 | 45 |
| 2 | C9 all-equal groups, dynamic sampling | 1 × 3 (+ C3's), K = 20 | 25 |
| 3 | C4 B·G = 32: 8 × 4, 4 × 8, 2 × 16 | 2 × 3 (+ C3's G8), K = 20 | 27 |
| 4 | C1 unequal difficulty: per group, batch, TRL's batch std | 3 × 3, K = 20 | 40 |
| 5 | C2 β ∈ {0, 0.01, 0.04} at lr 5e-5, 48 tokens | 3 × 3, K = 20 | 50 |
| 6 | C7 lr {1e-5, 5e-5} × β {0.01, 0.04}, 48 tokens | 2 × 3 (+ C2's), K = 20 | 34 |
| 7 | C8 clip fraction: minibatches, μ ∈ {1, 4}, two lrs | 4 × 3, K = 10 | 47 |
| 8 | C5 GRPO vs PPO, the critic's lr swept on seed 0 | 3 + 2 PPO (+ C3's G8), K = 20 | 36 |
| 9 | C10 reward flipped for p ∈ {0, 0.1, 0.2}, GRPO and PPO | 4 × 3 (+ C5's), K = 20 | 69 |
| 10 | C6 a length-correlated reward, 64 tokens | 3 × 3, K = 20 | 69 |
|  | all | 80 runs | about 7.5 h |

Then the second look of experiments/second_look.json, in its order, as the budget allows.
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from experiments import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
RUNS = os.path.join(ROOT, "experiments", "runs")
RECORDS = os.path.join(ROOT, "experiments", "records")     # finished runs' numbers, committed (docstring)
SECOND_LOOK = os.path.join(ROOT, "experiments", "second_look.json")     # the second look's plan
ITERATIONS, EVAL_EVERY, SAVE_EVERY = 20, 5, 5
# Torch threads per run. One: on this 2-core machine shared with other work, two threads spin against
# the other processes' (20 decode steps of the default model, niced under a load of 6–9: 17 s on one
# thread, 75–90 s on two, and 5 × the CPU seconds). --threads 2 on a machine of one's own.
THREADS = 1
LR_HIGH = "5e-5"                    # 5 × the default job's: where drift and templates can show in 20 steps
# --smoke: the tiny model on the sums, small batches and short answers whatever the claim asks.
SMOKE = ["--config", "tiny", "--task", "arithmetic", "--num-prompts", "4"]
SMOKE_LAST = ["--max-new-tokens", "8", "--eval-prompts", "4"]
PPO = ["--algo", "ppo", "{critic}"]     # the critic's settings: the pick of the critic search (SWEEPS)
VERBOSE = "experiments/rewards.py:verbose_judge"


@dataclass
class Test:
    """A pre-stated test: the contrast Σ_k c_k·mean_k(metric) − offset, predicted `direction` 0."""
    text: str                   # the prediction in words
    metric: str                 # a per-run metric (module docstring)
    contrast: dict              # arm -> c_k
    direction: str              # '>' or '<'
    offset: float = 0.0


@dataclass
class Claim:
    text: str                   # the claim, as the article makes it
    doc: str                    # the task, why these arms, what is measured (written atop the table)
    arms: dict                  # arm -> train.py flags on top of the default job and `common`
    tests: list                 # Test; the first is the claim's verdict
    table: list                 # per-run metrics in the table, after acc and acc_auc
    curves: list                # per-iteration keys drawn beside the held-out accuracy
    common: list = field(default_factory=list)
    iterations: int = ITERATIONS
    prompt_set: str = None      # experiments/data.py's set: --prompts and --eval-prompts-file
    by_samples: bool = False    # arms differ in samples per iteration: also draw against samples
    sweep: str = None           # a SWEEPS entry whose pick fills the arms' placeholders
    # The default job's values of what the arms vary, written out under another --config (whose own
    # B or G would otherwise replace them in the arm that leaves them unsaid); left out under the
    # default job, so that its runs keep their names.
    pins: list = field(default_factory=list)
    first_seed: int = 0         # the arms' seeds are first_seed, first_seed + 1, ...

    def seeds(self, n):
        return range(self.first_seed, self.first_seed + n)


@dataclass
class Sweep:
    """Settings chosen by a short pre-stated search: the setting whose runs (seeds 0..seeds − 1) score
    highest on `select`, their mean (a training metric, never the held-out accuracy the claims test);
    `target` (metric, at least) is a bar each setting is reported against, not a selection rule."""
    flags: list                 # under every setting
    settings: dict              # name -> train.py flags; the pick's replace the arms' {NAME} placeholder
    select: str
    seeds: int = 1
    target: tuple = None


# The critic search (issue: a critic that learns). Fixed before its runs: the critic starts from the
# policy's transformer with a zero value head (the only model here; verl and OpenRLHF start it from
# the policy or a reward model); the levers are its lr, its AdamW steps an iteration (--critic-epochs,
# over the whole batch) and a warm-up of K of the 20 iterations in which only the critic trains
# (--critic-warmup). lr1e-3 is the pick of the first search (C5's table before), lr1e-4 its runner-up.
SWEEPS = {
    "critic": Sweep(["--algo", "ppo"],
                    {"lr1e-3": ["--critic-lr", "1e-3"], "lr1e-4": ["--critic-lr", "1e-4"],
                     "lr1e-4_e4": ["--critic-lr", "1e-4", "--critic-epochs", "4"],
                     "lr1e-4_e4_w3": ["--critic-lr", "1e-4", "--critic-epochs", "4", "--critic-warmup", "3"],
                     "lr1e-4_e8_w5": ["--critic-lr", "1e-4", "--critic-epochs", "8", "--critic-warmup", "5"]},
                    "mean(charts/reward_mean)", seeds=2, target=("last10(charts/explained_variance)", 0.2)),
}

ACC = "acc_auc"
UNKNOWN = "unknown"
WITHDRAWN = "withdrawn: its arms did not run on one known machine"
MACHINE_METRICS = ("cpu_s_per_iter", "peak_rss_gb")     # tests of a machine's cost: one machine's runs only
MOST_SEEDS = 1000                # seeds an arm beyond which a table says "over"
CLAIMS = {
    "c1": Claim(
        "The group z-score must be taken per group: a batch-wide normalisation learns worse.",
        "Task: experiments/data.py's mixed_difficulty, one-digit sums (which the model often gets) and "
        "three-digit sums (which it rarely does) half and half, so most batches hold prompts of very "
        "unequal difficulty (sampled, the base model gets 35% of one-digit answers and none of 96 "
        "three-digit ones right), and the held-out set is 24 of each. Arms: per-group z-score (grpo), the "
        "batch's mean and std (--estimator batch), and TRL's per-group mean over the batch's std "
        "(--scale batch). Metric: held-out accuracy AUC over both difficulties; each difficulty's is "
        "in the table. Predicted: per-group above each of the others.",
        {"grpo": [], "batch": ["--estimator", "batch"], "scale_batch": ["--scale", "batch"]},
        [Test("per-group beats batch-wide", ACC, {"grpo": 1, "batch": -1}, ">"),
         Test("per-group beats TRL's batch std", ACC, {"grpo": 1, "scale_batch": -1}, ">")],
        ["acc[one_digit]", "acc[three_digit]", "acc_auc[one_digit]", "acc_auc[three_digit]",
         "mean(charts/frac_zero_std)"],
        ["charts/reward_mean", "charts/frac_zero_std"], prompt_set="mixed_difficulty"),
    "c2": Claim(
        "With β = 0 the policy drifts into repetition within a few updates; β = 0.01 holds it.",
        f"lr {LR_HIGH} (5 × the default) and 48 new tokens, so that drift and repetition have room to "
        "show in 20 updates. β = 0 runs as --beta 1e-9: at β = 0 train.py makes no reference pass and "
        "so logs no KL; 1e-9 × k3 is below float32's resolution of the loss, so the update is β = 0's. "
        "Metrics: KL to the reference (k3 per token, the last 5 iterations), distinct-2 of the batch's "
        "completions and their repeated 4-grams. Predicted: β = 0 further from the reference and less "
        "diverse than β = 0.01; β = 0.04 nearer than 0.01.",
        {"beta0": ["--beta", "1e-9"], "beta0.01": [], "beta0.04": ["--beta", "0.04"]},
        [Test("β = 0 drifts further than β = 0.01", "last5(losses/kl)", {"beta0": 1, "beta0.01": -1}, ">"),
         Test("β = 0 is less diverse than β = 0.01", "last5(diversity/distinct_2)",
              {"beta0": 1, "beta0.01": -1}, "<"),
         Test("β = 0 repeats more than β = 0.01", "last5(diversity/repeat_4gram)",
              {"beta0": 1, "beta0.01": -1}, ">"),
         Test("β = 0.04 stays nearer than β = 0.01", "last5(losses/kl)", {"beta0.04": 1, "beta0.01": -1}, "<")],
        ["last5(losses/kl)", "last5(diversity/distinct_2)", "last5(diversity/repeat_4gram)",
         "last5(charts/completion_len)", "same_as_ref"],
        ["losses/kl", "diversity/distinct_2", "diversity/repeat_4gram", "charts/completion_len"],
        common=["--lr", LR_HIGH, "--max-new-tokens", "48"]),
    "c3": Claim(
        "G from 4 to 8 helps clearly, from 8 to 16 less.",
        "The default job with G ∈ {4, 8, 16} at B = 4 (so a larger G also means more samples per "
        "iteration; C4 holds them fixed). Metric: held-out accuracy AUC. Predicted: G = 8 above G = 4, "
        "and the gain from 8 to 16 below the gain from 4 to 8 (G16 − 2·G8 + G4 < 0). frac_zero_std, "
        "the share of all-equal groups, is the mechanism and is in the table.",
        {"G4": ["--group-size", "4"], "G8": [], "G16": ["--group-size", "16"]},
        [Test("G 4 → 8 helps", ACC, {"G8": 1, "G4": -1}, ">"),
         Test("8 → 16 helps less than 4 → 8", ACC, {"G16": 1, "G8": -2, "G4": 1}, "<")],
        ["mean(charts/frac_zero_std)", "mean(charts/reward_mean)", "cpu_s_per_iter"],
        ["charts/reward_mean", "charts/frac_zero_std"], by_samples=True, pins=["--group-size", "8"]),
    "c4": Claim(
        "With the same samples per iteration, a larger G beats more prompts.",
        "The default job at B·G = 32: 8 prompts × G = 4, 4 × 8 (the default), 2 × 16. Metric: held-out "
        "accuracy AUC. Predicted: 2 × 16 above 8 × 4, and 4 × 8 above 8 × 4.",
        {"B8xG4": ["--num-prompts", "8", "--group-size", "4"], "B4xG8": [],
         "B2xG16": ["--num-prompts", "2", "--group-size", "16"]},
        [Test("2 × 16 beats 8 × 4", ACC, {"B2xG16": 1, "B8xG4": -1}, ">"),
         Test("4 × 8 beats 8 × 4", ACC, {"B4xG8": 1, "B8xG4": -1}, ">")],
        ["mean(charts/frac_zero_std)", "mean(charts/reward_mean)"],
        ["charts/reward_mean", "charts/frac_zero_std"], pins=["--num-prompts", "4", "--group-size", "8"]),
    "c5": Claim(
        "GRPO is at least as good as PPO with a critic, steadier, and cheaper in memory.",
        "The default job, GRPO against PPO (--algo ppo: a critic initialised from the policy's own "
        "weights with a zero value head, GAE γ = 1, λ = 0.95). The critic's settings are chosen "
        "first by a pre-stated search on seeds 0 and 1 (its lr, its steps an iteration, a warm-up of "
        "the critic alone; SWEEPS['critic']) by the PPO runs' mean training reward, and reported against "
        "a target of explained variance 0.2 over the last 10 iterations (the search's table below). The "
        "arms run seeds 3 on, so that no run that chose the critic's setting is one of the test's, and both arms "
        "run on one commit and machine (the runs' records say which). Metric: held-out accuracy AUC; predicted GRPO "
        "above PPO (a result not distinguishable is what 'at least as good' allows, but does not "
        "show). Peak RSS and CPU seconds per iteration are tests of 'cheaper'; 'steadier' is read "
        "from the spread over seeds in the table, not tested.",
        {"grpo": [], "ppo": PPO},
        [Test("GRPO learns at least as well as PPO", ACC, {"grpo": 1, "ppo": -1}, ">"),
         Test("GRPO needs less memory", "peak_rss_gb", {"grpo": 1, "ppo": -1}, "<"),
         Test("GRPO needs less CPU per iteration", "cpu_s_per_iter", {"grpo": 1, "ppo": -1}, "<")],
        ["mean(charts/reward_mean)", "last10(charts/explained_variance)", "cpu_s_per_iter"],
        ["charts/reward_mean", "losses/value_loss", "charts/explained_variance"], sweep="critic",
        first_seed=3),
    "c6": Claim(
        "A reward that correlates with length makes answers grow; the length penalty and the "
        "length-stratified advantage curb it.",
        "Reward: experiments/rewards.py's verbose_judge, the exact answer plus 0.01 per completion "
        "token up to 0.4 (40 tokens), with 64 new tokens allowed, about 3 times the model's starting "
        "length (about 20 tokens). In a group whose answers are all wrong, the z-score makes the "
        "small length bonus the whole advantage. Arms: plain, --length-penalty 0.32 (−0.32·|o|/64: "
        "half the judge's bonus per token), --length-strata 2. Metric: completion length (the last 5 iterations). Predicted: "
        "plain grows (last 5 − first 3 > 0), the penalty and the strata end shorter than plain.",
        {"plain": [], "penalty": ["--length-penalty", "0.32"], "strata": ["--length-strata", "2"]},
        [Test("answers grow under the plain reward", "growth(charts/completion_len)", {"plain": 1}, ">"),
         Test("the length penalty curbs it", "last5(charts/completion_len)", {"penalty": 1, "plain": -1}, "<"),
         Test("length strata curb it", "last5(charts/completion_len)", {"strata": 1, "plain": -1}, "<")],
        ["last5(charts/completion_len)", "growth(charts/completion_len)", "last5(charts/truncated_frac)",
         "mean(diag/length_reward_corr)"],
        ["charts/completion_len", "diag/length_reward_corr", "charts/truncated_frac"],
        common=["--reward", VERBOSE, "--max-new-tokens", "64"]),
    "c7": Claim(
        "Too high a learning rate at fixed β fixes a template and shortens answers; lr and β are coupled.",
        f"lr ∈ {{1e-5, {LR_HIGH}}} × β ∈ {{0.01, 0.04}}, 48 new tokens (the high-lr arms are C2's). "
        "Metrics: distinct-2 of the batch's completions and the completion length (the last 5 "
        "iterations). Predicted: at β = 0.01 the high lr is less diverse and shorter; and the coupling: "
        "raising β restores more diversity at the high lr than at the low one.",
        {"lr1e-5_beta0.01": [], "lr1e-5_beta0.04": ["--beta", "0.04"], f"lr{LR_HIGH}_beta0.01": ["--lr", LR_HIGH],
         f"lr{LR_HIGH}_beta0.04": ["--lr", LR_HIGH, "--beta", "0.04"]},
        [Test("a high lr fixes a template", "last5(diversity/distinct_2)",
              {f"lr{LR_HIGH}_beta0.01": 1, "lr1e-5_beta0.01": -1}, "<"),
         Test("a high lr shortens answers", "last5(charts/completion_len)",
              {f"lr{LR_HIGH}_beta0.01": 1, "lr1e-5_beta0.01": -1}, "<"),
         Test("β restores more diversity at the high lr (coupling)", "last5(diversity/distinct_2)",
              {f"lr{LR_HIGH}_beta0.04": 1, f"lr{LR_HIGH}_beta0.01": -1, "lr1e-5_beta0.04": -1,
               "lr1e-5_beta0.01": 1}, ">")],
        ["last5(diversity/distinct_2)", "last5(charts/completion_len)", "last5(losses/kl)",
         "last5(diversity/first_line_share)"],
        ["diversity/distinct_2", "charts/completion_len", "losses/kl"], common=["--max-new-tokens", "48"]),
    "c8": Claim(
        "The clip is a fuse that normal training rarely touches.",
        "The default job with minibatches of 8 completions (4 AdamW steps per pass over the 32), μ = 1 "
        "or 4 passes, at lr 1e-5 or 5e-5; 10 iterations (clip_frac is read every step, and the "
        "held-out accuracy is not the point). Metric: losses/clip_frac, the share of completion tokens "
        "whose objective was clipped, averaged over the run. Predicted: below 2% in normal training "
        "(μ = 1, lr 1e-5); higher with μ = 4; higher at the high lr. Beside it, not a test: "
        "losses/clip_frac_signal, the same share over the tokens that can clip (rows with a nonzero "
        "advantage, in each update's steps after its first, whose ratio is 1).",
        {"mu1_lr1e-5": ["--minibatch-size", "8"], "mu4_lr1e-5": ["--minibatch-size", "8", "--epochs", "4"],
         f"mu1_lr{LR_HIGH}": ["--minibatch-size", "8", "--lr", LR_HIGH],
         f"mu4_lr{LR_HIGH}": ["--minibatch-size", "8", "--epochs", "4", "--lr", LR_HIGH]},
        [Test("normal training clips under 2% of tokens", "mean(losses/clip_frac)", {"mu1_lr1e-5": 1}, "<",
              offset=0.02),
         Test("μ = 4 clips more than μ = 1", "mean(losses/clip_frac)", {"mu4_lr1e-5": 1, "mu1_lr1e-5": -1}, ">"),
         Test("a high lr clips more (μ = 4)", "mean(losses/clip_frac)",
              {f"mu4_lr{LR_HIGH}": 1, "mu4_lr1e-5": -1}, ">")],
        ["mean(losses/clip_frac)", "mean(losses/clip_frac_signal)", "mean(losses/ratio_max)", "mean(losses/kl)"],
        ["losses/clip_frac", "losses/clip_frac_signal", "losses/ratio_max"], iterations=10),
    "c9": Claim(
        "All-equal groups carry no signal; a larger G, or dynamic sampling, is the remedy.",
        "The default job (exact-answer reward: binary, so many groups are all wrong) with G ∈ {4, 8, 16} "
        "(C3's runs) and G = 8 with --dynamic-sampling (DAPO: up to 3 sampling rounds refill the batch "
        "with groups that have spread). Metrics: frac_zero_std (the share of all-equal groups) over "
        "the run, and held-out accuracy AUC. Predicted: fewer all-equal groups at G = 16 than at 4; "
        "dynamic sampling learns more than plain G = 8.",
        {"G4": ["--group-size", "4"], "G8": [], "G16": ["--group-size", "16"],
         "G8_dynamic": ["--dynamic-sampling"]},
        [Test("larger G leaves fewer all-equal groups", "mean(charts/frac_zero_std)", {"G16": 1, "G4": -1}, "<"),
         Test("dynamic sampling learns more", ACC, {"G8_dynamic": 1, "G8": -1}, ">")],
        ["mean(charts/frac_zero_std)", "mean(charts/sample_rounds)", "mean(charts/reward_mean)", "cpu_s_per_iter"],
        ["charts/frac_zero_std", "charts/reward_mean"], by_samples=True, pins=["--group-size", "8"]),
    "c10": Claim(
        "GRPO needs a cleaner reward than PPO: noise enters the group ranking directly.",
        "The default job with each row's exact-answer reward flipped (1 ↔ 0) with probability p "
        "(experiments/rewards.py: flip_10, flip_20; p = 0 is the plain reward), GRPO and PPO (the "
        "critic settings of C5's search). Held-out accuracy is rescored without noise from the saved answers. "
        "Metric: held-out accuracy AUC. Predicted: the noise costs GRPO more than PPO, "
        "(GRPO_0 − GRPO_p) − (PPO_0 − PPO_p) > 0, at p = 0.2 (the verdict) and 0.1.",
        {"grpo_p0": [], "grpo_p0.1": ["--reward", "experiments/rewards.py:flip_10"],
         "grpo_p0.2": ["--reward", "experiments/rewards.py:flip_20"], "ppo_p0": PPO,
         "ppo_p0.1": [*PPO, "--reward", "experiments/rewards.py:flip_10"],
         "ppo_p0.2": [*PPO, "--reward", "experiments/rewards.py:flip_20"]},
        [Test("noise p = 0.2 costs GRPO more than PPO", ACC,
              {"grpo_p0": 1, "grpo_p0.2": -1, "ppo_p0": -1, "ppo_p0.2": 1}, ">"),
         Test("noise p = 0.1 costs GRPO more than PPO", ACC,
              {"grpo_p0": 1, "grpo_p0.1": -1, "ppo_p0": -1, "ppo_p0.1": 1}, ">"),
         Test("noise p = 0.2 costs GRPO", ACC, {"grpo_p0": 1, "grpo_p0.2": -1}, ">")],
        ["mean(charts/reward_mean)", "mean(charts/frac_zero_std)", "last10(charts/explained_variance)"],
        ["charts/reward_mean"], sweep="critic"),
}
# Cheapest and most informative first; C3 makes the default job's runs that C4, C5, C9 and C10 share.
ORDER = ["c3", "c9", "c4", "c1", "c2", "c7", "c8", "c5", "c10", "c6"]


# --- running train.py --------------------------------------------------------------------------

# Imported once by the fork server, so that no run pays for them again (a tiny run takes about a
# second; these imports take several).
PRELOAD = ["train", "torch.utils.tensorboard", "transformers.models.llama.modeling_llama",
           "transformers.generation.utils"]


class RunFailed(Exception):
    pass


KEEPING = threading.Lock()   # held while a thread of --jobs writes a records file
RUNNING = set()         # the children of run_child now running (several with --jobs)
STOPPING = []           # non-empty once SIGTERM came: the children are stopped, their attempts not counted


def stop(*_):
    """SIGTERM: stop every run this process waits for (forks of the fork server, which would outlive
    it), then exit; with --jobs the other threads wake from their child's end."""
    STOPPING.append(True)
    for child in list(RUNNING):
        child.terminate()
    sys.exit(143)


def child_run(argv, log_path, usage, threads):
    """One training run in a child of the fork server, on `threads` torch threads: train.py's main with
    its output appended to log_path; puts the child's (peak RSS in MiB, CPU seconds) into `usage`."""
    import resource

    import torch
    import train
    from grpo.cli import run_cli

    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    print(f"$ python train.py {' '.join(argv)}  # {threads} torch thread(s)", flush=True)
    torch.set_num_threads(threads)
    sys.argv = ["train.py", *argv]
    try:
        run_cli(lambda: train.main(argv))
    finally:
        me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        usage.put((me.ru_maxrss / 1024, me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime))


def run_child(argv, log_path, pid_path, threads=THREADS):
    """train.main(argv) in a child of a fork server; returns (exit code, wall s, CPU s, peak RSS MiB).

    Not os.fork() of this process: after torch has run here (as in the test suite), its thread pools'
    locks can be held at the fork and the child would hang. The fork server is a fresh process that
    has imported PRELOAD and never computed; each run is a fork of it."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    usage = context.Queue()
    start = time.perf_counter()
    child = context.Process(target=child_run, args=(argv, log_path, usage, threads))
    child.start()
    RUNNING.add(child)
    with open(pid_path, "w") as f:
        f.write(str(child.pid))
    try:
        child.join()
    finally:
        if child.is_alive():                          # this process was interrupted: stop the run too
            child.terminate()
            child.join()
        RUNNING.discard(child)
        os.remove(pid_path)
    if STOPPING:                                      # killed with this process: not an attempt
        raise RunFailed(f"{argv}: stopped")
    seconds = time.perf_counter() - start
    try:
        rss, cpu = usage.get(timeout=10)
    except queue.Empty:                               # the child died before it could say
        rss, cpu = float("nan"), float("nan")
    return child.exitcode, seconds, cpu, rss


def canonical(argv):
    """train.py flags in one order (by flag name; a flag given twice keeps its last values, as
    train.py's parser does), so that two claims asking for the same run name the same one."""
    flags, current = {}, None
    for token in argv:
        if token.startswith("--"):
            current = token
            flags[current] = []
        else:
            flags[current].append(token)
    return [x for flag in sorted(flags) for x in (flag, *flags[flag])]


def run_key(argv):
    """The name of a run: the hash of its canonical flags."""
    return hashlib.sha256(json.dumps(canonical(argv)).encode()).hexdigest()[:12]


def is_stale(record):
    """Whether a run on record ran code whose numbers have since changed: the first commit that held its
    record precedes the drift fix of dd87ca3 (a step with no signal moved the policy through the KL term;
    on_record_since, established from git history), and no attempt names the commit that made it. Such a
    run is run again on today's code when a claim asks for it (not with --as-recorded), and its record
    replaced; its new record names its commit, so once."""
    since = record["experiment"].get("on_record_since") or {}
    return bool(since.get("before_drift_fix")) and Run(record).made_by()[0].startswith(UNKNOWN)


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def link(target, name):
    """`name` -> `target` as a relative symlink (replacing a link to elsewhere)."""
    os.makedirs(os.path.dirname(name), exist_ok=True)
    relative = os.path.relpath(target, os.path.dirname(name))
    if os.path.islink(name) and os.readlink(name) != relative:
        os.remove(name)
    if not os.path.lexists(name):
        os.symlink(relative, name)


def read_run(run_dir, key):
    """What a finished run's table and figure read, as one record: its experiment.json, config.json,
    iter_XXXX/metrics.json (by iteration) and eval/iter_XXXX.jsonl rows (by step)."""
    metrics, evals = {}, {}
    for entry in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, entry, "metrics.json")
        if entry.startswith("iter_") and os.path.isfile(path):
            metrics[str(int(entry[5:]))] = json.load(open(path))
    for entry in sorted(os.listdir(os.path.join(run_dir, "eval"))):
        with open(os.path.join(run_dir, "eval", entry)) as f:
            evals[str(int(entry[5:9]))] = [json.loads(line) for line in f if line.strip()]
    return {"key": key, "experiment": json.load(open(os.path.join(run_dir, "experiment.json"))),
            "config": json.load(open(os.path.join(run_dir, "config.json"))), "metrics": metrics, "evals": evals}


def find_record(records, key):
    """The record of run `key` in any claim's file of `records` (RECORDS/CLAIM.jsonl.gz), or None."""
    start = json.dumps({"key": key})[:-1] + ","          # each line starts with its key
    for path in sorted(glob.glob(os.path.join(records, "*.jsonl.gz"))):
        with gzip.open(path, "rt") as f:
            for line in f:
                if line.startswith(start):
                    return json.loads(line)
    return None


def keep(record, records, claim):
    """Add a finished run's record to records/CLAIM.jsonl.gz, the file of the claim that first asked for
    it, and drop an earlier record of the same run (a STALE one rerun) from every other claim's file:
    one JSON line a run, sorted by key, gzip without a time stamp, so that the file's bytes depend on
    its runs alone."""
    own = os.path.join(records, f"{claim}.jsonl.gz")
    with KEEPING:                                     # --jobs: one thread writes a file at a time
        for path in sorted({own, *glob.glob(os.path.join(records, "*.jsonl.gz"))}):
            lines = {}
            if os.path.isfile(path):
                with gzip.open(path, "rt") as f:
                    lines = {json.loads(line)["key"]: line for line in f}
            if path != own and record["key"] not in lines:
                continue
            lines.pop(record["key"], None)
            if path == own:
                lines[record["key"]] = json.dumps(record) + "\n"
            os.makedirs(records, exist_ok=True)
            with open(path + ".tmp", "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:
                f.write("".join(lines[key] for key in sorted(lines)).encode())
            os.replace(path + ".tmp", path)


def code_and_machine(threads):
    """What makes an attempt: the commit of this checkout and whether its tree was clean (tracked
    files, less the records and tables the runner writes; the runs' folders are ignored), the CPU (model name, family/model numbers, which tell
    processors of one name apart) and its cores, the versions that change numbers, torch threads."""
    import platform

    import torch
    import transformers

    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    cpu = {}
    if os.path.isfile("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            cpu.setdefault(key.strip(), value.strip())
    # What the runner itself writes as it goes (records, tables) does not make the code's tree unclean.
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/records",
                 ":!experiments/results")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "clean": None if status is None else status == "",
            "cpu": cpu.get("model name") or platform.processor() or "unknown",
            "cpu_family_model": f"{cpu['cpu family']}/{cpu['model']}" if "cpu family" in cpu else "unknown",
            "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": threads}


def ensure_run(argv, runs_root, name, label, threads=THREADS, records=None, rerun_stale=True):
    """The record (read_run) of the finished run of `argv` (train.py flags, no --run-dir): found in
    `records` (what is on record is never run again, nor read from anywhere else), finished in
    RUNS/pool, finished with --resume, or run; a run here is linked as RUNS/`name`, and its record
    kept in `records` (keep). Raises RunFailed."""
    if STOPPING:                                      # SIGTERM came: start no other run
        raise RunFailed(f"{label}: stopped")
    argv = canonical(argv)
    key = run_key(argv)
    run_dir = os.path.join(runs_root, "pool", key)
    log, pid, attempts_path = run_dir + ".log", run_dir + ".pid", run_dir + ".attempts.json"
    done = os.path.join(run_dir, "experiment.json")
    found = find_record(records, key) if records else None
    if found and rerun_stale and is_stale(found):
        found = None
        shutil.rmtree(run_dir, ignore_errors=True)    # a finished folder of the same stale run
    if found or os.path.isfile(done):
        if os.path.isdir(run_dir):                    # run in this checkout: named for this claim too
            link(run_dir, os.path.join(runs_root, name))
            link(log, os.path.join(runs_root, name + ".log"))
        return found or finished(run_dir, key, records)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    link(run_dir, os.path.join(runs_root, name))
    link(log, os.path.join(runs_root, name + ".log"))
    if os.path.isfile(pid):
        other = int(open(pid).read() or 0)
        try:
            os.kill(other, 0)
        except ProcessLookupError:
            os.remove(pid)                            # left by a process that no longer exists
        else:
            raise RunFailed(f"{label}: {run_dir} is being run by process {other}; wait for it or stop it")
    attempts = json.load(open(attempts_path)) if os.path.isfile(attempts_path) else []
    state = os.path.join(run_dir, "policy", "train_state.json")
    if os.path.isfile(state) and os.path.isfile(os.path.join(run_dir, "config.json")):
        resumed_from = json.load(open(state))["iteration"]
        kept = [x for f in ("--iterations", "--eval-every", "--save-every") for x in (f, flag_value(argv, f))]
        train_argv = ["--run-dir", run_dir, "--resume", *kept]
        print(f"{label}: resuming after iteration {resumed_from} ({run_dir})", flush=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        resumed_from, train_argv = 0, [*argv, "--run-dir", run_dir]
        print(f"{label}: running ({run_dir})", flush=True)
    made_by = code_and_machine(threads)
    code, wall, cpu, rss = run_child(train_argv, log, pid, threads)
    attempts.append({"from_iteration": resumed_from, "exit_code": code, "wall_s": wall, "cpu_s": cpu,
                     "peak_rss_mb": rss, "threads": threads, "made_by": made_by})
    with open(attempts_path, "w") as f:
        json.dump(attempts, f, indent=1)
    if code != 0:
        raise RunFailed(f"{label}: train.py failed (exit code {code}); see {log}")
    for folder in ("policy", "checkpoints", "critic_init"):
        shutil.rmtree(os.path.join(run_dir, folder), ignore_errors=True)
    record = {"argv": argv, "first_asked_by": label, "iterations": int(flag_value(argv, "--iterations")),
              "wall_s": sum(a["wall_s"] for a in attempts), "cpu_s": sum(a["cpu_s"] for a in attempts),
              "peak_rss_mb": max(a["peak_rss_mb"] for a in attempts), "attempts": attempts}
    with open(done, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{label}: done in {wall / 60:.1f} min (CPU {cpu / 60:.1f} min), peak RSS {rss / 1024:.2f} GiB",
          flush=True)
    return finished(run_dir, key, records)


def finished(run_dir, key, records):
    """The record of a run finished in run_dir, kept in `records` (when given) in the file of the claim
    that first asked for the run."""
    record = read_run(run_dir, key)
    if records:
        keep(record, records, record["experiment"]["first_asked_by"].split()[0])
    return record


# --- one claim ---------------------------------------------------------------------------------

@dataclass
class Setup:
    """What every run of an invocation shares."""
    runs_root: str
    results: str
    records: str                # finished runs' numbers, kept across checkouts (RECORDS)
    base: list                  # train.py flags under every arm: [] (the default job), or SMOKE
    last: list = field(default_factory=list)      # flags over every arm's: SMOKE_LAST
    iterations: int = None      # overrides each claim's K (--smoke, --iterations)
    eval_every: int = EVAL_EVERY
    save_every: int = SAVE_EVERY
    threads: int = THREADS
    jobs: int = 1               # runs of a claim at once (--jobs)
    rerun_stale: bool = True    # run again the records that is_stale finds (off: --as-recorded)

    def argv(self, claim, flags, seed):
        data = []
        if claim.prompt_set:
            from experiments import data as prompt_sets

            train, held_out = prompt_sets.write_prompt_set(claim.prompt_set, os.path.join(self.runs_root, "data"))
            data = ["--prompts", relative(train), "--eval-prompts-file", relative(held_out)]
        pins = claim.pins if self.base else []
        iterations = self.iterations or claim.iterations
        if "--critic-warmup" in flags:     # a short run (--smoke) leaves the policy its last iteration
            at = flags.index("--critic-warmup") + 1
            flags = [*flags[:at], str(min(int(flags[at]), iterations - 1)), *flags[at + 1:]]
        return canonical([*self.base, *pins, *data, *claim.common, *flags, *self.last, "--seed", str(seed),
                          "--iterations", str(iterations), "--eval-every",
                          str(self.eval_every), "--save-every", str(self.save_every)])


def relative(path):
    """A path under the repository as the runs name it (relative to it); any other as it is."""
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def run_all(setup, jobs):
    """{job: record} of ensure_run for each job (argv, name, label), --jobs of them at once, each its
    own child; raises the first failure once all have ended."""
    pool = ThreadPoolExecutor(setup.jobs)
    futures = {job: pool.submit(ensure_run, argv, setup.runs_root, name, label, setup.threads, setup.records,
                                setup.rerun_stale)
               for job, (argv, name, label) in jobs.items()}
    while not all(future.done() for future in futures.values()):
        time.sleep(1)           # not a join, which would keep SIGTERM's handler (main thread only) from running
    pool.shutdown()
    return {job: future.result() for job, future in futures.items()}


def resolve(claim, name, setup):
    """The claim's arms with the sweep's pick in place of its placeholder (running the sweep first);
    returns (arms, (sweep, {setting: [Run per seed]}, pick) or None)."""
    if not claim.sweep:
        return dict(claim.arms), None
    sweep = SWEEPS[claim.sweep]
    jobs = [(setting, seed) for seed in range(sweep.seeds) for setting in sweep.settings]
    records = run_all(setup, {(setting, seed): (setup.argv(claim, [*sweep.flags, *sweep.settings[setting]], seed),
                                                f"sweep_{claim.sweep}/{setting}_seed{seed}",
                                                f"{name} sweep {claim.sweep}={setting} seed {seed}")
                              for setting, seed in jobs})
    runs = {setting: [Run(records[(setting, seed)]) for seed in range(sweep.seeds)] for setting in sweep.settings}
    pick = max(runs, key=lambda setting: np.mean([r.metric(sweep.select) for r in runs[setting]]))
    placeholder = "{" + claim.sweep + "}"
    arms = {arm: [x for f in flags for x in (sweep.settings[pick] if f == placeholder else [f])]
            for arm, flags in claim.arms.items()}
    return arms, (sweep, runs, pick)


def run_arms(name, claim, arms, jobs, setup):
    """{(arm, seed): Run} of the claim's finished runs of `jobs` (arm, seed), run where not on record."""
    records = run_all(setup, {(arm, seed): (setup.argv(claim, arms[arm], seed), f"{name}/{arm}_seed{seed}",
                                            f"{name} {arm} seed {seed}") for arm, seed in jobs})
    return {job: Run(record) for job, record in records.items()}


def run_claim(name, seeds, setup, arm_seeds=None, commit=False):
    """Every arm × seed of a claim (finished runs are not run again), then its PNG and table; returns
    the table. `arm_seeds` ({arm: seeds}) asks some arms for more seeds than `seeds`."""
    claim = CLAIMS[name]
    arms, sweep = resolve(claim, name, setup)
    arm_seeds = {arm: max(seeds, (arm_seeds or {}).get(arm, 0)) for arm in arms}
    jobs = [(arm, seed) for seed in claim.seeds(max(arm_seeds.values()))     # seed-major: every arm's first seed first
            for arm in arms if seed in claim.seeds(arm_seeds[arm])]
    done = run_arms(name, claim, arms, jobs, setup)
    runs = {arm: [done[(arm, s)] for s in claim.seeds(arm_seeds[arm])] for arm in arms}
    os.makedirs(setup.results, exist_ok=True)
    figure(name, claim, runs, os.path.join(setup.results, f"{name}.png"))
    plan = json.load(open(SECOND_LOOK))
    table = summary_table(name, claim, arms, runs, sweep, setup, first=seeds, plan=plan)
    with open(os.path.join(setup.results, f"{name}.md"), "w") as f:
        f.write(table)
    if commit:                  # the table, the figure and every finished run's record so far
        paths = [os.path.relpath(os.path.join(setup.results, f"{name}.{ext}"), ROOT) for ext in ("md", "png")]
        paths.append(os.path.relpath(setup.records, ROOT))
        subprocess.run(["git", "add", *paths], cwd=ROOT, check=False)
        subprocess.run(["git", "commit", "-q", "-m", f"experiments/results: {name} on the default model "
                        f"({min(arm_seeds.values())}+ seeds per arm), with its runs' records",
                        "--", *paths], cwd=ROOT, check=False)
    return table


# --- a run's numbers ---------------------------------------------------------------------------

class Run:
    """A finished run's iteration metrics, held-out answers and experiment.json, from its record."""

    def __init__(self, record):
        self.key, self.record = record["key"], record["experiment"]
        self.config = record["config"]["config"]
        self.iters = {int(i): m for i, m in record["metrics"].items()}
        self.evals = {int(step): rows for step, rows in record["evals"].items()}

    def series(self, key):
        """{iteration: value} of a per-iteration key, or of the held-out accuracy: `acc` or `acc[D]`."""
        match = re.fullmatch(r"acc(?:\[(\w+)\])?", key)
        if match:
            return {step: accuracy(rows, match.group(1)) for step, rows in self.evals.items()}
        return {i: m[key] for i, m in self.iters.items() if isinstance(m.get(key), (int, float))}

    def cpu_s(self):
        """CPU seconds of the whole run, at the rate of the attempt that finished it: its CPU seconds
        over the iterations it ran, times the run's iterations, plus any failed attempt's. An attempt
        cut short with the process running it (a session's end) records nothing, so the attempts'
        plain sum would count a resumed run's last iterations alone. A record without attempts, or
        whose finishing attempt ran no iteration (its run had saved its last one), gives that sum."""
        attempts, iterations = self.record.get("attempts"), self.record["iterations"]
        if not attempts or attempts[-1]["from_iteration"] >= iterations:
            return self.record["cpu_s"]
        last, failed = attempts[-1], sum(a["cpu_s"] for a in attempts[:-1] if a["exit_code"] != 0)
        return last["cpu_s"] / (iterations - last["from_iteration"]) * iterations + failed

    def made_by(self):
        """(code, machine) of the attempt that finished the run: its commit (7 digits, "+" where the tree
        had uncommitted changes) and CPU (model, family/model, cores); UNKNOWN where its record predates
        code_and_machine, with the commit that first held the record where known (on_record_since)."""
        attempts = self.record.get("attempts") or [{}]
        made = attempts[-1].get("made_by") or {}
        if made.get("commit", UNKNOWN) == UNKNOWN:
            since = self.record.get("on_record_since")
            code = UNKNOWN if not since else (f"{UNKNOWN}, on record at {since['commit'][:7]}"
                                              + (", before the drift fix" if since.get("before_drift_fix") else ""))
            return code, UNKNOWN
        code = made["commit"][:7] + ("" if made.get("clean") else "+")
        return code, f"{made['cpu']} {made['cpu_family_model']}, {made['cores']} cores"

    def resumed_from(self):
        """The iteration the finishing attempt resumed after (0: it ran the whole run)."""
        attempts = self.record.get("attempts") or [{}]
        return attempts[-1].get("from_iteration", 0)

    def metric(self, name):
        """One number of the run (module docstring); NaN where the run has none."""
        match = re.fullmatch(r"(acc)(_auc)?(\[\w+\])?", name)
        if match:
            curve = self.series("acc" + (match.group(3) or ""))
            steps = sorted(curve)
            if match.group(2) is None:
                return curve[steps[-1]]
            x, y = np.array(steps, dtype=np.float64), np.array([curve[s] for s in steps])
            return float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)) / (x[-1] - x[0])) if len(x) > 1 else y[0]
        match = re.fullmatch(r"(last5|last10|mean|growth)\((.+)\)", name)
        if match:
            values = [v for _, v in sorted(self.series(match.group(2)).items())]
            if not values:
                return float("nan")
            return {"last5": lambda: np.mean(values[-5:]), "last10": lambda: np.mean(values[-10:]),
                    "mean": lambda: np.mean(values),
                    "growth": lambda: np.mean(values[-5:]) - np.mean(values[:3])}[match.group(1)]()
        if name == "same_as_ref":
            rows = self.evals[max(self.evals)]
            return sum(r["completion"] == r["ref_completion"] for r in rows) / len(rows)
        if name == "peak_rss_gb":
            return self.record["peak_rss_mb"] / 1024
        if name == "cpu_s_per_iter":
            return self.cpu_s() / self.record["iterations"]
        raise ValueError(f"unknown run metric {name!r}")

    def samples_seen(self):
        """{iteration: completions sampled before it}: B·G per sampling round."""
        per_round = self.config["num_prompts"] * self.config["group_size"]
        seen, total = {0: 0}, 0
        for i in sorted(self.iters):
            total += per_round * self.iters[i].get("charts/sample_rounds", 1)
            seen[i + 1] = total
        return seen


def accuracy(rows, difficulty=None):
    """Exact-answer accuracy of held-out rows (optionally those of one difficulty)."""
    from grpo.rewards.tasks import exact_answer

    rows = [r for r in rows if difficulty is None or r.get("difficulty") == difficulty]
    return float(np.mean(exact_answer(None, [r["completion"] for r in rows], [r["answer"] for r in rows])))


# --- the decision, the table and the figure ----------------------------------------------------

def decide(test, values, level=0.95):
    """(estimate, low, high, df, verdict) of a test; values: {arm: [per-seed metric]}."""
    est, low, high, df = stats.welch_interval(values, test.contrast, test.offset, level)
    return est, low, high, df, stats.verdict(low, high, test.direction)


def second_look(name, claim, runs, first, plan):
    """The lines of the planned second look (experiments/second_look.json) of the claim's tests whose
    arms now have more than the `first` look's seeds: each test read on the first seeds and on all,
    both at the plan's level, the verdict (the first look's where it decides, else the combined
    one's), and Holm over the claim's tests at the same α, on each test's last look. [] without one."""
    planned = plan["tests"].get(name, {}).get("tests", [])
    looked = [i for i in planned if any(len(runs[arm]) > first for arm in claim.tests[i].contrast)]
    if not looked:
        return []
    alpha = plan["rule"]["alpha_per_look"]
    level = 1 - alpha
    lines = ["", "## The second look (experiments/second_look.json, stated before its runs)", "",
             f"| test | first look: seeds 0–{first - 1}, {level:.1%} interval | verdict | combined: every seed, "
             f"{level:.1%} interval | verdict | the test's verdict | family-wise (Holm, α = {alpha:g}) |",
             "|---|---|---|---|---|---|---|"]
    pvalues, rows = [], {}
    for i, test in enumerate(claim.tests):
        combined = {arm: [r.metric(test.metric) for r in runs[arm]] for arm in test.contrast}
        first_look = {arm: values[:first] for arm, values in combined.items()}
        pvalues.append(stats.welch_p(combined if i in looked else first_look, test.contrast, test.offset))
        if i in looked:
            rows[i] = decide(test, first_look, level), decide(test, combined, level), combined
    rejected = stats.holm(pvalues, alpha)
    for i, (one, both, combined) in rows.items():
        test = claim.tests[i]
        final = one[4] if one[4] != stats.UNCLEAR else both[4]
        seeds = "/".join(str(len(v)) for v in combined.values())
        lines.append(f"| {test.text} | {one[0]:+.3f} [{one[1]:+.3f}, {one[2]:+.3f}] | {one[4]} | {both[0]:+.3f} "
                     f"[{both[1]:+.3f}, {both[2]:+.3f}] ({seeds} seeds) | {both[4]} | **{final}** | "
                     f"{stats.family_verdict(rejected[i], both[0], test.direction)} |")
    lines += ["", f"Two looks at α = {alpha:g} each, so that by the union bound a test whose true contrast is 0 is "
              f"decided by either with chance at most {2 * alpha:g}. The pre-stated tests above are the first look "
              f"at 95%, on seeds 0–{first - 1} of every arm."]
    return lines


def contrast_text(test):
    terms = []
    for arm, c in test.contrast.items():
        sign = "−" if c < 0 else "+"
        terms.append(f"{sign} {'' if abs(c) == 1 else f'{abs(c):g}·'}{arm}")
    text = " ".join(terms).lstrip("+ ")
    return text + (f" − {test.offset:g}" if test.offset else "")


def mean_std(values, digits=3):
    values = np.array(values, dtype=np.float64)
    if len(values) == 0 or np.isnan(values).all():
        return "–"
    values = values[~np.isnan(values)]
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.{digits}f} ± {std:.{digits}f}"


def summary_table(name, claim, arms, runs, sweep, setup, first=None, plan=None):
    """The claim's markdown: its pre-stated tests with intervals and verdicts on the first `first` seeds
    of every arm (default: all), the planned second look of `plan` (second_look.json) where arms have
    more, then per arm the metrics (mean ± std over seeds), times and memory, then the compute."""
    base = " ".join(setup.base) or "the default job"
    K = setup.iterations or claim.iterations
    seeds = sorted({len(rs) for rs in runs.values()})
    lines = [f"# {name.upper()}: {claim.text}", "", claim.doc, "",
             f"Each arm: `train.py` ({base}){''.join(' ' + f for f in claim.common)} + the arm's flags"
             f"{''.join(' ' + f for f in setup.last)}, "
             f"`--iterations {K} --eval-every {setup.eval_every} --seed S`, seeds {claim.first_seed}–"
             f"{claim.first_seed + max(seeds) - 1} "
             f"({'/'.join(map(str, seeds))} per arm). Command: `python -m experiments.claims {name}"
             f"{' --second-look' if max(seeds) > (first or max(seeds)) else ''}`.", "",
             "## Pre-stated tests (Welch 95% interval over seeds; the first is the claim's verdict)", "",
             "| test | metric | contrast | predicted | estimate | 95% interval | verdict | family-wise (Holm) "
             "| seeds an arm to decide | the arms' runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    projected = False                                 # some test's seeds to decide were projected
    first = first or max(len(rs) for rs in runs.values())
    values_of = [{arm: [r.metric(test.metric) for r in runs[arm][:first]] for arm in test.contrast}
                 for test in claim.tests]
    origins = [runs_origin([r for arm in test.contrast for r in runs[arm][:first]]) for test in claim.tests]
    # A test of a machine's cost stands only on runs of one known machine; withdrawn, it leaves the family.
    withdrawn = [test.metric in MACHINE_METRICS and not one_machine for test, (_, one_machine) in
                 zip(claim.tests, origins)]
    standing = [i for i, w in enumerate(withdrawn) if not w]
    rejected = dict(zip(standing, stats.holm([stats.welch_p(values_of[i], claim.tests[i].contrast,
                                                            claim.tests[i].offset) for i in standing])))
    for i, (test, values, (origin, _)) in enumerate(zip(claim.tests, values_of, origins)):
        est, low, high, df, verdict = decide(test, values)
        interval = "– (fewer than 2 seeds)" if low is None else f"[{low:+.3f}, {high:+.3f}] (ν = {df:.1f})"
        needed = "–"                                  # decided, or no std to project from
        if withdrawn[i]:
            verdict, family = WITHDRAWN, "–"
        else:
            family = stats.family_verdict(rejected[i], est, test.direction)
        if verdict == stats.UNCLEAR and low is not None:
            needed = str(stats.seeds_to_decide(values, test.contrast, test.offset, most=MOST_SEEDS)
                         or f"over {MOST_SEEDS}")
            projected = True
        lines.append(f"| {test.text} | `{test.metric}` | {contrast_text(test)} | {test.direction} 0 | "
                     f"{est:+.3f} | {interval} | **{verdict}** | {family} | {needed} | {origin} |")
    lines += ["", f"Family-wise: Holm's step-down over the claim's {len(standing)} standing tests at α = 0.05 "
              "(two-sided Welch p-values, experiments/stats.py:holm): the verdicts that hold for the tests together, "
              "where the verdict column holds for each test alone. The arms' runs: whether the runs a test compares "
              "ran one commit on one machine (the arms table below says which); a test of CPU or memory stands "
              "only on runs of one known machine, and is withdrawn otherwise."]
    if projected:
        lines += ["", "Seeds an arm to decide: for a test not distinguishable, the fewest seeds per arm whose "
                  "interval would exclude 0 (on the estimate's side, which may not be the predicted one) if "
                  "the estimate and each arm's std stayed as they are (experiments/stats.py:seeds_to_decide): "
                  "a projection, not a run."]
    lines += second_look(name, claim, runs, first, plan or {"tests": {}})
    metrics = ["acc", "acc_auc", *claim.table]
    lines += ["", "## Arms (mean ± std over seeds)", "",
              "| arm | flags | seeds | " + " | ".join(f"`{m}`" for m in metrics) +
              " | wall min | CPU min | peak RSS GiB | code · machine (runs) | resumed |", "|" + "---|" * (len(metrics) + 8)]
    for arm, rs in runs.items():
        cells = [arm, " ".join(arms[arm]) or "–", str(len(rs))]
        cells += [mean_std([r.metric(m) for r in rs]) for m in metrics]
        cells += [mean_std([r.record["wall_s"] / 60 for r in rs], 1), mean_std([r.cpu_s() / 60 for r in rs], 1)]
        cells.append(mean_std([r.record["peak_rss_mb"] / 1024 for r in rs], 2))
        cells += [made_by_text(rs), resumed_text(rs, claim.seeds(len(rs)))]
        lines.append("| " + " | ".join(cells) + " |")
    if sweep:
        lines += sweep_table(*sweep)
    every = {r.key: r for rs in [*runs.values(), *(sweep[1].values() if sweep else [])]
             for r in rs}
    own = [r for r in every.values() if r.record["first_asked_by"].startswith(name + " ")]
    wall_h = lambda rs: sum(r.record["wall_s"] for r in rs) / 3600                 # noqa: E731
    cpu_h = lambda rs: sum(r.cpu_s() for r in rs) / 3600                           # noqa: E731
    lines += ["", f"Compute: {len(every)} runs, {wall_h(every.values()):.2f} h wall and "
              f"{cpu_h(every.values()):.2f} h CPU; of these, {len(own)} runs first made for "
              f"{name} ({wall_h(own):.2f} h wall, {cpu_h(own):.2f} h CPU), the others "
              "shared with another claim. Wall time is inflated when the machine is shared; CPU is user + "
              "sys of the run's process, at the rate of the attempt that finished the run (Run.cpu_s). Peak "
              "RSS counts pages shared with the fork server."]
    return "\n".join(lines) + "\n"


def runs_origin(rs):
    """(the cell of a test's arms' runs, whether they all ran on one known machine)."""
    made = {r.made_by() for r in rs}
    machines = {machine for _, machine in made}
    one_machine = len(machines) == 1 and UNKNOWN not in machines
    if any(code.startswith(UNKNOWN) or machine == UNKNOWN for code, machine in made):
        return "unknown code or machine", one_machine
    return ("one commit and machine" if len(made) == 1 else "mixed commits or machines"), one_machine


def made_by_text(rs):
    """Each (code, machine) of `rs` with its number of runs."""
    counts = Counter(r.made_by() for r in rs)
    return "; ".join(f"{code} · {machine} ×{n}" for (code, machine), n in sorted(counts.items()))


def resumed_text(rs, seeds):
    """The runs whose finishing attempt resumed from a save (its CPU is extrapolated: Run.cpu_s)."""
    resumed = [f"seed {seed} from {r.resumed_from()}" for r, seed in zip(rs, seeds) if r.resumed_from()]
    return ", ".join(resumed) or "–"


def sweep_table(spec, runs, pick):
    """The pre-stated search's lines: each setting's runs (mean ± std over seeds) on its selection
    metric, the held-out accuracy (reported, never selected on) and the target's metric; the pick."""
    metrics = [spec.select, ACC, *([spec.target[0]] if spec.target else [])]
    seeds = "seed 0" if spec.seeds == 1 else f"seeds 0–{spec.seeds - 1}"
    lines = ["", f"## The search ({seeds}, under {' '.join(spec.flags)}; chosen by `{spec.select}`)", "",
             "| setting | flags | " + " | ".join(f"`{m}`" for m in metrics) + " | code · machine (runs) | resumed |",
             "|" + "---|" * (len(metrics) + 4)]
    for setting, rs in runs.items():
        lines.append(f"| {setting} | {' '.join(spec.settings[setting])} | " +
                     " | ".join(mean_std([r.metric(m) for r in rs]) for m in metrics) +
                     f" | {made_by_text(rs)} | {resumed_text(rs, range(spec.seeds))} |")
    lines += ["", f"Picked {pick} (the highest mean `{spec.select}`)."]
    if spec.target:
        metric, bar = spec.target
        met = [s for s, rs in runs.items() if np.mean([r.metric(metric) for r in rs]) >= bar]
        lines[-1] += (f" Target: `{metric}` at least {bar:g} on the mean over seeds: met by "
                      f"{', '.join(met) if met else 'none'}.")
    return lines


def figure(name, claim, runs, out):
    """Held-out accuracy and the claim's curves against the iteration, mean ± std over seeds (and
    against samples when the arms differ in samples per iteration)."""
    from experiments import plot

    difficulties = sorted({r.get("difficulty") for rs in runs.values() for r in rs[0].evals[0]} - {None})
    keys = ["acc", *[f"acc[{d}]" for d in difficulties], *claim.curves]
    curves, samples = {}, {}
    for arm, rs in runs.items():
        series = {k: [r.series(k) for r in rs] for k in keys}
        curves[arm] = {k: plot.mean_and_std(v) for k, v in series.items() if all(v)}
        seen = [r.samples_seen() for r in rs]
        samples[arm] = {s: np.mean([x.get(s, np.nan) for x in seen]) for s in set().union(*seen)}
    names = {"acc": "held-out accuracy", **{f"acc[{d}]": f"held-out accuracy, {d}" for d in difficulties}}
    curves = {arm: {names.get(k, k): v for k, v in c.items()} for arm, c in curves.items()}
    plot.plot(curves, [names.get(k, k) for k in keys], out, title=f"{name.upper()}: {claim.text}"[:110],
              samples=samples if claim.by_samples else None)


# --- the command line --------------------------------------------------------------------------

def unclear_arms(name, setup, seeds):
    """The arms of the claim's first test when, at `seeds`, it is not distinguishable; else {}."""
    claim = CLAIMS[name]
    arms, _ = resolve(claim, name, setup)
    test = claim.tests[0]
    done = run_arms(name, claim, arms, [(arm, s) for arm in test.contrast for s in claim.seeds(seeds)], setup)
    values = {arm: [done[(arm, s)].metric(test.metric) for s in claim.seeds(seeds)] for arm in test.contrast}
    return {} if decide(test, values)[4] != stats.UNCLEAR else dict.fromkeys(test.contrast)


def spent_hours(runs_root):
    """Wall hours of every finished run under runs_root."""
    total = 0.0
    pool = os.path.join(runs_root, "pool")
    for key in os.listdir(pool) if os.path.isdir(pool) else []:
        path = os.path.join(pool, key, "experiment.json")
        if os.path.isfile(path):
            total += json.load(open(path))["wall_s"]
    return total / 3600


def parse_args(argv=None):
    """(the command line's arguments, the Setup of its runs)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("claims", nargs="+", choices=[*CLAIMS, "all"], metavar="CLAIM",
                   help=f"{', '.join(CLAIMS)}, or all (in the order {' '.join(ORDER)})")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    p.add_argument("--max-seeds", type=int, default=0,
                   help="with all: seeds for the arms of a first test still unclear, read at the first look's "
                        "level, so an uncorrected second look (default 0: off; experiments/second_look.json "
                        "is the planned one)")
    p.add_argument("--second-look", action="store_true",
                   help="the planned second look: the arms of experiments/second_look.json's tests of each\n"
                        "claim named get its seeds; the table reads both looks at its level")
    p.add_argument("--budget-hours", type=float, default=8.0,
                   help="with all: no more seeds once the finished runs took this much wall time")
    p.add_argument("--iterations", type=int, default=None, help="K of every run (default: each claim's)")
    p.add_argument("--config", default=None, help="train.py --config under every arm (default: the default job)")
    p.add_argument("--smoke", action="store_true",
                   help="--config tiny on the sums, 2 iterations, 1 seed, in --out (default experiments/smoke)")
    p.add_argument("--out", default=None, help="one folder for the runs and the results (default: "
                                                "experiments/runs and experiments/results); the\n"
                                                "records stay in experiments/records, whose finished runs are\n"
                                                "read from there, never run again")
    p.add_argument("--threads", type=int, default=THREADS,
                   help=f"torch threads per run (default {THREADS}: see THREADS; 2 on a machine of one's own)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs of a claim at once, each on --threads threads (default 1; 2 on this 2-core "
                        "machine when nothing else runs)")
    p.add_argument("--commit", action="store_true", help="git commit each claim's PNG and table when written")
    p.add_argument("--as-recorded", action="store_true",
                   help="the tables from the records as they are, running none again (a stale record, of\n"
                        "code from before the drift fix, too: its table says so)")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.threads < 1:
        p.error("--jobs and --threads must be at least 1")
    setup = Setup(RUNS, RESULTS, RECORDS, ["--config", args.config] if args.config else [], iterations=args.iterations,
                  threads=args.threads, jobs=args.jobs, rerun_stale=not args.as_recorded)
    if args.smoke:
        args.seeds, args.max_seeds = 1, 0
        setup.iterations, setup.eval_every, setup.save_every = 2, 2, 1
        setup.base, setup.last = list(SMOKE), list(SMOKE_LAST)
        args.out = args.out or os.path.join(ROOT, "experiments", "smoke")
    if args.out:             # the runs and tables move; what is on record stays where it is and is read
        setup.runs_root, setup.results = os.path.join(args.out, "runs"), os.path.join(args.out, "results")
    if args.smoke:           # the smoke runs' records are not the claims': they stay beside them
        setup.records = os.path.join(args.out, "records")
    return args, setup


def second_look_seeds(name):
    """{arm: seeds} of the claim's planned second look (experiments/second_look.json), or None."""
    planned = json.load(open(SECOND_LOOK))["tests"].get(name)
    return dict.fromkeys(planned["arms"], planned["seeds"]) if planned else None


def main(argv=None):
    args, setup = parse_args(argv)
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    names = ORDER if "all" in args.claims else list(dict.fromkeys(args.claims))
    failed = []
    for name in names:
        more = second_look_seeds(name) if args.second_look else None
        try:
            print(run_claim(name, args.seeds, setup, more, commit=args.commit), flush=True)
        except RunFailed as e:
            if len(names) == 1:
                raise SystemExit(str(e))
            failed.append(name)
            print(f"{name}: {e}; going on with the next claim", flush=True)
    if "all" in args.claims and args.max_seeds > args.seeds:
        for name in (n for n in names if n not in failed):
            more = unclear_arms(name, setup, args.seeds)
            if more and spent_hours(setup.runs_root) < args.budget_hours:
                print(f"{name}: first test not distinguishable at {args.seeds} seeds; seeds up to "
                      f"{args.max_seeds} for {', '.join(more)}", flush=True)
                try:
                    print(run_claim(name, args.seeds, setup, dict.fromkeys(more, args.max_seeds), args.commit),
                          flush=True)
                except RunFailed as e:
                    failed.append(name)
                    print(f"{name}: {e}", flush=True)
    if failed:
        raise SystemExit(f"claims that failed: {', '.join(failed)}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop)
    main()
