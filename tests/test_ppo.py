"""PPO with a critic: GAE against hand-computed vectors, the clipped value loss against its oracle, the
critic's values aligned with the log-probs, the stages' files and errors, and train.py --algo ppo
(learning, replay, exact resume after SIGKILL)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, assert_user_error, cli, kill_then_resume, replay_iteration
from safetensors.torch import load_file, save_file

import advantage
import update
from grpo.loop import diagnostics
from grpo.models import builders, loading, modeling
from grpo.training import ppo_critic

TOKEN_COUNT = os.path.join(os.path.dirname(__file__), "rewards_for_tests.py") + ":token_count"

# Two completions of 3 and 2 real tokens (T = 3), the second right-padded.
MASK = torch.tensor([[True, True, True], [True, True, False]])
VALUES = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 0.0]])
REWARDS = torch.tensor([1.0, 2.0])


def test_gae_hand_vector_on_ragged_rows():
    # γ = 0.9, λ = 0.8, no whitening. Row 0: δ = [0 + .9·.2 − .5, 0 + .9·.1 − .2, 1 − .1] = [−.32, −.11, .9];
    # A_2 = .9, A_1 = −.11 + .72·.9 = .538, A_0 = −.32 + .72·.538 = .06736. Row 1 (2 tokens, V = 0 after):
    # δ = [.9·.4 − .3, 2 − .4] = [.06, 1.6]; A_1 = 1.6, A_0 = .06 + .72·1.6 = 1.212. R = A + V.
    A, R = advantage.gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(A, torch.tensor([[0.06736, 0.538, 0.9], [1.212, 1.6, 0.0]]))
    torch.testing.assert_close(R, torch.tensor([[0.56736, 0.738, 1.0], [1.512, 2.0, 0.0]]))
    assert A.dtype == R.dtype == torch.float32


def test_gae_lambda_zero_is_one_step_td():
    A, R = advantage.gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.0, whiten=False)
    # A_t = δ_t = r_t + γ·V_{t+1} − V_t, R_t = r_t + γ·V_{t+1}.
    torch.testing.assert_close(A, torch.tensor([[-0.32, -0.11, 0.9], [0.06, 1.6, 0.0]]))
    torch.testing.assert_close(R, torch.tensor([[0.18, 0.09, 1.0], [0.36, 2.0, 0.0]]))


def test_gae_gamma_lambda_one_gives_the_remaining_reward_sum_with_the_kl_term():
    g = torch.Generator().manual_seed(0)
    N, T = 5, 7
    lengths = torch.tensor([7, 1, 4, 6, 2])
    mask = torch.arange(T) < lengths[:, None]
    values = torch.randn(N, T, generator=g).masked_fill(~mask, 0.0)
    rewards = torch.randn(N, generator=g)
    kl = torch.randn(N, T, generator=g)              # β_r·(log π_old − log π_ref), any values
    A, R = advantage.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, kl_per_token=kl, whiten=False)
    for i in range(N):
        for t in range(T):
            if t < lengths[i]:
                to_go = rewards[i] - kl[i, t:lengths[i]].sum()     # Σ_{l ≥ t} r_l: the KL of every token left
                assert R[i, t].item() == pytest.approx(to_go.item(), abs=1e-5), (i, t)
                assert A[i, t].item() == pytest.approx((to_go - values[i, t]).item(), abs=1e-5), (i, t)
            else:
                assert A[i, t] == 0 and R[i, t] == 0


def test_whitening_gives_mean_zero_std_one_and_leaves_the_returns():
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(6) < torch.tensor([6, 3, 1, 5])[:, None]
    values = torch.randn(4, 6, generator=g).masked_fill(~mask, 0.0)
    rewards = torch.randn(4, generator=g)
    raw_A, raw_R = advantage.gae_advantages(rewards, values, mask, 1.0, 0.95, whiten=False)
    A, R = advantage.gae_advantages(rewards, values, mask, 1.0, 0.95, whiten=True)
    assert A[mask].mean().abs() < 1e-6 and (A[mask].std() - 1).abs() < 1e-5
    assert (A[~mask] == 0).all() and torch.equal(R, raw_R)
    real = raw_A[mask].double()
    torch.testing.assert_close(A[mask], ((real - real.mean()) / real.std()).float())


def write(path, tensors, schema):
    save_file(tensors, str(path), metadata={"schema": schema, "args": "{}"})
    return str(path)


def gae_files(tmp_path, **changes):
    """rollouts and rewards files for the two rows above, G = 1 (two prompts of one completion)."""
    rollouts = {"prompt_ids": torch.tensor([[5, 6], [0, 7]]), "prompt_mask": torch.tensor([[1, 1], [0, 1]]).bool(),
                "completion_ids": torch.tensor([[8, 9, 2], [10, 2, 0]]), "completion_mask": MASK,
                "group_ids": torch.tensor([0, 1]), "truncated": torch.tensor([False, False]),
                "old_logprobs": torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.1, 0.0]]),
                "ref_logprobs": torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.6, 0.0]]), "values": VALUES}
    rollouts.update(changes)
    rollouts = {k: v for k, v in rollouts.items() if v is not None}
    return (write(tmp_path / "rollouts.safetensors", rollouts, "rollouts/1"),
            write(tmp_path / "rewards.safetensors", {"rewards": REWARDS, "group_ids": torch.tensor([0, 1])},
                  "rewards/1"))


def test_cli_gae_with_kl_in_reward_hand_vector(tmp_path):
    rollouts, rewards = gae_files(tmp_path)
    out = tmp_path / "adv.safetensors"
    r = cli("advantage.py", "--rewards", rewards, "--out", out, "--estimator", "gae", "--rollouts", rollouts,
            "--gamma", 1.0, "--lam", 1.0, "--kl-in-reward", 0.5, "--no-whiten")
    assert r.code == 0, r.err
    data = load_file(out)
    # Token rewards: −0.5·(old − ref) = row 0 [−.25, +.5, 0] (+1 at t = 2), row 1 [0, −.25] (+2 at t = 1).
    # γ = λ = 1: R_t = the rest of the row's rewards; A = R − V.
    R = torch.tensor([[1.25, 1.5, 1.0], [1.75, 1.75, 0.0]])
    torch.testing.assert_close(data["returns"], R)
    torch.testing.assert_close(data["advantages"], (R - VALUES).masked_fill(~MASK, 0.0))
    assert data["advantages"].shape == (2, 3) and torch.equal(data["group_ids"], torch.tensor([0, 1]))
    # Whitened by default: the same returns, advantages of mean 0 over the five real tokens.
    r = cli("advantage.py", "--rewards", rewards, "--out", out, "--estimator", "gae", "--rollouts", rollouts,
            "--gamma", 1.0, "--lam", 1.0, "--kl-in-reward", 0.5)
    assert r.code == 0, r.err
    data = load_file(out)
    torch.testing.assert_close(data["returns"], R)
    assert data["advantages"][MASK].mean().abs() < 1e-6 and (data["advantages"][MASK].std() - 1).abs() < 1e-5


def test_cli_gae_reads_only_the_mask_groups_and_values(tmp_path):
    """A rollouts file written by hand with the three keys GAE needs is enough (log-probs only with
    --kl-in-reward), and gives what the whole file gives."""
    (tmp_path / "full").mkdir()
    full, rewards = gae_files(tmp_path / "full")
    minimal, _ = gae_files(tmp_path, prompt_ids=None, prompt_mask=None, completion_ids=None, truncated=None,
                           old_logprobs=None, ref_logprobs=None)
    outs = []
    for rollouts in (full, minimal):
        outs.append(tmp_path / f"adv{len(outs)}.safetensors")
        r = cli("advantage.py", "--rewards", rewards, "--out", outs[-1], "--estimator", "gae", "--rollouts", rollouts)
        assert r.code == 0, r.err
    a, b = load_file(outs[0]), load_file(outs[1])
    assert torch.equal(a["advantages"], b["advantages"]) and torch.equal(a["returns"], b["returns"])
    r = cli("advantage.py", "--rewards", rewards, "--out", tmp_path / "kl.safetensors", "--estimator", "gae",
            "--rollouts", minimal, "--kl-in-reward", 0.1)
    assert_user_error(r, "old_logprobs")


@pytest.mark.parametrize("change, extra, fragments", [
    ({"values": None}, [], ["no 'values'", "--critic"]),
    ({"completion_mask": torch.tensor([[True, False, True], [True, True, False]])}, [], ["rows 0", "first token"]),
    ({"values": torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 0.7]])}, [], ["rows 1", "'values'"]),
    ({"ref_logprobs": None}, ["--kl-in-reward", "0.1"], ["ref_logprobs"]),
    ({}, ["--gamma", "1.5"], ["--gamma"]),
])
def test_cli_gae_bad_inputs_are_one_line_errors_and_nothing_is_written(tmp_path, change, extra, fragments):
    rollouts, rewards = gae_files(tmp_path, **change)
    out = tmp_path / "adv.safetensors"
    r = cli("advantage.py", "--rewards", rewards, "--out", out, "--estimator", "gae", "--rollouts", rollouts, *extra)
    assert_user_error(r, *fragments)
    assert not out.exists()


def test_cli_gae_flags_belong_to_gae(tmp_path):
    rollouts, rewards = gae_files(tmp_path)
    out = tmp_path / "adv.safetensors"
    assert_user_error(cli("advantage.py", "--rewards", rewards, "--out", out, "--estimator", "gae"), "--rollouts")
    for flags in (["--whiten"], ["--rollouts", rollouts], ["--kl-in-reward", "0.1", "--rollouts", rollouts]):
        assert_user_error(cli("advantage.py", "--rewards", rewards, "--out", out, *flags), flags[0])
    assert not out.exists()


def test_clipped_value_loss_hand_oracle():
    # V_old = 0.5, R = 1, ε_v = 0.2. V = 0.9: clipped to 0.7, ½·max(.01, .09) = .045 (clipped term larger);
    # V = 0.6: inside the band, ½·.16 = .08; V = 0.2: clipped to 0.3, ½·max(.64, .49) = .32 (not clipped).
    V = torch.tensor([[0.9, 0.6, 0.2]], requires_grad=True)
    loss, clipped = ppo_critic.clipped_value_loss(V, torch.full((1, 3), 0.5), torch.ones(1, 3), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.045, 0.08, 0.32]]))
    assert clipped.tolist() == [[True, False, False]]
    loss.sum().backward()
    # The clipped term's gradient is 0 (V cannot move further out); the others are V − R.
    torch.testing.assert_close(V.grad, torch.tensor([[0.0, -0.4, -0.8]]))


def test_explained_variance():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    R = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    assert diagnostics.explained_variance(R, R, mask) == pytest.approx(1.0)
    assert diagnostics.explained_variance(torch.zeros_like(R), R, mask) == pytest.approx(0.0)
    shifted = R + 0.5                                  # a constant offset explains everything but the mean
    assert diagnostics.explained_variance(shifted, R, mask) == pytest.approx(1.0)
    # V = 2·mean − R is wrong by 2·(R − mean): Var(R − V) = 4·Var(R), so 1 − 4 = −3.
    assert diagnostics.explained_variance(2 * R.mean() - R, R, mask) == pytest.approx(-3.0)
    assert diagnostics.explained_variance(R, torch.ones_like(R), mask) is None


@pytest.fixture(scope="module")
def critic(models, tmp_path_factory):
    """A critic made from the tiny policy, with a random head so that its values are not all zero."""
    path = builders.make_critic(models["policy"], str(tmp_path_factory.mktemp("critic") / "critic"))
    model = loading.load_critic(path, "cpu")
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1][-1]
    assert head.weight.abs().max() == 0                # make_critic's head starts at zero: V = 0
    with torch.no_grad():
        head.weight.normal_(generator=torch.Generator().manual_seed(0))
    model.save_pretrained(path)
    return path


def test_critic_values_are_aligned_with_the_logprobs(critic, rollout_dir):
    model = loading.load_critic(critic, "cpu")
    roll = load_file(rollout_dir / "rollouts.safetensors")
    batched = modeling.rollout_values(model, roll, 5)                   # [N, T], rows padded together
    for i in (0, 5, 9):
        prompt = roll["prompt_ids"][i][roll["prompt_mask"][i]]
        n = int(roll["completion_mask"][i].sum())
        completion = roll["completion_ids"][i][:n]
        # V_t is the critic's output after the prompt and the first t completion tokens, read alone.
        with torch.no_grad():
            alone = model(torch.cat([prompt, completion])[None]).logits[0, :, 0]
        torch.testing.assert_close(batched[i, :n], alone[len(prompt) - 1:len(prompt) - 1 + n], atol=1e-5, rtol=0)
        assert (batched[i, n:] == 0).all()


def test_make_critic_is_a_token_classification_checkpoint_and_a_policy_is_no_critic(critic, models, prompts_file,
                                                                                    tmp_path):
    config = json.load(open(os.path.join(critic, "config.json")))
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 1
    out = tmp_path / "s"
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out,
            "--critic", models["policy"], "--num-prompts", 1, "--group-size", 2)
    assert_user_error(r, models["policy"])
    assert not (out / "rollouts.safetensors").exists()


@pytest.fixture(scope="module")
def ppo_iteration(models, critic, prompts_file, tmp_path_factory):
    """One PPO iteration by hand: sample with the critic, score, gae, (no update yet)."""
    out = tmp_path_factory.mktemp("ppo")
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out, "--group-size", 2,
            "--num-prompts", 4, "--max-new-tokens", 12, "--seed", 1, "--ref-model", models["ref"], "--critic", critic)
    assert r.code == 0, r.err
    r = cli("score.py", "--rollouts", out / "rollouts.safetensors", "--samples", out / "samples.jsonl",
            "--reward", TOKEN_COUNT, "--out", out / "rewards.safetensors")
    assert r.code == 0, r.err
    r = cli("advantage.py", "--rewards", out / "rewards.safetensors", "--out", out / "advantages.safetensors",
            "--estimator", "gae", "--rollouts", out / "rollouts.safetensors", "--kl-in-reward", 0.05)
    assert r.code == 0, r.err
    return out


def test_sample_writes_the_critics_values(ppo_iteration, critic):
    roll = load_file(ppo_iteration / "rollouts.safetensors")
    assert roll["values"].dtype == torch.float32 and roll["values"].shape == roll["old_logprobs"].shape
    expected = modeling.rollout_values(loading.load_critic(critic, "cpu"), roll, 0)
    torch.testing.assert_close(roll["values"], expected, atol=1e-5, rtol=0)
    assert (roll["values"][~roll["completion_mask"]] == 0).all() and roll["values"].abs().max() > 0


def test_update_trains_policy_and_critic_and_the_value_loss_falls(ppo_iteration, models, critic, tmp_path):
    it = ppo_iteration
    base = ["--rollouts", it / "rollouts.safetensors", "--advantages", it / "advantages.safetensors",
            "--lr", 1e-4, "--critic-lr", 3e-4, "--value-clip", 10,    # returns of ~10: a wide band
            "--allow-mismatch"]                 # three updates on the rollouts the first policy sampled
    losses, critic_in, policy_in = [], critic, models["policy"]
    for step in range(3):
        out, critic_out = tmp_path / f"p{step}", tmp_path / f"c{step}"
        r = cli("update.py", "--model", policy_in, "--out", out, "--critic", critic_in, "--critic-out", critic_out,
                *base)
        assert r.code == 0, r.err
        m = json.load(open(out / "metrics.json"))
        for key in ("value_loss", "value_clip_frac", "value_mean", "value_grad_norm", "explained_variance"):
            assert isinstance(m[key], float), key
        losses.append(m["value_loss"])
        for name in ("model.safetensors", "optimizer.safetensors", "config.json"):
            assert (critic_out / name).is_file(), name
        critic_in, policy_in = critic_out, out
    # Each update fits the critic to the same returns: its loss, measured before the step, falls.
    assert losses[2] < losses[1] < losses[0], losses
    # The critic's optimizer state is continued: AdamW's step count grows with each update.
    state = load_file(tmp_path / "c2" / "optimizer.safetensors")
    assert {v.item() for k, v in state.items() if k.endswith("/step")} == {3.0}
    roll = load_file(it / "rollouts.safetensors")
    adv = load_file(it / "advantages.safetensors")
    first = json.load(open(tmp_path / "p0" / "metrics.json"))
    expected = diagnostics.explained_variance(roll["values"], adv["returns"], roll["completion_mask"])
    assert first["explained_variance"] == pytest.approx(expected)


def test_critic_epochs_and_critic_only(ppo_iteration, models, critic, tmp_path):
    """--critic-epochs E gives the critic E × minibatches steps of its own; --critic-only writes the
    policy bit for bit as it came and moves the critic; the critic's first epoch is the policy's plan."""
    it = ppo_iteration
    base = ["--rollouts", it / "rollouts.safetensors", "--advantages", it / "advantages.safetensors",
            "--critic", critic, "--lr", 1e-4, "--critic-lr", 3e-4, "--minibatch-size", 4, "--value-clip", 10]
    r = cli("update.py", "--model", models["policy"], "--out", tmp_path / "p", "--critic-out", tmp_path / "c",
            "--critic-epochs", 3, *base)
    assert r.code == 0, r.err
    m = json.load(open(tmp_path / "p" / "metrics.json"))
    assert (m["optimizer_steps"], m["critic_steps"], m["critic_skipped_steps"]) == (2, 6, 0)     # N = 8 rows
    r = cli("update.py", "--model", models["policy"], "--out", tmp_path / "q", "--critic-out", tmp_path / "d",
            "--critic-only", *base)
    assert r.code == 0, r.err
    m = json.load(open(tmp_path / "q" / "metrics.json"))
    assert m["critic_steps"] == 2 and "policy_loss" not in m and "optimizer_steps" not in m
    policy_before, policy_after = load_file(os.path.join(models["policy"], "model.safetensors")), \
        load_file(tmp_path / "q" / "model.safetensors")
    assert all(torch.equal(policy_before[k], policy_after[k]) for k in policy_before)
    critic_before, critic_after = load_file(os.path.join(critic, "model.safetensors")), \
        load_file(tmp_path / "d" / "model.safetensors")
    assert any(not torch.equal(critic_before[k], critic_after[k]) for k in critic_before)
    # The critic's steps do not depend on the policy's: --critic-only's critic is, to the bit, that of a
    # whole update with --critic-epochs 1.
    r = cli("update.py", "--model", models["policy"], "--out", tmp_path / "p1", "--critic-out", tmp_path / "c1",
            "--critic-epochs", 1, *base)
    assert r.code == 0, r.err
    critic_one = load_file(tmp_path / "c1" / "model.safetensors")
    assert all(torch.equal(critic_one[k], critic_after[k]) for k in critic_one)
    assert_user_error(cli("update.py", "--model", models["policy"], "--out", tmp_path / "x", *base[:4],
                          "--critic-only"), "--critic-only")


def test_train_critic_warmup_freezes_the_policy_for_k_iterations(tmp_path):
    run = tmp_path / "w"
    r = cli("train.py", "--config", "tiny", "--algo", "ppo", "--iterations", 3, "--critic-warmup", 2,
            "--eval-every", 0, "--save-every", 1, "--run-dir", run, "--num-prompts", 2, "--group-size", 2,
            "--max-new-tokens", 6)
    assert r.code == 0, r.err
    m = metrics_of(run, 3)
    for i in (0, 1):                         # the critic's alone: no policy step, the critic's steps
        assert "losses/policy_loss" not in m[i] and m[i]["losses/critic_steps"] == 1, i
    assert m[2]["losses/optimizer_steps"] == 1 and m[2]["losses/critic_steps"] == 1
    assert m[2]["diag/ref_logprob_diff_max"] == 0.0        # the policy had not moved before iteration 2
    assert "--critic-only" in (run / "iter_0001" / "replay.sh").read_text()
    assert "--critic-only" not in (run / "iter_0002" / "replay.sh").read_text()
    # Killed inside the warm-up (its policy's optimizer has no state yet), the run resumes to the same files.
    argv = ["train.py", "--config", "tiny", "--algo", "ppo", "--iterations", 3, "--critic-warmup", 2,
            "--eval-every", 0, "--save-every", 1, "--num-prompts", 2, "--group-size", 2, "--max-new-tokens", 6]
    killed = tmp_path / "k"
    finished = kill_then_resume([str(a) for a in argv], killed, [killed / "iter_0002" / "prompts.jsonl"])
    assert finished.returncode == 0, finished.stderr
    for part in (run / "policy", run / "policy" / "critic"):
        straight, again = (load_file(d / "model.safetensors") for d in (part, killed / part.relative_to(run)))
        assert max((straight[k] - again[k]).abs().max().item() for k in straight) < 1e-6, part
    assert_user_error(cli("train.py", "--config", "tiny", "--critic-warmup", 1, "--run-dir", tmp_path / "g"),
                      "--critic-warmup")
    assert_user_error(cli("train.py", "--config", "tiny", "--algo", "ppo", "--iterations", 2, "--critic-warmup", 2,
                          "--run-dir", tmp_path / "h"), "--critic-warmup")


def test_update_critic_needs_its_files_and_its_output(ppo_iteration, models, critic, rollout_dir, tmp_path):
    it = ppo_iteration
    out = tmp_path / "p"
    r = cli("update.py", "--model", models["policy"], "--rollouts", it / "rollouts.safetensors",
            "--advantages", it / "advantages.safetensors", "--out", out, "--critic", critic)
    assert_user_error(r, "--critic-out")
    # GRPO's advantages (no returns) with a critic, and GRPO's rollouts (no values).
    grpo_adv = tmp_path / "a.safetensors"
    assert cli("score.py", "--rollouts", it / "rollouts.safetensors", "--samples", it / "samples.jsonl",
               "--reward", TOKEN_COUNT, "--out", tmp_path / "r.safetensors").code == 0
    assert cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", grpo_adv).code == 0
    r = cli("update.py", "--model", models["policy"], "--rollouts", it / "rollouts.safetensors",
            "--advantages", grpo_adv, "--out", out, "--critic", critic, "--critic-out", tmp_path / "c")
    assert_user_error(r, "returns")
    assert not out.exists() and not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """`python train.py --config tiny --algo ppo` at its default length (30 iterations, saves every 10)."""
    run_dir = tmp_path_factory.mktemp("runs") / "ppo"
    r = cli("train.py", "--config", "tiny", "--algo", "ppo", "--run-dir", run_dir)
    assert r.code == 0, r.err
    return run_dir


def metrics_of(run_dir, n):
    return [json.loads((run_dir / f"iter_{i:04d}" / "metrics.json").read_text()) for i in range(n)]


def test_tiny_ppo_learns(ppo_run):
    m = metrics_of(ppo_run, 30)
    rewards = [x["charts/reward_mean"] for x in m]
    # char_class rewards lie in [0, 1]; GRPO's test asks for +0.25, PPO's critic starts at V = 0 and is
    # poor for its first iterations (docs/ppo.md), so it is asked for +0.15.
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.15, rewards
    before = [json.loads(line)["reward"] for line in open(ppo_run / "eval" / "iter_0000.jsonl")]
    after = [json.loads(line)["reward"] for line in open(ppo_run / "eval" / "iter_0030.jsonl")]
    assert sum(after) / len(after) > sum(before) / len(before) + 0.25
    # The critic learns to predict the returns: explained variance ends above where it starts.
    ev = [x["charts/explained_variance"] for x in m]
    assert sum(ev[-5:]) / 5 > 0 and sum(ev[-5:]) / 5 > min(ev[:5]), ev


def test_ppo_run_folder_and_metrics(ppo_run):
    assert json.loads((ppo_run / "config.json").read_text())["config"]["algo"] == "ppo"
    for name in ("model.safetensors", "optimizer.safetensors", "config.json"):
        assert (ppo_run / "policy" / "critic" / name).is_file(), name
        assert (ppo_run / "checkpoints" / "iter_0020" / "critic" / name).is_file(), name
    assert json.load(open(ppo_run / "critic_init" / "config.json"))["architectures"] == ["LlamaForTokenClassification"]
    it = ppo_run / "iter_0012"
    assert "values" in load_file(it / "rollouts.safetensors")
    adv = load_file(it / "advantages.safetensors")
    assert adv["advantages"].shape == adv["returns"].shape and adv["advantages"].dim() == 2
    m = json.loads((it / "metrics.json").read_text())
    for key in ("losses/value_loss", "losses/value_clip_frac", "losses/value_mean", "charts/explained_variance"):
        assert isinstance(m[key], float), key
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set(EventAccumulator(str(ppo_run / "tb")).Reload().Tags()["scalars"])
    assert {"losses/value_loss", "charts/explained_variance", "charts/reward_mean"} <= tags


def assert_same_files(dir_a, dir_b, names):
    for name in names:
        a, b = load_file(dir_a / name), load_file(dir_b / name)
        assert a.keys() == b.keys(), name
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_replay_a_ppo_iteration(ppo_run, tmp_path):
    it = ppo_run / "iter_0010"
    out = replay_iteration(it, tmp_path / "replay")
    assert_same_files(it, out, ["rollouts.safetensors", "rewards.safetensors", "advantages.safetensors"])
    metrics = json.loads((it / "metrics.json").read_text())
    replayed = json.loads((out / "policy" / "metrics.json").read_text())
    assert replayed["value_loss"] == metrics["losses/value_loss"] and replayed["loss"] == metrics["losses/loss"]
    assert (out / "critic" / "model.safetensors").is_file()


def test_ppo_resume_after_sigkill_is_exact(tmp_path):
    argv = ["train.py", "--config", "tiny", "--algo", "ppo", "--iterations", "8", "--save-every", "3"]
    straight = tmp_path / "straight"
    assert subprocess.run([sys.executable, *argv, "--run-dir", str(straight)], cwd=ROOT,
                          capture_output=True).returncode == 0
    killed = tmp_path / "killed"
    # Kill before the first save and after the second (at 6), then let a third process finish.
    finished = kill_then_resume(argv, killed, [killed / "iter_0001" / "rollouts.safetensors",
                                               killed / "iter_0007" / "prompts.jsonl"])
    assert finished.returncode == 0, finished.stderr
    both = ["model.safetensors", "optimizer.safetensors"]
    assert_same_files(straight / "policy", killed / "policy", both)
    assert_same_files(straight / "policy" / "critic", killed / "policy" / "critic", both)
    assert_same_files(straight / "iter_0007", killed / "iter_0007", ["rollouts.safetensors", "advantages.safetensors"])


@pytest.mark.parametrize("flags, fragment", [
    (["--algo", "ppo", "--estimator", "grpo"], "--estimator grpo"),
    (["--estimator", "gae"], "--estimator gae"),
    (["--algo", "ppo", "--dynamic-sampling"], "--dynamic-sampling"),
    (["--algo", "a2c"], "--algo"),
])
def test_train_algo_errors(flags, fragment, tmp_path):
    r = cli("train.py", "--config", "tiny", "--run-dir", tmp_path / "r", *flags)
    assert_user_error(r, fragment)
    assert not (tmp_path / "r").exists()


def test_ppo_allows_groups_of_one(tmp_path):
    r = cli("train.py", "--config", "tiny", "--algo", "ppo", "--group-size", 1, "--num-prompts", 8,
            "--iterations", 2, "--eval-every", 0, "--run-dir", tmp_path / "r")
    assert r.code == 0, r.err
    assert load_file(tmp_path / "r" / "iter_0001" / "advantages.safetensors")["returns"].shape[0] == 8
