"""The variants papers compare, each through its command line against a hand-computed vector.

The rollouts are built from the tiny policy itself: log π_old = log π_θ − ln ρ with chosen ratios
ρ, and log π_ref = log π_θ + ln 2, so that every term of the loss is known by hand. Three
completions: row 0 (A = +1) has ρ = 1.5, 0.5, 1.0; row 1 (A = −2) has ρ = 0.5, 1.5 and a padded
slot; row 2 (A = −1) is one token long with ρ = 4. Prompts have different lengths (left padding).
"""

import json
import math
import os
import statistics

import pytest
import torch
from conftest import assert_user_error, cli
from safetensors.torch import load_file, save_file

from grpo.models import loading, modeling

LN2 = math.log(2.0)
K1, K2, K3 = -LN2, LN2 ** 2 / 2, 2.0 - LN2 - 1.0     # x = log π_ref − log π_θ = ln 2
BETA = 0.1


@pytest.fixture(scope="module")
def hand_files(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("variants")
    tok = loading.load_tokenizer(models["policy"])
    prompts = [tok(p)["input_ids"] for p in ["1+1=", "What is 12 plus 30?", "7?"]]
    P = max(map(len, prompts))
    prompt_ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])           # [3, P]
    prompt_mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    completion_ids = torch.tensor([tok("42.")["input_ids"], tok("ok")["input_ids"] + [tok.pad_token_id],
                                   tok("9")["input_ids"] + [tok.pad_token_id] * 2])             # [3, 3]
    completion_mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    policy = loading.load_model(models["policy"], "cpu")
    with torch.no_grad():
        logp = modeling.completion_logprobs(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0)
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0], [4.0, 1.0, 1.0]])
    torch.save(logp, d / "logp.pt")
    rollouts = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "group_ids": torch.tensor([0, 0, 0]),
        "old_logprobs": ((logp - ratio.log()) * completion_mask).float(),
        "ref_logprobs": ((logp + LN2) * completion_mask).float(), "truncated": torch.tensor([False, False, False]),
    }
    save_file(rollouts, str(d / "rollouts.safetensors"),
              metadata={"schema": "rollouts/1", "args": json.dumps({"temperature": 1.0, "max_new_tokens": 4})})
    save_file({"advantages": torch.tensor([1.0, -2.0, -1.0]), "group_ids": torch.tensor([0, 0, 0])},
              str(d / "advantages.safetensors"))
    return d


# Policy terms per token, −min(ρA, clip(ρ)A), with ε = 0.2:
#   row 0: −1.2 (clipped high), −0.5, −1.0     row 1: 1.6 (clipped low), 3.0     row 2: 4.0 (−min(−4, −1.2))
# seq: ((−2.7)/3 + 4.6/2 + 4.0)/3 = 1.8; token: (−2.7 + 4.6 + 4.0)/6; dr_grpo: 5.9/(3 × L_max = 4)
CASES = {
    "seq": ([], 1.8 + BETA * K3),
    "token": (["--loss-agg", "token"], 5.9 / 6 + BETA * K3),
    "dr_grpo": (["--loss-agg", "dr_grpo"], (5.9 + 6 * BETA * K3) / 12),
    # clip-higher: row 0's first token is clipped at 1.28 instead: row 0 mean (−1.28 − 0.5 − 1.0)/3.
    "clip_higher": (["--clip-eps-high", 0.28], ((-2.78) / 3 + 2.3 + 4.0) / 3 + BETA * K3),
    # dual clip C = 3: row 2's loss 4.0 with A = −1 is capped at 3·|A| = 3.
    "dual_clip": (["--policy-loss", "dual_clip", "--dual-clip", 3], ((-2.7) / 3 + 2.3 + 3.0) / 3 + BETA * K3),
    # GSPO: one ratio per completion, exp(mean log ρ): 0.75^(1/3), 0.75^(1/2), 4 -> policy terms
    # −0.908560 (inside the clip), +1.732051 (0.866 is inside [0.8, 1.2]), +4.0 (−min(−4, −1.2)).
    "gspo": (["--policy-loss", "gspo"], (-(0.75 ** (1 / 3)) + 2 * 0.75 ** 0.5 + 4.0) / 3 + BETA * K3),
    "k1": (["--kl-estimator", "k1"], 1.8 + BETA * K1),
    "k2": (["--kl-estimator", "k2"], 1.8 + BETA * K2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_variant_hand_vector(models, hand_files, tmp_path, case):
    flags, expected = CASES[case]
    out = tmp_path / "out"
    r = cli("update.py", "--model", models["policy"], "--rollouts", hand_files / "rollouts.safetensors",
            "--advantages", hand_files / "advantages.safetensors", "--out", out, "--beta", BETA, *flags)
    assert r.code == 0, r.err
    m = json.loads((out / "metrics.json").read_text())
    assert m["loss"] == pytest.approx(expected, abs=1e-5)
    assert m["kl"] == pytest.approx(K3, abs=1e-5)                 # metrics.json's kl is k3 whatever the estimator
    if case == "seq":
        assert m["clip_frac_high"] == pytest.approx(1 / 6) and m["clip_frac_low"] == pytest.approx(1 / 6)
        assert m["clip_frac"] == pytest.approx(2 / 6) and m["ratio_max"] == pytest.approx(4.0, rel=1e-5)
    if case == "dual_clip":
        assert m["clip_frac_dual"] == pytest.approx(1 / 6)
    if case == "k1":
        assert m["kl_penalty"] == pytest.approx(K1, abs=1e-5)


def test_cispo_through_the_command_line(models, hand_files, tmp_path):
    """CISPO's ℓ_t = −clip(ρ_t, 0.8, 1.2)·A·log π_θ(o_t) from the policy's own log-probs: weights 1.2, 0.8,
    1.0 (row 0, A = +1), 0.8, 1.2 (row 1, A = −2), 1.2 (row 2, A = −1); the seq mean plus β·k3. Every
    ratio outside the band is counted clipped, whatever the sign of A (5 of 6 tokens)."""
    logp = torch.load(hand_files / "logp.pt")                                            # [3, 3]
    w = torch.tensor([[1.2, 0.8, 1.0], [0.8, 1.2, 1.0], [1.2, 1.0, 1.0]])
    A = torch.tensor([[1.0], [-2.0], [-1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    pg = -w * A * logp                                                                     # [3, 3]
    expected = sum((pg[i][mask[i]].mean() for i in range(3))).item() / 3 + BETA * K3
    out = tmp_path / "out"
    r = cli("update.py", "--model", models["policy"], "--rollouts", hand_files / "rollouts.safetensors",
            "--advantages", hand_files / "advantages.safetensors", "--out", out, "--beta", BETA,
            "--policy-loss", "cispo")
    assert r.code == 0, r.err
    m = json.loads((out / "metrics.json").read_text())
    assert m["loss"] == pytest.approx(expected, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(5 / 6) and m["clip_frac_dual"] == 0
    assert "keep their gradient" in r.err                    # ratios outside the band on-policy: warned


def test_variant_flag_errors(models, hand_files, tmp_path):
    args = ["--model", models["policy"], "--rollouts", hand_files / "rollouts.safetensors",
            "--advantages", hand_files / "advantages.safetensors", "--out", tmp_path / "out"]
    assert_user_error(cli("update.py", *args, "--policy-loss", "dual_clip", "--dual-clip", 0.5), "--dual-clip")
    assert_user_error(cli("update.py", *args, "--dual-clip", 3), "--dual-clip", "--policy-loss dual_clip")
    assert_user_error(cli("update.py", *args, "--kl-estimator", "k4"), "--kl-estimator")
    assert_user_error(cli("update.py", *args, "--policy-loss", "grpo"), "--policy-loss")


def test_estimators_through_the_command_line(tmp_path):
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0]
    save_file({"rewards": torch.tensor(rewards), "group_ids": torch.arange(3).repeat_interleave(4)},
              str(tmp_path / "r.safetensors"))

    def run(estimator):
        out = tmp_path / f"{estimator}.safetensors"
        r = cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", out, "--estimator", estimator)
        assert r.code == 0, r.err
        return load_file(out)["advantages"]

    # dr_grpo: r − group mean (0.5, 2, 0.75), no std.
    torch.testing.assert_close(run("dr_grpo"), torch.tensor([.5, -.5, -.5, .5, 0, 0, 0, 0, -.75, -.75, -.75, 2.25]))
    # batch: one z-score over all twelve rewards, groups ignored (the all-equal group is no longer 0).
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    torch.testing.assert_close(run("batch"), torch.tensor([(r - mean) / (std + 1e-4) for r in rewards]))


def test_overlong_reward_shaping(tmp_path):
    # L_max = 8 (rollouts' metadata), L = 4: 0 up to 4 tokens, then −0.25 per token, −1 at 8.
    lengths = [2, 4, 6, 7, 8, 5]
    mask = torch.tensor([[j < n for j in range(8)] for n in lengths])
    save_file({"group_ids": torch.tensor([0, 0, 0, 1, 1, 1]), "completion_mask": mask,
               "completion_ids": torch.zeros(6, 8, dtype=torch.int64)}, str(tmp_path / "rollouts.safetensors"),
              metadata={"args": json.dumps({"max_new_tokens": 8})})
    (tmp_path / "samples.jsonl").write_text("".join(
        json.dumps({"prompt": "q", "completion": "the answer is 5", "answer": "5"}) + "\n" for _ in lengths))
    out = tmp_path / "rewards.safetensors"
    r = cli("score.py", "--rollouts", tmp_path / "rollouts.safetensors", "--samples", tmp_path / "samples.jsonl",
            "--reward", "exact_answer", "--overlong-buffer", 4, "--out", out)
    assert r.code == 0, r.err
    got = load_file(out)
    expected = torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, -0.25])
    torch.testing.assert_close(got["reward/overlong"], expected)
    torch.testing.assert_close(got["rewards"], 1.0 + expected)
    assert_user_error(cli("score.py", "--rollouts", tmp_path / "rollouts.safetensors", "--samples",
                          tmp_path / "samples.jsonl", "--reward", "exact_answer", "--overlong-buffer", 9,
                          "--out", tmp_path / "x.safetensors"), "--overlong-buffer")


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "batch"])
def test_tiny_run_learns_with_each_estimator(tmp_path, estimator):
    r = cli("train.py", "--config", "tiny", "--run-dir", tmp_path / "run", "--estimator", estimator)
    assert r.code == 0, r.err
    rewards = [json.loads((tmp_path / "run" / f"iter_{i:04d}" / "metrics.json").read_text())["charts/reward_mean"]
               for i in range(30)]
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.25, rewards


def test_dapo_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    reward = os.path.join(os.path.dirname(__file__), "rewards_for_tests.py") + ":digits_in_even_groups"
    run = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--run-dir", run, "--iterations", 1, "--reward", reward,
            "--dynamic-sampling", "--max-sample-rounds", 4)
    assert r.code == 0, r.err
    m = json.loads((run / "iter_0000" / "metrics.json").read_text())
    assert m["charts/sample_rounds"] >= 2                         # odd groups never count: one round is not enough
    it = run / "iter_0000"
    rollouts, rewards = load_file(it / "rollouts.safetensors"), load_file(it / "rewards.safetensors")
    kept = m["charts/informative_groups"]
    assert rollouts["group_ids"].tolist() == [g for g in range(8) for _ in range(8)]
    grouped = rewards["rewards"].reshape(8, 8)
    assert (grouped.max(1).values > grouped.min(1).values).sum() == kept
    assert kept == 8 or m["charts/sample_rounds"] == 4
    # Rows merged from several rounds were re-padded: their log-probs still match the model that sampled them.
    base = loading.load_model(str(run / "base_model"), "cpu")
    with torch.no_grad():
        logp = modeling.completion_logprobs(base, rollouts["prompt_ids"], rollouts["prompt_mask"],
                                          rollouts["completion_ids"], rollouts["completion_mask"], 1.0)
    torch.testing.assert_close(logp, rollouts["old_logprobs"], atol=2e-4, rtol=0)
    samples = [json.loads(line) for line in open(it / "samples.jsonl")]
    assert [s["group"] for s in samples] == rollouts["group_ids"].tolist()
