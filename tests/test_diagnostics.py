"""Each diagnostic of grpo/loop/diagnostics.py reacts to the failure it is for: hand-made batches for the
functions, and the command lines (train.py --check, a short run, update.py) for the wiring."""

import json
import os

import pytest
import torch
from conftest import cli
from safetensors.torch import load_file, save_file

from grpo.loop import diagnostics

REWARDS = os.path.join(os.path.dirname(__file__), "rewards_for_tests.py")


def test_reward_spread_hand_vector():
    # Groups of G = 4: [0, 0, 1, 1] has Bessel std sqrt(1/3); [2, 2, 2, 2] has none.
    spread = diagnostics.reward_spread(torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4)
    assert spread["frac_zero_std"] == 0.5
    assert spread["std_max"] == pytest.approx(3 ** -0.5) and spread["std_min"] == 0.0
    assert spread["std_mean"] == pytest.approx(3 ** -0.5 / 2)
    assert not any("WARNING" in line for line in diagnostics.spread_report(spread, 4))
    flat = diagnostics.reward_spread(torch.ones(8), 4)
    assert flat["frac_zero_std"] == 1.0
    assert any("WARNING: most groups carry no signal" in line for line in diagnostics.spread_report(flat, 4))


def test_length_reward_correlation_is_within_groups():
    lengths = torch.tensor([1, 2, 3, 4, 10, 20, 30, 40])
    assert diagnostics.length_stats(lengths, lengths.float(), 4)["length_reward_corr"] == pytest.approx(1.0)
    assert diagnostics.length_stats(lengths, -3.0 * lengths.float(), 4)["length_reward_corr"] == pytest.approx(-1.0)
    # Longer group, higher rewards, but inside each group the shortest completion wins: negative, not +1.
    # Centred: x = (−1.5, −.5, .5, 1.5) and (−15, −5, 5, 15), y = (1.5, .5, −.5, −1.5) twice, so
    # Σxy = −5 − 50, Σx² = 5 + 500, Σy² = 10.
    rewards = torch.tensor([4.0, 3.0, 2.0, 1.0, 14.0, 13.0, 12.0, 11.0])
    assert diagnostics.length_stats(lengths, rewards, 4)["length_reward_corr"] == pytest.approx(-55 / 5050 ** 0.5)
    stats = diagnostics.length_stats(lengths, torch.zeros(8), 4)
    assert stats["length_reward_corr"] == 0.0 and stats["len_mean"] == 13.75


def test_diversity_hand_vector_and_collapse_flag():
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    mask = torch.ones(2, 5, dtype=torch.bool)
    diverse = diagnostics.diversity(ids, mask, ["a b c\nd", "e f"])
    assert diverse == {"distinct_1": 1.0, "distinct_2": 1.0, "repeat_4gram": 0.0, "first_line_share": 0.5}
    same = torch.tensor([[7, 7, 7, 7, 7], [7, 7, 7, 7, 7]])
    collapsed = diagnostics.diversity(same, mask, ["yes yes\nmore", "yes yes"])
    # One unigram of ten, one bigram of eight; each row's second 4-gram repeats its first: 2 of 4.
    assert collapsed == {"distinct_1": 0.1, "distinct_2": 0.125, "repeat_4gram": 0.5, "first_line_share": 1.0}
    collapsed, diverse = ({f"diversity/{k}": v for k, v in d.items()} for d in (collapsed, diverse))
    flags = diagnostics.collapse_flags(collapsed, diverse)
    assert flags == {"diversity/distinct_1_drop": 1.0, "diversity/distinct_2_drop": 1.0,
                     "diversity/repeat_4gram_rise": 1.0, "diversity/first_line_share_rise": 1.0,
                     "diversity/collapse": 1.0}
    assert diagnostics.collapse_flags(diverse, diverse)["diversity/collapse"] == 0.0
    assert diagnostics.collapse_flags(diverse, None) == {"diversity/collapse": 0.0}


def test_check_warns_on_a_constant_reward(tmp_path):
    r = cli("train.py", "--config", "tiny", "--check", "--reward", f"{REWARDS}:constant", "--run-dir", tmp_path / "r")
    assert r.code == 0, r.err
    assert "100% of groups have all-equal rewards" in r.out
    assert "WARNING: most groups carry no signal" in r.out and "raise G" in r.out
    assert not (tmp_path / "r").exists()                      # --check writes nothing


def test_run_logs_zero_spread_and_length_correlation(tmp_path):
    run = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--run-dir", run, "--iterations", 2, "--max-new-tokens", 40,
            "--reward", f"{REWARDS}:token_count")
    assert r.code == 0, r.err
    m = json.loads((run / "iter_0001" / "metrics.json").read_text())
    assert m["diag/length_reward_corr"] == pytest.approx(1.0)   # the reward is the length
    assert m["charts/frac_zero_std"] < 1
    lengths = load_file(run / "iter_0001" / "rewards.safetensors")["lengths"].float()
    assert m["diag/len_mean"] == pytest.approx(lengths.mean().item())
    assert m["diag/len_std"] == pytest.approx(lengths.std().item())
    assert m["diag/logprob_diff_max"] < 1e-4                     # on-policy: the sampler and the trainer agree
    for key in ["diversity/distinct_1", "diversity/distinct_2", "diversity/repeat_4gram",
                "diversity/first_line_share", "diversity/collapse"]:
        assert key in m, key

    flat = tmp_path / "flat"
    r = cli("train.py", "--config", "tiny", "--run-dir", flat, "--iterations", 1, "--reward", f"{REWARDS}:constant")
    assert r.code == 0, r.err
    assert json.loads((flat / "iter_0000" / "metrics.json").read_text())["charts/frac_zero_std"] == 1.0
    assert "WARNING: most groups carry no signal" in r.err + r.out


def test_eval_compares_the_policy_with_the_reference(tmp_path):
    run = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--run-dir", run, "--iterations", 4, "--eval-every", 2, "--eval-prompts", 6)
    assert r.code == 0, r.err
    assert sorted(os.listdir(run / "eval")) == ["iter_0000.jsonl", "iter_0002.jsonl", "iter_0004.jsonl"]
    first = [json.loads(line) for line in open(run / "eval" / "iter_0000.jsonl")]
    last = [json.loads(line) for line in open(run / "eval" / "iter_0004.jsonl")]
    assert len(first) == 6
    # Before any update the policy is the reference: the same greedy answers, side by side.
    assert all(row["completion"] == row["ref_completion"] and row["reward"] == row["ref_reward"] for row in first)
    assert [row["ref_completion"] for row in last] == [row["ref_completion"] for row in first]
    m = json.loads((run / "iter_0002" / "metrics.json").read_text())
    assert m["eval/ref_reward_mean"] == pytest.approx(sum(row["ref_reward"] for row in first) / 6)


def test_update_warns_when_not_on_policy_and_when_beta_is_zero(models, rollout_dir, tmp_path):
    rollouts = load_file(rollout_dir / "rollouts.safetensors")
    args = ["--model", models["policy"], "--advantages", None, "--lr", 1e-4, "--minibatch-size", 16]
    adv = tmp_path / "adv.safetensors"
    save_file({"advantages": torch.linspace(-1, 1, 16), "group_ids": rollouts["group_ids"]}, str(adv))
    args[3] = adv
    r = cli("update.py", *args, "--rollouts", rollout_dir / "rollouts.safetensors", "--out", tmp_path / "on")
    assert r.code == 0, r.err
    on = json.loads((tmp_path / "on" / "metrics.json").read_text())
    assert on["logprob_diff_max"] < 1e-4 and "WARNING" not in r.err

    shifted = dict(rollouts, old_logprobs=rollouts["old_logprobs"] - 0.5 * rollouts["completion_mask"])
    save_file(shifted, str(tmp_path / "shifted.safetensors"), metadata={"args": json.dumps({"temperature": 0.7})})
    r = cli("update.py", *args, "--rollouts", tmp_path / "shifted.safetensors", "--out", tmp_path / "off", "--beta", 0)
    assert r.code == 0, r.err
    off = json.loads((tmp_path / "off" / "metrics.json").read_text())
    assert off["logprob_diff_mean"] == pytest.approx(0.5, abs=1e-4)
    assert "the trainer does not compute what the sampler did" in r.err
    assert "β = 0" in r.err


def test_length_strata_hand_vector(tmp_path):
    # One group of G = 4 in S = 2 strata by length: rows 1 and 3 (lengths 1, 2) and rows 0 and 2 (5, 9).
    save_file({"rewards": torch.tensor([1.0, 0.0, 3.0, 0.0]), "group_ids": torch.zeros(4, dtype=torch.int64),
               "lengths": torch.tensor([5, 1, 9, 2])}, str(tmp_path / "r.safetensors"))

    def run(*flags):
        r = cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", tmp_path / "a.safetensors", *flags)
        assert r.code == 0, r.err
        return load_file(tmp_path / "a.safetensors")

    out = run("--length-strata", 2)
    # Short stratum: rewards 0, 0: exactly 0. Long stratum: 1, 3 -> ∓1/(√2 + ε).
    a = 1 / (2 ** 0.5 + 1e-4)
    torch.testing.assert_close(out["advantages"], torch.tensor([-a, 0.0, a, 0.0]))
    assert out["zero_std"].tolist() == [True, False] and out["group_ids"].tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(run("--length-strata", 2, "--estimator", "dr_grpo")["advantages"],
                               torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    # Without strata, the whole group: mean 1, std sqrt(2).
    torch.testing.assert_close(run()["advantages"], torch.tensor([0.0, -1.0, 2.0, -1.0]) / (2 ** 0.5 + 1e-4))
    r = cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", tmp_path / "b.safetensors",
            "--length-strata", 4)
    assert r.code == 2 and "--length-strata 4" in r.err and not (tmp_path / "b.safetensors").exists()


def test_length_penalty_hand_vector(tmp_path):
    lengths = [2, 4, 8, 6]
    save_file({"group_ids": torch.tensor([0, 0, 1, 1]),
               "completion_mask": torch.tensor([[j < n for j in range(8)] for n in lengths]),
               "completion_ids": torch.zeros(4, 8, dtype=torch.int64)}, str(tmp_path / "rollouts.safetensors"),
              metadata={"args": json.dumps({"max_new_tokens": 8})})
    (tmp_path / "samples.jsonl").write_text("".join(
        json.dumps({"prompt": "q", "completion": "5", "answer": "5"}) + "\n" for _ in lengths))
    r = cli("score.py", "--rollouts", tmp_path / "rollouts.safetensors", "--samples", tmp_path / "samples.jsonl",
            "--reward", "exact_answer", "--length-penalty", 0.5, "--out", tmp_path / "r.safetensors")
    assert r.code == 0, r.err
    got = load_file(tmp_path / "r.safetensors")
    # −α·|o|/L_max with α = 0.5, L_max = 8.
    torch.testing.assert_close(got["reward/length"], torch.tensor([-0.125, -0.25, -0.5, -0.375]))
    torch.testing.assert_close(got["rewards"], 1.0 + got["reward/length"])
    assert got["lengths"].tolist() == lengths


def test_reward_errors_can_be_skipped(rollout_dir, tmp_path, monkeypatch):
    """None: the reward does not apply; NaN or an exception under --on-reward-error skip: the row is
    skipped whatever the other rewards say. A skipped row's reward is 0 and its component NaN."""
    (tmp_path / "flaky_mod.py").write_text(
        "def holes(prompts, completions, **k):\n"
        "    return [None if i in (2, 13) else float('nan') if i == 5 else float(i) for i in range(len(completions))]\n"
        "def boom(prompts, completions, **k):\n    raise RuntimeError('parser crashed')\n")
    monkeypatch.chdir(tmp_path)
    base = ["--rollouts", rollout_dir / "rollouts.safetensors", "--samples", rollout_dir / "samples.jsonl",
            "--out", tmp_path / "r.safetensors", "--on-reward-error", "skip"]
    r = cli("score.py", *base, "--reward", "flaky_mod:holes")
    assert r.code == 0, r.err
    assert "holes" in r.err and "rows 5" in r.err
    got = load_file(tmp_path / "r.safetensors")
    expected = torch.arange(16.0)
    expected[[2, 5, 13]] = 0.0
    torch.testing.assert_close(got["rewards"], expected)
    assert torch.nonzero(got["skipped"]).flatten().tolist() == [2, 5, 13]
    assert torch.nonzero(got["reward/holes"].isnan()).flatten().tolist() == [2, 5, 13]
    r = cli("score.py", *base, "--reward", "flaky_mod:boom", "exact_answer")
    assert r.code == 0, r.err
    got = load_file(tmp_path / "r.safetensors")
    assert bool(got["reward/boom"].isnan().all()) and bool(got["skipped"].all())
    assert torch.equal(got["rewards"], torch.zeros(16))


def test_skipped_rows_take_no_part_in_the_length_reward_correlation():
    lengths, rewards = torch.tensor([1, 2, 3, 100]), torch.tensor([1.0, 2.0, 3.0, 0.0])
    assert diagnostics.length_stats(lengths, rewards, 4)["length_reward_corr"] < 0
    skipped = torch.tensor([False, False, False, True])
    assert diagnostics.length_stats(lengths, rewards, 4, skipped)["length_reward_corr"] == pytest.approx(1.0)
