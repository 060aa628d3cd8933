"""The off-policy correction between the trainer's π_old and the distribution the sampler drew from
(--rollout-is): the weights and the mismatch metrics against hand-computed vectors, the reweighed
policy term, and the stages through their command lines (a truncated sampler writes
sampler_logprobs, update.py reweighs with them, and refuses to without them)."""

import json
import math

import pytest
import torch
from conftest import assert_user_error, cli, token_loss_terms
from safetensors.torch import load_file

import update
from grpo.disk import files
from grpo.loop import diagnostics

# π_old(o_t) and q(o_t) of three tokens: w = π_old/q = 2, 0.5 and 10.
OLD, Q = torch.tensor([[0.5, 0.2, 0.1]]), torch.tensor([[0.25, 0.4, 0.01]])


def test_weights_truncated_and_masked_at_the_cap():
    tis = update.rollout_is_weights(OLD.log(), Q.log(), "tis", 3.0)
    mis = update.rollout_is_weights(OLD.log(), Q.log(), "mis", 3.0)
    torch.testing.assert_close(tis, torch.tensor([[2.0, 0.5, 3.0]]))
    torch.testing.assert_close(mis, torch.tensor([[2.0, 0.5, 0.0]]))


def test_the_weight_multiplies_the_policy_term_alone():
    # ρ = 1 (θ = θ_old), A = 1: pg_t = −1, so ℓ_t = −w_t + β·k3_t, and k3 = e^{0.1} − 0.1 − 1 per token.
    logp, mask = OLD.log(), torch.ones(1, 3, dtype=torch.bool)
    ref = logp + 0.1
    w = torch.tensor([[2.0, 0.5, 0.0]])
    loss, terms = token_loss_terms(logp, logp, ref, torch.ones(1), mask, beta=0.5, clip_eps=0.2,
                                         clip_eps_high=0.2, is_weight=w)
    k3 = math.exp(0.1) - 0.1 - 1
    torch.testing.assert_close(loss, -w + 0.5 * k3)
    torch.testing.assert_close(terms["pg_loss"], -w)


def test_the_mismatch_metrics_against_a_hand_computation():
    rollouts = {"old_logprobs": torch.cat([OLD.log(), torch.zeros(1, 3)]),
                "sampler_logprobs": torch.cat([Q.log(), torch.zeros(1, 3)]),
                "completion_mask": torch.tensor([[True] * 3, [False] * 3])}          # row 1: padding only
    m = diagnostics.rollout_mismatch(rollouts, 3.0)
    r = [2.0, 0.5, 10.0]
    assert m["rollout_is_diff_mean"] == pytest.approx(sum(abs(math.log(x)) for x in r) / 3)
    assert m["rollout_is_diff_max"] == pytest.approx(math.log(10.0))
    assert m["rollout_is_kl"] == pytest.approx(-sum(math.log(x) for x in r) / 3)
    assert m["rollout_is_beyond_cap"] == pytest.approx(1 / 3)


# A vocabulary of 4: π_old, and two distributions q that drew the tokens. Truncated: top-2 renormalised,
# which kept Z = 0.7 of the mass, so r = π_old/q = 0.7 on every kept token and E_q[r] = Z, not 1. Full:
# uniform over the four, where E_q[r] = Σ π_old = 1.
PI_OLD = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
Q_TOP2 = torch.tensor([0.4, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.7
Q_FULL = torch.full((4,), 0.25, dtype=torch.float64)


@pytest.mark.parametrize("q, tokens, k3_agrees", [
    (Q_TOP2, [0, 0, 0, 0, 1, 1, 1], False),      # frequencies 4/7 and 3/7: q's own
    (Q_FULL, [0, 1, 2, 3], True),                # each token once: q's own
])
def test_the_kl_estimate_is_kl_q_to_pi_old_under_truncation_too(q, tokens, k3_agrees):
    """Tokens whose empirical frequencies are q's make the sample mean an expectation under q, so the
    logged estimate must equal KL(q‖π_old) = Σ_v q_v log(q_v/π_old,v): −log Z = log(1/0.7) for top-2.
    k3's mean is E_q[r] − 1 + KL, right only where E_q[r] = 1 (the full q), Z − 1 − log Z = 0.057 for
    top-2 against 0.357."""
    kept = q > 0
    kl = (q[kept] * (q[kept] / PI_OLD[kept]).log()).sum().item()
    if not k3_agrees:
        assert kl == pytest.approx(math.log(1 / 0.7))
    ids = torch.tensor([tokens])
    rollouts = {"old_logprobs": PI_OLD.log()[ids].float(), "sampler_logprobs": q.log()[ids].float(),
                "completion_mask": torch.ones_like(ids, dtype=torch.bool)}                    # [1, T]
    m = diagnostics.rollout_mismatch(rollouts, 2.0)
    assert m["rollout_is_kl"] == pytest.approx(kl, rel=1e-6)
    r = (PI_OLD[ids] / q[ids]).flatten()                                                      # [T]
    k3 = (r - 1 - r.log()).mean().item()                                                      # the old formula
    assert (k3 == pytest.approx(kl, rel=1e-6)) == k3_agrees, (k3, kl)


def advantages_for(roll, path, advantages):
    """An advantages file for the rows of `roll`, written by the project's writer (made from nothing:
    the updates below pass --allow-mismatch)."""
    files.save_tensors(str(path), {"advantages": advantages, "group_ids": roll["group_ids"]},
                       files.ADVANTAGES[0], {})
    return path


@pytest.fixture(scope="module")
def truncated(models, prompts_file, tmp_path_factory):
    """A top-k sample (so with sampler_logprobs) and advantages for it."""
    out = tmp_path_factory.mktemp("topk")
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out, "--group-size", 4,
            "--num-prompts", 2, "--max-new-tokens", 8, "--temperature", 1.0, "--top-k", 4, "--seed", 5)
    assert r.code == 0, r.err
    roll = load_file(out / "rollouts.safetensors")
    assert roll["sampler_logprobs"].shape == roll["old_logprobs"].shape
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.0])
    advantages_for(roll, out / "a.safetensors", advantages)
    return out, roll, advantages


def update_metrics(models, truncated, tmp_path, *flags):
    out, _, _ = truncated
    r = cli("update.py", "--model", models["policy"], "--rollouts", out / "rollouts.safetensors", "--advantages",
            out / "a.safetensors", "--out", tmp_path / "p", "--beta", 0, "--lr", 1e-3, "--allow-mismatch", *flags)
    assert r.code == 0, r.err
    return json.load(open(tmp_path / "p" / "metrics.json"))


def test_update_reweighs_the_policy_term_by_the_truncated_weights(models, truncated, tmp_path):
    """One step at θ = θ_old: the policy loss is −mean_i A_i · mean_t w_t (--loss-agg seq), with w the
    tis weights of the file's log-probs; the mismatch is logged whatever the mode."""
    _, roll, A = truncated
    mask = roll["completion_mask"]
    w = update.rollout_is_weights(roll["old_logprobs"], roll["sampler_logprobs"], "tis", 1.2)
    expected = -(A * (w * mask).sum(-1) / mask.sum(-1)).mean().item()
    m = update_metrics(models, truncated, tmp_path, "--rollout-is", "tis", "--rollout-is-cap", 1.2)
    assert m["policy_loss"] == pytest.approx(expected, abs=1e-5)
    # q renormalises what top-k kept, so q ≥ π_old and w ≤ 1 for every token: the cap never binds here,
    # and the weights below 1 are the correction (the tiny vocabulary leaves mass outside the top 4).
    assert m["rollout_is_beyond_cap"] == 0.0 and m["rollout_is_diff_max"] > 0.01
    assert (w[mask] <= 1 + 1e-6).all() and (w[mask] < 0.99).any()
    plain = update_metrics(models, truncated, tmp_path / "none")
    assert plain["policy_loss"] == pytest.approx(-(A * 1.0).mean().item(), abs=1e-5)  # w = 1 everywhere
    assert plain["rollout_is_kl"] == pytest.approx(m["rollout_is_kl"])


def test_masked_weights_beyond_the_cap_move_nothing(models, truncated, tmp_path):
    """A file whose q is e⁻⁵ of π_old puts every token's weight at e⁵, beyond the cap: --rollout-is mis
    zeroes the policy term, and with β = 0 no weight moves."""
    out, roll, _ = truncated
    far = tmp_path / "far.safetensors"
    files.save_tensors(str(far), {**roll, "sampler_logprobs": roll["old_logprobs"] - 5.0}, files.ROLLOUTS[0], {})
    r = cli("update.py", "--model", models["policy"], "--rollouts", far, "--advantages", out / "a.safetensors",
            "--out", tmp_path / "p", "--beta", 0, "--lr", 1e-3, "--allow-mismatch", "--rollout-is", "mis",
            "--rollout-is-cap", 2)
    assert r.code == 0, r.err
    m = json.load(open(tmp_path / "p" / "metrics.json"))
    assert m["rollout_is_beyond_cap"] == 1.0 and m["policy_loss"] == 0.0 and m["grad_norm"] == 0.0
    before, after = load_file(models["policy"] + "/model.safetensors"), load_file(tmp_path / "p" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_rollout_is_needs_the_samplers_log_probs(models, rollout_dir, tmp_path):
    roll = load_file(rollout_dir / "rollouts.safetensors")
    assert "sampler_logprobs" not in roll                                 # untruncated sampling writes none
    advantages = advantages_for(roll, tmp_path / "a.safetensors", torch.zeros(len(roll["group_ids"])))
    r = cli("update.py", "--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors",
            "--advantages", advantages, "--out", tmp_path / "p", "--allow-mismatch", "--rollout-is", "tis")
    assert_user_error(r, "rollouts.safetensors", "--rollout-is tis", "sampler_logprobs")
    assert not (tmp_path / "p").exists()
    r = cli("train.py", "--config", "tiny", "--rollout-is", "tis", "--run-dir", tmp_path / "run")
    assert_user_error(r, "--rollout-is tis", "--top-k")
    assert not (tmp_path / "run").exists()
