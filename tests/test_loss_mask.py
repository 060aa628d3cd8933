"""The rollouts' `loss_mask` (an episode's: true on the policy's own tokens, false on the environment's):
no loss term, gradient, weight or count of the update reaches the environment's tokens, GAE steps over
them, and a file without the key is trained exactly as before."""

import pytest
import torch

import advantage
from grpo.cli import StageError
from grpo.disk import stage_inputs
from test_update import rollouts_of, run_update


def episode(rollouts):
    """The sampled rows as episodes: completion columns 2..4 are an environment's reply (false in
    loss_mask), the rest the policy's."""
    mask = rollouts["completion_mask"]
    env = torch.zeros_like(mask)
    env[:, 2:5] = True
    return {**rollouts, "loss_mask": mask & ~env, "sampler_logprobs": rollouts["old_logprobs"] - 0.05}, env & mask


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "dual_clip", "cispo"])
def test_nothing_of_the_update_reaches_the_environments_tokens(models, rollout_dir, policy_loss):
    rollouts, env = episode(rollouts_of(rollout_dir))
    N, T = rollouts["completion_mask"].shape
    adv = torch.linspace(-1, 1, N * T).reshape(N, T)                                  # per token [N, T]
    perturbed = {**rollouts, "old_logprobs": rollouts["old_logprobs"] + 0.5 * env,
                 "ref_logprobs": rollouts["ref_logprobs"] - 0.7 * env,
                 "sampler_logprobs": rollouts["sampler_logprobs"] + 0.3 * env}
    flags = dict(beta=0.04, entropy_coef=0.01, rollout_is="tis", rollout_is_level="sequence", clip_eps=0.1,
                 policy_loss=policy_loss)
    a, ma = run_update(models["policy"], rollouts, adv, **flags)
    b, mb = run_update(models["policy"], perturbed, adv + 5.0 * env, **flags)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert torch.equal(p, q), name
    assert ma == mb
    assert ma["tokens"] == int(rollouts["loss_mask"].sum()) < int(rollouts["completion_mask"].sum())
    # The same perturbation where the tokens are the policy's moves the step: the test can fail.
    c, _ = run_update(models["policy"], {**perturbed, "loss_mask": rollouts["completion_mask"]}, adv + 5.0 * env,
                      **flags)
    assert not all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), c.parameters()))


def test_a_file_without_loss_mask_is_trained_as_one_whose_mask_is_every_completion_token(models, rollout_dir):
    rollouts = rollouts_of(rollout_dir)
    adv = torch.linspace(-1.5, 1.5, rollouts["group_ids"].numel())
    a, ma = run_update(models["policy"], rollouts, adv)
    b, mb = run_update(models["policy"], {**rollouts, "loss_mask": rollouts["completion_mask"]}, adv)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())) and ma == mb


def test_gae_steps_over_the_environments_tokens():
    # One episode: policy tokens at 0, 1 and 4, an environment's reply at 2 and 3 (values there ignored).
    values = torch.tensor([[0.5, 0.2, 9.0, -9.0, 0.1]])
    policy = torch.tensor([[True, True, False, False, True]])
    kl = torch.tensor([[0.01, 0.02, 5.0, 5.0, 0.03]])
    A, R = advantage.gae_advantages(torch.tensor([1.0]), values, policy, 0.9, 0.8, kl, whiten=False)
    # By hand, the policy's tokens laid end to end: V = 0.5, 0.2, 0.1; r = −0.01, −0.02, 1 − 0.03.
    d2 = 0.97 - 0.1
    d1 = -0.02 + 0.9 * 0.1 - 0.2
    d0 = -0.01 + 0.9 * 0.2 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    expected = torch.tensor([[d0 + 0.72 * a1, a1, 0.0, 0.0, a2]])
    torch.testing.assert_close(A, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(R, expected + torch.tensor([[0.5, 0.2, 0.0, 0.0, 0.1]]), rtol=0, atol=1e-6)
    # and the same as the compacted sequence's
    A3, _ = advantage.gae_advantages(torch.tensor([1.0]), values[:, [0, 1, 4]], torch.ones(1, 3, dtype=torch.bool),
                                     0.9, 0.8, kl[:, [0, 1, 4]], whiten=False)
    torch.testing.assert_close(A[:, [0, 1, 4]], A3, rtol=0, atol=1e-7)


def test_a_loss_mask_outside_the_completion_or_empty_is_refused_in_one_line(models, rollout_dir):
    rollouts, _ = episode(rollouts_of(rollout_dir))
    outside = rollouts["loss_mask"] | ~rollouts["completion_mask"]
    with pytest.raises(StageError, match="'loss_mask' is true where completion_mask is false"):
        stage_inputs.check_loss_mask("r.safetensors", {**rollouts, "loss_mask": outside})
    empty = rollouts["loss_mask"].clone()
    empty[2] = False
    with pytest.raises(StageError, match="rows 2 have no token of the policy"):
        stage_inputs.check_loss_mask("r.safetensors", {**rollouts, "loss_mask": empty})
