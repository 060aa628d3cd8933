"""The knobs recent GRPO papers turn (--old-logprobs, --kl-estimator's gradients, the bounded k3,
--scale, --mask-truncated, --entropy-coef, --lr-schedule), each against a hand-computed value."""

import json
import math
import shutil

import pytest
import torch
from conftest import assert_user_error, cli, token_loss_terms
from safetensors.torch import load_file, save_file
from test_train import assert_same_weights
from test_update import hand_batch, rollouts_of, run_update
from test_variants import BETA, K3, hand_files  # noqa: F401  (a fixture)

import update
from grpo.disk import files
from grpo.training import optim


def update_args(*flags):
    return update.parse_args(["--model", "m", "--rollouts", "r", "--advantages", "a", "--out", "o",
                              *map(str, flags)])


# ----------------------------------------------------------------------------------------
# The KL term

@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_expected_gradient_of_each_kl_estimator(estimator):
    """On-policy (o ~ π_θ, every category weighted by its probability, exactly), the estimators'
    expected gradients are 0 (k1), ∇KL(π_θ‖π_ref) (k2) and ∇KL(π_ref‖π_θ) (k3)."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)                                        # [V], each category a row
    _, terms = token_loss_terms(logp[:, None], logp[:, None].detach(), log_ref[:, None],
                                      torch.zeros(6, dtype=torch.float64), torch.ones(6, 1, dtype=torch.bool),
                                      beta=1.0, clip_eps=0.2, clip_eps_high=0.2, kl_estimator=estimator)
    penalty = terms["kl_penalty"][:, 0]                                      # [V]
    (grad,) = torch.autograd.grad((logp.exp().detach() * penalty).sum(), theta, retain_graph=True)
    p, ref = logp.exp(), log_ref.exp()
    if estimator == "k1":
        expected = torch.zeros(6, dtype=torch.float64)
        (one_sample,) = torch.autograd.grad(penalty[0], theta)   # a single sample's gradient is not 0
        assert one_sample.abs().max() > 0.1
    else:
        kl = (p * (logp - log_ref)).sum() if estimator == "k2" else (ref * (log_ref - logp)).sum()
        (expected,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-9)


def test_k3_is_bounded_and_beta_zero_adds_no_penalty():
    logp, old, ref, adv, mask = hand_batch()
    far = logp + 100.0                                           # e^100 overflows float32
    loss, terms = token_loss_terms(logp, old, far, adv, mask, beta=0.0, clip_eps=0.2, clip_eps_high=0.2)
    assert torch.equal(loss, terms["pg_loss"])                   # β = 0: no penalty term, no NaN
    loss, terms = token_loss_terms(logp, old, far, adv, mask, beta=0.1, clip_eps=0.2, clip_eps_high=0.2)
    torch.testing.assert_close(terms["kl"], torch.full((2, 3), math.exp(20) - 21))    # x clamped to 20
    assert torch.isfinite(loss).all()


def test_an_update_with_beta_zero_and_a_far_reference_takes_its_steps(models, rollout_dir):
    rollouts = rollouts_of(rollout_dir)
    rollouts["ref_logprobs"] = rollouts["old_logprobs"] + 100.0 * rollouts["completion_mask"]
    adv = torch.linspace(-1, 1, rollouts["group_ids"].numel())
    _, m = run_update(models["policy"], rollouts, adv, beta=0.0, minibatch_size=8)
    assert m["skipped_steps"] == 0 and m["optimizer_steps"] == 2 and math.isfinite(m["loss"])


def test_k1_in_the_loss_is_warned_about(models, hand_files, tmp_path):  # noqa: F811
    r = cli("update.py", "--model", models["policy"], "--rollouts", hand_files / "rollouts.safetensors",
            "--advantages", hand_files / "advantages.safetensors", "--out", tmp_path / "o",
            "--kl-estimator", "k1")
    assert r.code == 0 and "k1 in the loss: its expected gradient on-policy is 0" in r.err


# ----------------------------------------------------------------------------------------
# What the loss covers

def hand_update(models, hand_files, tmp_path, *flags, truncated=None):  # noqa: F811
    rollouts_file = hand_files / "rollouts.safetensors"
    if truncated is not None:
        rollouts = load_file(rollouts_file)
        rollouts["truncated"] = torch.tensor(truncated)
        rollouts_file = tmp_path / "rollouts.safetensors"
        save_file(rollouts, str(rollouts_file), metadata={"schema": "rollouts/1",
                                                          "args": json.dumps({"temperature": 1.0})})
    out = tmp_path / "out"
    r = cli("update.py", "--model", models["policy"], "--rollouts", rollouts_file, "--advantages",
            hand_files / "advantages.safetensors", "--out", out, "--beta", BETA, *flags)
    assert r.code == 0, r.err
    return json.loads((out / "metrics.json").read_text())


def test_mask_truncated_drops_the_truncated_completions(models, hand_files, tmp_path):  # noqa: F811
    # Row 1 (policy terms 1.6 and 3.0) is truncated: seq = ((−2.7)/3 + 0 + 4.0)/3, β·k3 on 2 rows of 3.
    m = hand_update(models, hand_files, tmp_path, "--mask-truncated", truncated=[False, True, False])
    assert m["loss"] == pytest.approx((-0.9 + 4.0) / 3 + BETA * K3 * 2 / 3, abs=1e-5)
    assert m["tokens"] == 4
    m = hand_update(models, hand_files, tmp_path, truncated=[False, True, False])      # the flag is off
    assert m["loss"] == pytest.approx(1.8 + BETA * K3, abs=1e-5) and m["tokens"] == 6


def test_entropy_coef_subtracts_c_times_the_mean_entropy(models, hand_files, tmp_path):  # noqa: F811
    base = hand_update(models, hand_files, tmp_path, "--loss-agg", "token")
    m = hand_update(models, hand_files, tmp_path, "--loss-agg", "token", "--entropy-coef", 0.5)
    assert base["loss"] == pytest.approx(5.9 / 6 + BETA * K3, abs=1e-5)
    assert m["loss"] == pytest.approx(base["loss"] - 0.5 * base["entropy"], abs=1e-5)


def test_the_entropy_bonus_has_a_gradient_and_the_metric_has_none():
    from grpo.models.modeling import logprobs_from_logits

    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    _, entropy = logprobs_from_logits(logits, tokens, 1.0, with_entropy=True, entropy_grad=True)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    assert grad.abs().sum() > 0
    assert not logprobs_from_logits(logits, tokens, 1.0, with_entropy=True)[1].requires_grad


# ----------------------------------------------------------------------------------------
# π_old from the sampler, or recomputed

def test_old_logprobs_default_is_the_sampler_on_a_cpu():
    assert update_args().old_logprobs == "sampler"
    assert update_args("--old-logprobs", "recompute").old_logprobs == "recompute"


def test_a_rounding_mismatch_outside_gspos_band_is_warned_and_recompute_removes_it(models, rollout_dir, tmp_path):
    """A sampler whose log-probs differ from the update's by ±0.003 (bf16-like rounding) puts whole
    sequences outside GSPO's band of 3e-4: the first step gives them no gradient."""
    rollouts = load_file(rollout_dir / "rollouts.safetensors")
    mask = rollouts["completion_mask"]
    offset = torch.where(torch.arange(mask.shape[0])[:, None] % 2 == 0, 0.003, -0.003)   # [N, 1]
    rollouts["old_logprobs"] = (rollouts["old_logprobs"] + offset) * mask
    save_file(rollouts, str(tmp_path / "rollouts.safetensors"),
              metadata={"schema": "rollouts/1", "args": json.dumps({"temperature": 0.7})})
    groups = rollouts["group_ids"]
    save_file({"advantages": torch.linspace(-1, 1, len(groups)), "group_ids": groups},
              str(tmp_path / "advantages.safetensors"))
    flags = ["--model", models["policy"], "--rollouts", tmp_path / "rollouts.safetensors", "--advantages",
             tmp_path / "advantages.safetensors", "--policy-loss", "gspo", "--clip-eps", 3e-4,
             "--clip-eps-high", 4e-4]
    r = cli("update.py", *flags, "--out", tmp_path / "a")
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert r.code == 0 and "--old-logprobs recompute" in r.err, r.err
    assert m["outside_clip_on_policy"] == 1.0 and m["clip_frac"] > 0.4
    r = cli("update.py", *flags, "--out", tmp_path / "b", "--old-logprobs", "recompute")
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert r.code == 0 and "--old-logprobs" not in r.err, r.err
    assert m["outside_clip_on_policy"] == 0.0 and m["clip_frac"] == 0.0 and m["logprob_diff_max"] < 1e-5
    assert args_of(tmp_path / "b")["old_logprobs"] == "recompute"


def args_of(out):
    return files.load_tensors(str(out / "optimizer.safetensors"), ("optimizer/1", {}))[1]


# ----------------------------------------------------------------------------------------
# Reward scaling

def test_scale_group_batch_none(tmp_path):
    save_file({"rewards": torch.tensor([0.0, 1.0, 2.0, 3.0]), "group_ids": torch.tensor([0, 0, 1, 1])},
              str(tmp_path / "r.safetensors"))

    def run(*flags):
        out = tmp_path / "a.safetensors"
        r = cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", out, *flags)
        assert r.code == 0, r.err
        return load_file(out)["advantages"]

    half = torch.tensor([-0.5, 0.5, -0.5, 0.5])                  # r − group mean
    torch.testing.assert_close(run(), half / (math.sqrt(0.5) + 1e-4))                       # group std
    torch.testing.assert_close(run("--scale", "batch"), half / (math.sqrt(5 / 3) + 1e-4))   # std of 0..3
    torch.testing.assert_close(run("--scale", "none"), half)
    torch.testing.assert_close(run("--scale", "none"), run("--estimator", "dr_grpo"))
    assert_user_error(cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", tmp_path / "x",
                          "--estimator", "rloo", "--scale", "batch"), "--scale batch", "grpo")


# ----------------------------------------------------------------------------------------
# Learning-rate schedule

def test_schedule_hand_values():
    assert [optim.scheduled_lr(s, 1.0, warmup_steps=2, schedule="cosine", total_steps=6) for s in range(6)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))])
    assert [optim.scheduled_lr(s, 1.0, schedule="linear", total_steps=4) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert optim.scheduled_lr(99, 0.3) == 0.3
    with pytest.raises(Exception, match="--total-steps"):
        update_args("--lr-schedule", "linear")


def test_train_schedule_by_adamw_step_and_exact_resume(tmp_path):
    flags = ["--config", "tiny", "--iterations", 4, "--save-every", 2, "--eval-every", 0,
             "--lr-schedule", "cosine", "--warmup-steps", 1]
    assert cli("train.py", *flags, "--run-dir", tmp_path / "straight").code == 0
    lrs = [json.loads((tmp_path / "straight" / f"iter_{i:04d}" / "metrics.json").read_text())["losses/lr"]
           for i in range(4)]
    assert lrs == pytest.approx([3e-3 * x for x in (1.0, 1.0, 0.75, 0.25)])   # warm-up 1 of 4 steps, cosine
    # A run stopped after its save at 2 iterations: the kept checkpoint is that save, train_state.json included.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed)
    shutil.rmtree(resumed / "policy")
    shutil.copytree(resumed / "checkpoints" / "iter_0002", resumed / "policy")
    assert_user_error(cli("train.py", "--run-dir", resumed, "--resume", "--iterations", 6), "--iterations")
    assert cli("train.py", "--run-dir", resumed, "--resume").code == 0
    assert json.loads((resumed / "iter_0003" / "metrics.json").read_text())["losses/lr"] == pytest.approx(lrs[3])
    assert_same_weights(tmp_path / "straight" / "policy", resumed / "policy")
