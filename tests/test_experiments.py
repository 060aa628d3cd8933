"""experiments/: the rule that decides a claim (the t quantile against printed tables, Welch's interval
against a hand computation, the verdict on hand-made numbers), a run's metrics on a hand-made run
folder, the prompt set and the rewards the claims add, the plot tool's averaging over seeds on
hand-made event files, resuming a run cut short, SIGTERM stopping every run of --jobs 2, and every
claim's experiment end to end on its smoke setting (the tiny model, 2 iterations, 1 seed), down to
its PNG and table."""

import glob
import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from experiments import claims, data, plot, rewards, stats


# --- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("df, t", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706),
                                   (10, 2.2281), (30, 2.0423), (math.inf, 1.9600)])
def test_t_quantile_matches_the_printed_table(df, t):
    assert stats.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)


def test_t_cdf_at_fractional_degrees_of_freedom():
    # ν = 2 has a closed form: F(t) = 1/2 + t / (2·sqrt(2 + t²)); the quantile of a fractional ν
    # lies between its neighbours'.
    for t in (0.3, 1.0, 4.0):
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-9)
    assert stats.t_quantile(0.975, 3) < stats.t_quantile(0.975, 2.5) < stats.t_quantile(0.975, 2)


def test_a_runs_cpu_seconds_scale_the_finishing_attempt_to_the_whole_run():
    """Run.cpu_s: an attempt cut by a session's end records nothing, so a run resumed after
    iteration 15 of 20 whose last attempt took 100 CPU-s took 400 at that rate; a failed attempt
    adds its own; a last attempt that ran no iteration leaves the recorded sum."""
    def run(attempts, iterations=20):
        r = object.__new__(claims.Run)
        r.record = {"attempts": attempts, "iterations": iterations, "cpu_s": sum(a["cpu_s"] for a in attempts)}
        return r

    assert run([{"from_iteration": 15, "cpu_s": 100.0, "exit_code": 0}]).cpu_s() == pytest.approx(400.0)
    assert run([{"from_iteration": 0, "cpu_s": 30.0, "exit_code": 1},
                {"from_iteration": 10, "cpu_s": 100.0, "exit_code": 0}]).cpu_s() == pytest.approx(230.0)
    assert run([{"from_iteration": 0, "cpu_s": 50.0, "exit_code": 0}]).metric("cpu_s_per_iter") == pytest.approx(2.5)
    assert run([{"from_iteration": 20, "cpu_s": 65.0, "exit_code": 0}]).cpu_s() == pytest.approx(65.0)


def test_seeds_to_decide_against_a_hand_computation():
    # a: mean 2, b: mean 1, s² = 1 each. With n seeds an arm: se² = 2/n, ν = 2(n − 1), and the interval
    # excludes 0 when t_{0.975, ν}·sqrt(2/n) < 1: n = 8 gives 2.1448·0.5 = 1.072 (printed t, ν = 14),
    # n = 9 gives 2.1199·0.4714 = 0.9993 (ν = 16).
    assert stats.seeds_to_decide({"a": [1, 2, 3], "b": [0, 1, 2]}, {"a": 1, "b": -1}) == 9
    assert stats.seeds_to_decide({"a": [1, 2, 3], "b": [0, 1, 2]}, {"a": 1, "b": -1}, offset=1.0) is None
    assert stats.seeds_to_decide({"a": [1, 2, 3], "b": [0, 1, 2]}, {"a": 1, "b": -1}, most=8) is None
    assert stats.seeds_to_decide({"a": [1]}, {"a": 1}) is None                  # one seed: no std
    assert stats.seeds_to_decide({"a": [0.5, 0.5]}, {"a": 1}) == 2              # no spread: any n decides
    # what it promises: n seeds an arm with these means and stds make welch_interval exclude 0
    a, b = [0.2, 0.5, 0.35], [0.1, 0.3, 0.05]
    n = stats.seeds_to_decide({"a": a, "b": b}, {"a": 1, "b": -1})
    def at(n, x):                                  # n values with x's mean and (Bessel) std
        z = np.linspace(-1, 1, n)
        return np.mean(x) + np.std(x, ddof=1) * z / np.std(z, ddof=1)
    assert stats.welch_interval({"a": at(n, a), "b": at(n, b)}, {"a": 1, "b": -1})[1] > 0
    assert stats.welch_interval({"a": at(n - 1, a), "b": at(n - 1, b)}, {"a": 1, "b": -1})[1] <= 0
    # a negative estimate decides on its own side, as many seeds
    assert stats.seeds_to_decide({"a": a, "b": b}, {"a": -1, "b": 1}) == n
    assert stats.welch_interval({"a": at(n, a), "b": at(n, b)}, {"a": -1, "b": 1})[2] < 0


def test_welch_interval_against_a_hand_computation():
    # a: mean 2, s² = 1; b: mean 0.5, s² = 0.25; n = 3 each. se² = 1/3 + 1/12 = 5/12;
    # ν = (5/12)² / ((1/3)²/2 + (1/12)²/2) = 2.9412; t_{0.975, 2.9412} = 3.21876 (mpmath: quad and findroot).
    est, low, high, df = stats.welch_interval({"a": [1, 2, 3], "b": [0, 0.5, 1]}, {"a": 1, "b": -1})
    assert est == pytest.approx(1.5)
    assert df == pytest.approx((5 / 12) ** 2 / ((1 / 3) ** 2 / 2 + (1 / 12) ** 2 / 2))
    half = stats.t_quantile(0.975, df) * math.sqrt(5 / 12)
    assert half == pytest.approx(3.21876 * math.sqrt(5 / 12), abs=1e-4)
    assert (low, high) == pytest.approx((1.5 - half, 1.5 + half))
    # a contrast of three arms, and an offset: G16 − 2·G8 + G4 − 0.1
    est, low, high, df = stats.welch_interval({"x": [1, 3], "y": [2, 2, 2], "z": [0, 1]},
                                              {"x": 1, "y": -2, "z": 1}, offset=0.1)
    assert est == pytest.approx(2 - 4 + 0.5 - 0.1)
    assert df == pytest.approx((2 / 2 + 0.5 / 2) ** 2 / ((2 / 2) ** 2 + (0.5 / 2) ** 2))


def test_welch_p_against_a_hand_computation_and_the_interval():
    # a: mean 4, s² = 4; b: no spread. se² = 4/3, ν = 2 exactly, t = 3/√(4/3) = 2.598; for ν = 2 the t
    # distribution's tail has a closed form, P(|T| > t) = 1 − t/√(2 + t²) = 0.12168.
    t = 3 / math.sqrt(4 / 3)
    assert stats.welch_p({"a": [2, 4, 6], "b": [1, 1, 1]}, {"a": 1, "b": -1}) == pytest.approx(
        1 - t / math.sqrt(2 + t * t), abs=1e-8)
    assert stats.welch_p({"a": [1], "b": [1, 2]}, {"a": 1, "b": -1}) is None           # one seed: no test
    rng = np.random.default_rng(0)                     # p < 0.05 exactly when the 95% interval excludes 0
    for _ in range(200):
        values = {"a": rng.normal(0.3, 0.2, 3), "b": rng.normal(0, 0.2, 4)}
        _, low, high, _ = stats.welch_interval(values, {"a": 1, "b": -1})
        assert (stats.welch_p(values, {"a": 1, "b": -1}) < 0.05) == (low > 0 or high < 0)


def test_holm_against_a_hand_computation():
    # m = 3: 0.01 ≤ 0.05/3 is rejected; then 0.03 > 0.05/2 stops the steps: 0.04 is not tested.
    assert stats.holm([0.01, 0.04, 0.03]) == [True, False, False]
    assert stats.holm([0.02, 0.01, None]) == [True, True, False]        # 0.02 ≤ 0.05/2 once 0.01 is
    assert stats.holm([0.04]) == [True] and stats.holm([0.06]) == [False]   # one test: the test itself
    assert stats.family_verdict(True, -0.2, ">") == stats.REFUTED
    assert stats.family_verdict(False, 0.3, ">") == stats.UNCLEAR


@pytest.mark.parametrize("a, b, direction, expected", [
    ([0.60, 0.62, 0.58], [0.30, 0.33, 0.28], ">", stats.REPRODUCED),    # clearly positive
    ([0.60, 0.62, 0.58], [0.30, 0.33, 0.28], "<", stats.REFUTED),
    ([0.30, 0.33, 0.28], [0.60, 0.62, 0.58], ">", stats.REFUTED),       # clearly negative
    ([0.30, 0.33, 0.28], [0.60, 0.62, 0.58], "<", stats.REPRODUCED),
    ([0.40, 0.60, 0.50], [0.45, 0.55, 0.35], ">", stats.UNCLEAR),       # overlapping
    ([0.40, 0.60, 0.50], [0.45, 0.55, 0.35], "<", stats.UNCLEAR),
    ([0.60], [0.30, 0.33, 0.28], ">", stats.UNCLEAR),                   # one seed: no interval
])
def test_the_verdict_follows_the_rule(a, b, direction, expected):
    test = claims.Test("a beats b", "acc_auc", {"a": 1, "b": -1}, direction)
    est, *_, verdict = claims.decide(test, {"a": a, "b": b})
    assert verdict == expected and est == pytest.approx(np.mean(a) - np.mean(b))      # every arm, any n


def test_a_one_arm_test_against_a_threshold():
    test = claims.Test("clips rarely", "mean(losses/clip_frac)", {"a": 1}, "<", offset=0.02)
    assert claims.decide(test, {"a": [0.001, 0.002, 0.0015]})[4] == stats.REPRODUCED
    assert claims.decide(test, {"a": [0.05, 0.06, 0.055]})[4] == stats.REFUTED
    assert claims.decide(test, {"a": [0.0, 0.0, 0.0]})[:3] == (-0.02, -0.02, -0.02)     # no spread: a point


def test_every_claim_states_its_tests_on_its_own_arms():
    for name, claim in claims.CLAIMS.items():
        assert claim.tests and claim.doc and name in claims.ORDER
        for test in claim.tests:
            assert set(test.contrast) <= set(claim.arms) and test.direction in "<>", (name, test.text)


# --- a run's numbers -----------------------------------------------------------------------------

def hand_made_run(folder, accuracies, lens):
    """A run folder as train.py leaves it: iteration metrics, and held-out rows at steps 0, 2, 4 with
    the right answer at the given share (half one_digit, half three_digit)."""
    os.makedirs(folder / "eval")
    (folder / "config.json").write_text(json.dumps({"config": {"num_prompts": 4, "group_size": 8}}))
    for i, n in enumerate(lens):
        (folder / f"iter_{i:04d}").mkdir()
        (folder / f"iter_{i:04d}" / "metrics.json").write_text(json.dumps({"charts/completion_len": n}))
    for step, (easy, hard) in accuracies.items():
        rows = [{"completion": f"It is {2 if k < easy else 3}.", "answer": "2", "difficulty": "one_digit",
                 "ref_completion": "It is 2."} for k in range(4)]
        rows += [{"completion": f"It is {2 if k < hard else 3}.", "answer": "2", "difficulty": "three_digit",
                  "ref_completion": "x"} for k in range(4)]
        (folder / "eval" / f"iter_{step:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "experiment.json").write_text(json.dumps({"peak_rss_mb": 2048, "cpu_s": 50.0, "iterations": len(lens)}))
    return claims.Run(claims.read_run(str(folder), "hand-made"))


def test_run_metrics_on_a_hand_made_run(tmp_path):
    run = hand_made_run(tmp_path / "r", {0: (0, 0), 2: (2, 0), 4: (4, 2)}, [10, 11, 12, 20, 21, 22, 23, 24])
    assert run.metric("acc") == 6 / 8
    assert run.metric("acc[one_digit]") == 1.0 and run.metric("acc[three_digit]") == 0.5
    # trapezoid over steps 0, 2, 4 of 0, 2/8, 6/8: (0 + 0.25)/2·2 + (0.25 + 0.75)/2·2 = 1.25, over 4
    assert run.metric("acc_auc") == pytest.approx(1.25 / 4)
    assert run.metric("acc_auc[one_digit]") == pytest.approx(((0 + 0.5) + (0.5 + 1)) / 4)
    assert run.metric("last5(charts/completion_len)") == 22.0
    assert run.metric("mean(charts/completion_len)") == pytest.approx(143 / 8)
    assert run.metric("growth(charts/completion_len)") == 22.0 - 11.0
    assert math.isnan(run.metric("mean(losses/kl)"))
    assert run.metric("same_as_ref") == 0.5                            # the one-digit answers, at the end
    assert run.metric("peak_rss_gb") == 2.0 and run.metric("cpu_s_per_iter") == 50 / 8
    assert run.samples_seen()[8] == 8 * 32


def test_canonical_flags_name_one_run():
    a = claims.canonical(["--max-new-tokens", "48", "--lr", "5e-5", "--reward", "x", "y", "--seed", "0"])
    b = claims.canonical(["--lr", "1e-5", "--seed", "0", "--reward", "x", "y", "--lr", "5e-5",
                          "--max-new-tokens", "48"])
    assert a == b == ["--lr", "5e-5", "--max-new-tokens", "48", "--reward", "x", "y", "--seed", "0"]


def test_the_runs_of_a_claim_are_the_default_job_under_its_flags():
    args, setup = claims.parse_args(["c3"])
    assert (setup.runs_root, setup.results, setup.records, args.seeds) == (claims.RUNS, claims.RESULTS,
                                                                           claims.RECORDS, 3)
    assert setup.argv(claims.CLAIMS["c3"], claims.CLAIMS["c3"].arms["G16"], 2) == [
        "--eval-every", "5", "--group-size", "16", "--iterations", "20", "--save-every", "5", "--seed", "2"]
    args, setup = claims.parse_args(["c2", "--iterations", "30", "--config", "gpu"])
    assert setup.argv(claims.CLAIMS["c2"], claims.CLAIMS["c2"].arms["beta0"], 0) == [
        "--beta", "1e-9", "--config", "gpu", "--eval-every", "5", "--iterations", "30", "--lr", claims.LR_HIGH,
        "--max-new-tokens", "48", "--save-every", "5", "--seed", "0"]
    c4 = claims.CLAIMS["c4"]                      # under another --config the default arm keeps 4 × 8
    assert "--group-size" not in claims.parse_args(["c4"])[1].argv(c4, c4.arms["B4xG8"], 0)
    args, setup = claims.parse_args(["c4", "--config", "gpu"])
    for arm, bg in [("B4xG8", ["4", "8"]), ("B2xG16", ["2", "16"])]:
        argv = setup.argv(c4, c4.arms[arm], 0)
        assert [claims.flag_value(argv, "--num-prompts"), claims.flag_value(argv, "--group-size")] == bg
    args, setup = claims.parse_args(["c1", "--smoke", "--out", "/x"])
    argv = setup.argv(claims.CLAIMS["c8"], claims.CLAIMS["c8"].arms["mu4_lr1e-5"], 0)
    assert argv[:6] == ["--config", "tiny", "--epochs", "4", "--eval-every", "2"]
    assert (setup.runs_root, setup.records) == ("/x/runs", "/x/records")     # the smoke runs' records stay there
    args, setup = claims.parse_args(["c1", "--out", "/x"])              # another folder: the records stay
    assert (setup.runs_root, setup.results, setup.records) == ("/x/runs", "/x/results", claims.RECORDS)


# --- what the claims add: prompts and rewards ----------------------------------------------------

def test_mixed_difficulty_prompts(tmp_path):
    train, held_out = data.mixed_difficulty()
    assert train == data.mixed_difficulty()[0]                                           # seeded
    key = lambda r: r["messages"][0]["content"]                                          # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held_out}
    assert [r["difficulty"] for r in held_out[:4]] == ["one_digit", "three_digit"] * 2
    assert sum(r["difficulty"] == "one_digit" for r in train) == len(train) // 2 == 57
    for r in train + held_out:
        a, b = map(int, key(r)[len("What is "):].split("?")[0].split(" plus "))
        assert r["answer"] == str(a + b) and (a < 10) == (r["difficulty"] == "one_digit")
    paths = data.write_prompt_set("mixed_difficulty", tmp_path)
    first = [open(p).read() for p in paths]
    assert data.write_prompt_set("mixed_difficulty", tmp_path) == paths
    assert [open(p).read() for p in paths] == first and first[1].count("\n") == 48


def test_verbose_judge_pays_per_token_up_to_its_cap():
    out = rewards.verbose_judge(["q"] * 3, ["It is 5.", "It is 4.", "5"], ["5"] * 3,
                                completion_ids=[[1] * 10, [1] * 10, [1] * 100])
    assert out == pytest.approx([1.1, 0.1, 1.4])


def test_flipped_reward_is_noise_of_the_stated_rate_and_reproducible():
    prompts = [f"What is {k} plus 1?" for k in range(2000)]
    completions = [f"{k + 1}" if k % 2 else "0" for k in range(2000)]
    answers = [str(k + 1) for k in range(2000)]
    clean = [float(k % 2) for k in range(2000)]
    noisy = rewards.flip_20(prompts, completions, answers)
    flipped = [a != b for a, b in zip(clean, noisy)]
    assert 0.17 < np.mean(flipped) < 0.23
    assert rewards.flip_20(prompts, completions, answers) == noisy                          # deterministic
    again = rewards.flip_20(prompts, ["x"] + completions[1:], answers)                      # another batch
    assert [a != b for a, b in zip(clean[1:], again[1:])] != flipped[1:]
    assert 0.07 < np.mean([a != b for a, b in zip(clean, rewards.flip_10(prompts, completions, answers))]) < 0.13


# --- the plot tool ------------------------------------------------------------------------------

def write_events(folder, values, tag="charts/reward_mean", start=0):
    writer = SummaryWriter(folder)
    for step, value in enumerate(values, start):
        writer.add_scalar(tag, value, step)
    writer.close()


def test_runs_of_one_arm_are_averaged_with_a_band(tmp_path):
    write_events(tmp_path / "a_seed0" / "tb", [0.0, 1.0, 2.0, 3.0])
    write_events(tmp_path / "a_seed1" / "tb", [2.0, 3.0, 4.0])          # one step fewer: step 3 is left out
    write_events(tmp_path / "a_seed2" / "tb", [1.0, 5.0, 0.0, 7.0])
    write_events(tmp_path / "b" / "tb", [9.0, 8.0])
    runs = [tmp_path / d for d in ("a_seed0", "a_seed1", "a_seed2", "b")]
    curves = plot.arms(runs, ["charts/reward_mean"])
    assert list(curves) == ["a", "b"]
    steps, mean, std = curves["a"]["charts/reward_mean"]
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(mean, [1.0, 3.0, 2.0])
    np.testing.assert_allclose(std, [1.0, 2.0, 2.0])                    # Bessel: e.g. step 1: 1, 3, 5
    steps, mean, std = curves["b"]["charts/reward_mean"]
    assert mean.tolist() == [9.0, 8.0] and std.tolist() == [0.0, 0.0]
    plot.main([*map(str, runs), "--metric", "charts/reward_mean", "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no scalar charts/nothing"):
        plot.arms(runs, ["charts/nothing"])


def test_a_resumed_run_keeps_the_last_value_of_a_step(tmp_path):
    write_events(tmp_path / "r" / "tb", [1.0, 1.0, 1.0])
    write_events(tmp_path / "r" / "tb", [5.0, 6.0], start=1)           # the resumed half rewrote steps 1, 2
    values = plot.read_scalars(tmp_path / "r", ["charts/reward_mean"])["charts/reward_mean"]
    assert values == {0: 1.0, 1: 5.0, 2: 6.0}


# --- end to end ----------------------------------------------------------------------------------

def test_a_run_cut_short_is_finished_with_resume(tmp_path):
    argv = claims.canonical([*claims.SMOKE, "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
                             "--eval-prompts", "2", "--seed", "0", "--iterations", "3", "--eval-every", "1",
                             "--save-every", "1"])
    cut = argv.copy()
    cut[cut.index("--iterations") + 1] = "1"                            # the run stopped after its first save
    key = claims.hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:12]
    run_dir = tmp_path / "pool" / key
    os.makedirs(tmp_path / "pool")
    code, *_ = claims.run_child([*cut, "--run-dir", str(run_dir)], str(run_dir) + ".log", str(run_dir) + ".pid")
    assert code == 0 and (run_dir / "policy" / "train_state.json").is_file()
    first = (run_dir / "iter_0000" / "metrics.json").stat().st_mtime_ns
    record = claims.ensure_run(argv, str(tmp_path), "c0/arm_seed0", "c0 arm seed 0")
    assert [a["from_iteration"] for a in record["experiment"]["attempts"]] == [1]
    assert (run_dir / "iter_0000" / "metrics.json").stat().st_mtime_ns == first        # not recomputed
    assert (run_dir / "iter_0002" / "metrics.json").is_file() and (run_dir / "eval" / "iter_0003.jsonl").is_file()
    assert not (run_dir / "policy").exists() and record["experiment"]["cpu_s"] > 0
    assert sorted(record["metrics"]) == ["0", "1", "2"] and sorted(record["evals"]) == ["0", "1", "2", "3"]
    assert os.path.realpath(tmp_path / "c0" / "arm_seed0") == str(run_dir)
    assert claims.ensure_run(argv, str(tmp_path), "c0/arm_seed0", "again") == record     # finished: not rerun


def test_a_finished_runs_record_serves_a_fresh_checkout_without_running_it(tmp_path, monkeypatch):
    """A finished run's numbers are kept in the records folder (committed), so a checkout whose runs
    folder is empty takes the run from there and gets the same metrics; nothing else is kept."""
    argv = claims.canonical([*claims.SMOKE, "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
                             "--eval-prompts", "2", "--seed", "0", "--iterations", "2", "--eval-every", "1",
                             "--save-every", "1"])
    records = tmp_path / "records"
    record = claims.ensure_run(argv, str(tmp_path / "a"), "c0/arm_seed0", "c0 arm seed 0", records=str(records))
    assert os.listdir(records) == ["c0.jsonl.gz"]                   # the file of the claim that asked
    assert list(record) == ["key", "experiment", "config", "metrics", "evals"]
    assert sorted(record["metrics"]) == ["0", "1"] and sorted(record["evals"]) == ["0", "1", "2"]
    kept = (records / "c0.jsonl.gz").read_bytes()
    claims.keep(record, str(records), "c0")                           # kept again: the same bytes
    assert (records / "c0.jsonl.gz").read_bytes() == kept

    def no_run(*_):
        raise AssertionError("a run kept in the records was run again")

    monkeypatch.setattr(claims, "run_child", no_run)
    assert claims.ensure_run(argv, str(tmp_path / "b"), "c0/arm_seed0", "fresh", records=str(records)) == record
    assert not (tmp_path / "b").exists()                              # nothing written for it
    other = {**record, "key": "0" * 12}
    claims.keep(other, str(records), "c0")                            # a second run: one line each, by key
    assert claims.find_record(str(records), "0" * 12) == other and claims.find_record(str(records), "1") is None
    assert claims.find_record(str(records), record["key"]) == record


def test_a_stale_record_is_run_again_once_and_replaced_in_every_file(tmp_path, monkeypatch):
    """A record established as made before the drift fix (on_record_since) is run again when asked
    (not with rerun_stale off), its new record names its commit and machine and replaces the old one
    in whichever claim's file held it; the new record is not stale, so it is not run again."""
    argv = claims.canonical([*claims.SMOKE, "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
                             "--eval-prompts", "2", "--seed", "0", "--iterations", "2", "--eval-every", "1",
                             "--save-every", "1"])
    records = tmp_path / "records"
    fresh = claims.ensure_run(argv, str(tmp_path / "a"), "c0/arm_seed0", "c0 arm seed 0", records=str(records))
    made = fresh["experiment"]["attempts"][-1]["made_by"]
    assert made == claims.code_and_machine(1) and made["cores"] == os.cpu_count()
    old = json.loads(json.dumps(fresh))
    old["experiment"]["attempts"][-1]["made_by"] = dict.fromkeys(made, claims.UNKNOWN)
    old["experiment"]["on_record_since"] = {"commit": "1" * 40, "date": "d", "before_drift_fix": True}
    os.remove(records / "c0.jsonl.gz")
    claims.keep(old, str(records), "c9")                       # on record in another claim's file
    assert claims.is_stale(old) and not claims.is_stale(fresh)
    assert claims.Run(old).made_by() == (f"{claims.UNKNOWN}, on record at 1111111, before the drift fix",
                                          claims.UNKNOWN)
    assert claims.ensure_run(argv, str(tmp_path / "b"), "c0/arm_seed0", "c0 arm seed 0", records=str(records),
                             rerun_stale=False) == old
    again = claims.ensure_run(argv, str(tmp_path / "c"), "c0/arm_seed0", "c0 arm seed 0", records=str(records))
    assert again["experiment"]["attempts"][-1]["made_by"] == made and not claims.is_stale(again)
    assert sorted(os.listdir(records)) == ["c0.jsonl.gz", "c9.jsonl.gz"]
    assert claims.find_record(str(records), fresh["key"]) == again
    with gzip.open(records / "c9.jsonl.gz", "rt") as f:
        assert f.read() == ""                                   # the stale line is gone from c9's file

    def no_run(*_):
        raise AssertionError("a rerun record was run again")

    monkeypatch.setattr(claims, "run_child", no_run)
    assert claims.ensure_run(argv, str(tmp_path / "d"), "c0/arm_seed0", "c0", records=str(records)) == again


def test_a_cost_test_stands_only_on_runs_of_one_known_machine():
    """The table says each arm's code and machine and marks resumed runs; a CPU or memory test whose arms
    ran on two machines, or an unknown one, is withdrawn and left out of Holm's family."""
    def run(x, cpu, commit="a" * 40, resumed=0):
        made = {"commit": commit, "clean": True, "cpu": cpu, "cpu_family_model": "25/17", "cores": 2}
        experiment = {"iterations": 2, "cpu_s": 10.0 * x, "wall_s": 1.0, "peak_rss_mb": 1024.0 * x,
                      "first_asked_by": "c x", "attempts": [{"from_iteration": resumed, "cpu_s": 10.0 * x,
                                                             "exit_code": 0, "made_by": made}]}
        evals = {"0": [{"completion": "1", "answer": "1"}], "2": [{"completion": "1", "answer": "1"}]}
        return claims.Run({"key": str(x), "experiment": experiment, "config": {"config": {}},
                           "metrics": {"0": {"k": x}, "1": {"k": x}}, "evals": evals})

    claim = claims.Claim("c", "d", {"a": [], "b": []},
                         [claims.Test("a learns", "mean(k)", {"a": 1, "b": -1}, ">"),
                          claims.Test("a is cheaper", "cpu_s_per_iter", {"a": 1, "b": -1}, "<")], [], [])
    setup = claims.Setup("r", "r", "r", [])
    same = {"a": [run(x, "EPYC") for x in (1.0, 1.1, 0.9)], "b": [run(x, "EPYC", resumed=1) for x in (2.0, 2.2, 1.9)]}
    table = claims.summary_table("c", claim, {"a": [], "b": []}, same, None, setup)
    assert "| **reproduced** | reproduced | – | one commit and machine |" in table
    assert "aaaaaaa · EPYC 25/17, 2 cores ×3 | seed 0 from 1, seed 1 from 1, seed 2 from 1 |" in table
    mixed = {"a": same["a"], "b": [run(x, "Xeon") for x in (2.0, 2.2, 1.9)]}
    table = claims.summary_table("c", claim, {"a": [], "b": []}, mixed, None, setup)
    (row,) = [line for line in table.splitlines() if line.startswith("| a is cheaper")]
    assert f"**{claims.WITHDRAWN}** | – |" in row and row.endswith("| mixed commits or machines |")
    assert "Holm's step-down over the claim's 1 standing tests" in table
    unknown = {"a": same["a"], "b": [run(x, claims.UNKNOWN, commit=claims.UNKNOWN) for x in (2.0, 2.2, 1.9)]}
    table = claims.summary_table("c", claim, {"a": [], "b": []}, unknown, None, setup)
    assert claims.WITHDRAWN in table and "unknown code or machine" in table


def test_sigterm_stops_every_run_of_jobs_2_and_counts_no_attempt(tmp_path):
    """The runner's main thread waits for its --jobs threads without a join, so SIGTERM's handler runs:
    both runs' children stop, no other run starts, and no attempt is recorded."""
    runner = subprocess.Popen([sys.executable, "-m", "experiments.claims", "c3", "--smoke", "--out", str(tmp_path),
                               "--jobs", "2"], cwd=claims.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pool = tmp_path / "runs" / "pool"
    deadline = time.time() + 120
    while len(glob.glob(str(pool / "*.pid"))) < 2 and runner.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    pids = [int(open(p).read()) for p in glob.glob(str(pool / "*.pid"))]
    assert len(pids) == 2, "two runs at once"
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) == 143
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not glob.glob(str(pool / "*.attempts.json")) and not glob.glob(str(pool / "*.pid"))
    assert not glob.glob(str(pool / "*" / "experiment.json"))


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    """One folder for every claim's smoke runs, so that arms the claims share run once."""
    return tmp_path_factory.mktemp("claims")


@pytest.mark.parametrize("name", list(claims.CLAIMS))
def test_every_claim_runs_end_to_end_on_its_smoke_setting(name, smoke_out):
    claims.main([name, "--smoke", "--out", str(smoke_out), *(["--jobs", "2"] if name == "c3" else [])])
    results = smoke_out / "results"
    assert (results / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (results / f"{name}.md").read_text()
    lines = table.splitlines()
    tests = lines[lines.index("| test | metric | contrast | predicted | estimate | 95% interval | verdict "
                              "| family-wise (Holm) | seeds an arm to decide | the arms' runs |") + 2:]
    tests = tests[:tests.index("")]
    assert [row.split(" | ")[0][2:] for row in tests] == [t.text for t in claims.CLAIMS[name].tests]
    # One seed decides nothing; every run here is this checkout's, on this machine, so no test is withdrawn.
    assert all(row.endswith(f"**{stats.UNCLEAR}** | {stats.UNCLEAR} | – | one commit and machine |")
               for row in tests)
    arms = lines[lines.index("## Arms (mean ± std over seeds)") + 4:]
    arms = arms[:arms.index("")]
    assert [row.split(" | ")[0][2:] for row in arms] == list(claims.CLAIMS[name].arms)
    made = claims.code_and_machine(1)
    assert all(f"{made['commit'][:7]}" in row and f"{made['cpu']} {made['cpu_family_model']}" in row for row in arms)
    assert "nan" not in table and "Compute: " in table
    for arm in claims.CLAIMS[name].arms:
        run = smoke_out / "runs" / name / f"{arm}_seed{claims.CLAIMS[name].first_seed}"
        assert (run / "iter_0001" / "metrics.json").is_file() and (run / "experiment.json").is_file()
        assert not (run / "policy").exists()


# --- the tables on record ------------------------------------------------------------------------

@pytest.mark.parametrize("name", claims.CLAIMS)
def test_every_claims_table_recomputes_from_its_records_alone(name, tmp_path, monkeypatch):
    """A fresh checkout, with no run at all, rebuilds each claim's committed table byte for byte from
    experiments/records; a run missing from them would have to train, and fails the test instead."""
    def no_run(argv, *_):
        raise AssertionError(f"{name}: a run not on record: {argv}")

    monkeypatch.setattr(claims, "run_child", no_run)
    monkeypatch.setattr(claims, "figure", lambda *_: None)          # the table is the record's; the PNG is drawn
    args, setup = claims.parse_args([name, "--as-recorded"])
    setup.results, setup.records = str(tmp_path), str(tmp_path / "records")
    shutil.copytree(claims.RECORDS, setup.records)                   # what a run would keep stays here
    claims.run_claim(name, args.seeds, setup, claims.second_look_seeds(name))    # as --second-look reads it
    committed = os.path.join(claims.RESULTS, f"{name}.md")
    assert (tmp_path / f"{name}.md").read_text() == open(committed).read()


def test_the_second_look_reads_both_looks_at_the_plans_level():
    """A test of the plan whose arms have 6 seeds: the first look (seeds 0–2) and the combined one
    (all 6), each at 97.5%, as stats computes them; the verdict is the combined one's where the first
    does not decide; Holm at α 0.025 over the claim's tests. No row where no arm has more seeds."""
    def run(x):
        return claims.Run({"key": str(x), "experiment": {}, "config": {"config": {}},
                           "metrics": {"0": {"k": x}}, "evals": {}})

    claim = claims.Claim("c", "d", {"a": [], "b": []},
                         [claims.Test("a above b", "mean(k)", {"a": 1, "b": -1}, ">"),
                          claims.Test("a above 0", "mean(k)", {"a": 1}, ">")], [], [])
    a, b = [1.0, 1.3, 0.7, 1.1, 0.9, 1.2], [0.2, 0.6, 0.1, 0.3, 0.0, 0.4]
    runs = {"a": [run(x) for x in a], "b": [run(x) for x in b]}
    plan = {"rule": {"alpha_per_look": 0.025}, "tests": {"c": {"tests": [0], "arms": ["a", "b"], "seeds": 6}}}
    lines = claims.second_look("c", claim, runs, 3, plan)
    (row,) = [line for line in lines if line.startswith("| a above b")]
    cells = row.split(" | ")
    est, low, high, _ = stats.welch_interval({"a": a[:3], "b": b[:3]}, {"a": 1, "b": -1}, 0, 0.975)
    assert cells[1] == f"{est:+.3f} [{low:+.3f}, {high:+.3f}]" and cells[2] == stats.UNCLEAR
    est, low, high, _ = stats.welch_interval({"a": a, "b": b}, {"a": 1, "b": -1}, 0, 0.975)
    assert cells[3] == f"{est:+.3f} [{low:+.3f}, {high:+.3f}] (6/6 seeds)" and low > 0
    assert cells[4] == stats.REPRODUCED and cells[5] == f"**{stats.REPRODUCED}**"
    p = [stats.welch_p({"a": a, "b": b}, {"a": 1, "b": -1}), stats.welch_p({"a": a[:3]}, {"a": 1})]
    assert cells[6].rstrip(" |") == stats.family_verdict(stats.holm(p, 0.025)[0], est, ">")
    assert claims.second_look("c", claim, {"a": runs["a"][:3], "b": runs["b"][:3]}, 3, plan) == []
    assert claims.second_look("x", claim, runs, 3, plan) == []
