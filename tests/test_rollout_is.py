"""The off-policy correction between the trainer's π_old and the distribution the sampler drew from
(--rollout-is, per token or per completion with --rollout-is-level): the weights and the mismatch
metrics against hand-computed vectors, the reweighed policy term, and the stages through their
command lines (a truncated sampler writes sampler_logprobs, update.py reweighs with them, and
refuses to without them)."""

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


# Two completions for --rollout-is-level sequence: row 0 the three tokens above (w_i = 2·0.5·10 = 10),
# row 1 two tokens of w_t = 0.5 and 1.5 (w_i = 0.75) and a padding token whose w_t = 9 must not count.
OLD2 = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.6, 0.9]])
Q2 = torch.tensor([[0.25, 0.4, 0.01], [0.6, 0.4, 0.1]])
MASK2 = torch.tensor([[True, True, True], [True, True, False]])


def old_token_weights(old_logp, sampler_logp, mode, cap):
    """rollout_is_weights as it was before --rollout-is-level, which the token level must be to the bit."""
    w = torch.exp(old_logp - sampler_logp)
    return w.clamp(max=cap) if mode == "tis" else torch.where(w <= cap, w, 0.0)


def test_the_sequence_weight_is_the_product_of_the_token_weights_over_the_completion():
    def weights(mode, cap):
        return update.rollout_is_weights(OLD2.log(), Q2.log(), mode, cap, "sequence", MASK2)
    product = torch.tensor([[10.0] * 3, [0.75] * 3])                      # w_i along T [2, 3]
    torch.testing.assert_close(weights("tis", 12.0), product)             # the cap does not bind
    torch.testing.assert_close(weights("mis", 12.0), product)
    torch.testing.assert_close(weights("tis", 3.0), torch.tensor([[3.0] * 3, [0.75] * 3]))
    torch.testing.assert_close(weights("mis", 3.0), torch.tensor([[0.0] * 3, [0.75] * 3]))   # row 0 leaves
    assert weights("tis", 3.0).dtype == torch.float32


def test_every_weight_is_one_when_the_sampler_drew_from_pi_old():
    logp = torch.log_softmax(torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(0)), -1)[..., 0]
    mask = torch.arange(6) < torch.tensor([[6], [3], [1], [5]])                                  # [4, 6]
    for level in ("token", "sequence"):
        for mode in ("tis", "mis"):
            w = update.rollout_is_weights(logp, logp.clone(), mode, 2.0, level, mask)
            assert torch.equal(w, torch.ones(4, 6)), (level, mode)


def test_the_token_level_is_the_old_weight_to_the_bit():
    g = torch.Generator().manual_seed(1)
    old_logp = -5 * torch.rand(8, 16, generator=g)
    sampler_logp = -5 * torch.rand(8, 16, generator=g)
    sampler_logp[0, :3] = old_logp[0, :3] - 100.0                          # e^100: float32's exp overflows
    mask = torch.rand(8, 16, generator=g) < 0.8
    for mode, cap in (("tis", 2.0), ("mis", 2.0), ("tis", 1.3), ("mis", 5.0)):
        expected = old_token_weights(old_logp, sampler_logp, mode, cap)
        assert torch.equal(update.rollout_is_weights(old_logp, sampler_logp, mode, cap), expected)
        assert torch.equal(update.rollout_is_weights(old_logp, sampler_logp, mode, cap, "token", mask), expected)
    torch.testing.assert_close(update.rollout_is_weights(OLD.log(), Q.log(), "tis", 3.0, "token"),
                               torch.tensor([[2.0, 0.5, 3.0]]))


def test_a_sequence_weight_beyond_floats_range_is_capped_or_zero_never_nan():
    old_logp = torch.zeros(2, 100)
    sampler_logp = torch.stack([torch.full((100,), -10.0), torch.full((100,), 10.0)])   # Σ log w_t = ±1000
    mask = torch.ones(2, 100, dtype=torch.bool)
    tis = update.rollout_is_weights(old_logp, sampler_logp, "tis", 2.0, "sequence", mask)
    mis = update.rollout_is_weights(old_logp, sampler_logp, "mis", 2.0, "sequence", mask)
    assert torch.equal(tis, torch.stack([torch.full((100,), 2.0), torch.zeros(100)]))
    assert torch.equal(mis, torch.zeros(2, 100))
    assert torch.isfinite(mis * torch.zeros(2, 100)).all()                # 0·w: no NaN in the policy term


def test_the_weight_metrics_at_each_level_against_a_hand_computation():
    rollouts = {"old_logprobs": OLD2.log(), "sampler_logprobs": Q2.log(), "completion_mask": MASK2}
    token = diagnostics.rollout_mismatch(rollouts, 3.0, "token")          # w_t: 2, 0.5, 10, 0.5, 1.5
    assert token["rollout_is_weight_mean"] == pytest.approx(14.5 / 5)
    assert token["rollout_is_weight_max"] == pytest.approx(10.0)
    assert token["rollout_is_weight_beyond_cap"] == pytest.approx(1 / 5) == token["rollout_is_beyond_cap"]
    seq = diagnostics.rollout_mismatch(rollouts, 3.0, "sequence")         # w_i: 10, 0.75
    assert seq["rollout_is_weight_mean"] == pytest.approx(10.75 / 2)
    assert seq["rollout_is_weight_max"] == pytest.approx(10.0)
    assert seq["rollout_is_weight_beyond_cap"] == pytest.approx(1 / 2)
    assert seq["rollout_is_beyond_cap"] == token["rollout_is_beyond_cap"]  # the token share, whatever the level


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


def test_update_reweighs_each_completion_by_its_sequence_weight(models, truncated, tmp_path):
    """--rollout-is tis --rollout-is-level sequence on the top-k sample, one step at θ = θ_old: with
    --loss-agg seq the policy loss is −mean_i A_i · min(w_i, C), w_i = exp(Σ_t (log π_old − log q)) over
    o_i's tokens, computed here by hand; the metrics report w_i. The tiny model keeps little mass in its
    top 4, so each w_i is a product of eight weights near e^-2.6. Naming the token level changes nothing."""
    _, roll, A = truncated
    mask = roll["completion_mask"]
    w_i = torch.where(mask, roll["old_logprobs"].double() - roll["sampler_logprobs"].double(), 0.0).sum(-1).exp()
    assert (w_i < 1e-6).all()
    m = update_metrics(models, truncated, tmp_path / "seq", "--rollout-is", "tis", "--rollout-is-cap", 1.2,
                       "--rollout-is-level", "sequence")
    assert m["policy_loss"] == pytest.approx(-(A * w_i).mean().item(), rel=1e-4)
    assert m["rollout_is_weight_mean"] == pytest.approx(w_i.mean().item(), rel=1e-6)
    assert m["rollout_is_weight_max"] == pytest.approx(w_i.max().item(), rel=1e-6)
    assert m["rollout_is_weight_beyond_cap"] == 0.0
    default = update_metrics(models, truncated, tmp_path / "default", "--rollout-is", "tis", "--rollout-is-cap", 1.2)
    token = update_metrics(models, truncated, tmp_path / "token", "--rollout-is", "tis", "--rollout-is-cap", 1.2,
                           "--rollout-is-level", "token")
    assert {k: v for k, v in token.items() if k != "seconds"} == {k: v for k, v in default.items() if k != "seconds"}
    before, after = (load_file(tmp_path / run / "p" / "model.safetensors") for run in ("default", "token"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sequence_weights_truncate_and_mask_whole_completions(models, truncated, tmp_path):
    """log q = log π_old − s_i/|o_i| on every token of o_i: each w_t = e^{s_i/|o_i|} stays below C = 3
    while w_i = e^{s_i} = 7.4, 1.6, 0.37, 4.5 (repeated). At the sequence level tis caps w_i at 3 and mis
    drops the completions beyond it from the policy term; at the token level no weight reaches the cap."""
    out, roll, A = truncated
    lengths = roll["completion_mask"].sum(-1, keepdim=True)                                 # [N, 1]
    s = torch.tensor([2.0, 0.5, -1.0, 1.5] * 2)                                             # log w_i [N]
    assert (s[:, None] / lengths < math.log(3)).all()
    far = tmp_path / "far.safetensors"
    sampler = torch.where(roll["completion_mask"], roll["old_logprobs"] - s[:, None] / lengths, 0.0)
    files.save_tensors(str(far), {**roll, "sampler_logprobs": sampler}, files.ROLLOUTS[0], {})
    metrics = {}
    for mode, level in (("tis", "sequence"), ("mis", "sequence"), ("mis", "token")):
        r = cli("update.py", "--model", models["policy"], "--rollouts", far, "--advantages", out / "a.safetensors",
                "--out", tmp_path / mode / level, "--beta", 0, "--lr", 1e-3, "--allow-mismatch", "--rollout-is", mode,
                "--rollout-is-cap", 3, "--rollout-is-level", level)
        assert r.code == 0, r.err
        metrics[mode, level] = json.load(open(tmp_path / mode / level / "metrics.json"))
    w = s.exp()                                                                              # [N]
    tis, mis = w.clamp(max=3.0), torch.where(w <= 3.0, w, 0.0)
    assert metrics["tis", "sequence"]["policy_loss"] == pytest.approx(-(A * tis).mean().item(), abs=1e-5)
    assert metrics["mis", "sequence"]["policy_loss"] == pytest.approx(-(A * mis).mean().item(), abs=1e-5)
    for m in (metrics["tis", "sequence"], metrics["mis", "sequence"]):
        assert m["rollout_is_weight_beyond_cap"] == 0.5
        assert m["rollout_is_weight_mean"] == pytest.approx(w.mean().item(), rel=1e-5)
        assert m["rollout_is_weight_max"] == pytest.approx(math.exp(2.0), rel=1e-5)
    token = metrics["mis", "token"]
    assert token["rollout_is_weight_beyond_cap"] == 0.0 == token["rollout_is_beyond_cap"]
    w_t = (s[:, None] / lengths).exp().squeeze(-1)                                           # one per row [N]
    assert token["policy_loss"] == pytest.approx(-(A * w_t).mean().item(), abs=1e-5)


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
