"""Prefix sharing: each distinct prompt computed once, its keys and values expanded to its rows, in the
sampler, the reference and critic passes and the update, against the unshared path it must equal."""

import pytest
import torch
from conftest import cli
from safetensors.torch import load_file

import sample
import update
from grpo.disk import files
from grpo.models import builders, loading, modeling
from grpo.rewards import prompting
from grpo.training import optim, ppo_critic

CLIP_GRADIENTS = optim.clip_gradients


@pytest.fixture(scope="module")
def critic(models, tmp_path_factory):
    """A critic made from the tiny policy, with a random head (its values are not all zero)."""
    path = builders.make_critic(models["policy"], str(tmp_path_factory.mktemp("critic") / "critic"))
    model = loading.load_critic(path, "cpu")
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight)
    model.save_pretrained(path)
    return path


def forward_rows(model):
    """Records the [rows, columns] of every forward pass of `model`'s transformer."""
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda _, inputs, __: shapes.append(tuple(inputs[0].shape)))
    return shapes


def test_distinct_prompts_compare_ids_under_the_mask():
    pad = 0
    ids = torch.tensor([[pad, 5, 6], [7, 5, 6], [pad, 5, 6], [5, 5, 6], [pad, pad, 6]])
    mask = ids != pad
    ids[0, 0] = 9                                   # a padding id differs: still the same prompt as row 2
    rows, inverse = modeling.distinct_prompts(ids, mask)
    assert inverse[0] == inverse[2] and len(set(inverse.tolist())) == 4
    assert torch.equal(inverse[rows], torch.arange(len(rows)))       # each prompt's row has that prompt


def test_sample_prefills_each_prompt_once_and_draws_what_the_unshared_path_draws(models, critic, prompts_file,
                                                                                tmp_path):
    """sample.py with and without sharing (micro-batches of 6 cut the groups of 4): the same completions
    for the seed; old_logprobs, ref_logprobs and the critic's values within 1e-5."""
    common = ["--model", models["policy"], "--prompts", prompts_file, "--group-size", 4, "--max-new-tokens", 20,
              "--temperature", 0.9, "--seed", 2, "--ref-model", models["ref"], "--critic", critic,
              "--micro-batch-size", 6]
    for name, extra in (("shared", []), ("plain", ["--no-prefix-sharing"])):
        r = cli("sample.py", *common, "--out", tmp_path / name, *extra)
        assert r.code == 0, r.err
    shared, plain = (load_file(tmp_path / name / "rollouts.safetensors") for name in ("shared", "plain"))
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "group_ids"):
        assert torch.equal(shared[key], plain[key]), key
    for key in ("old_logprobs", "ref_logprobs", "values"):
        torch.testing.assert_close(shared[key], plain[key], atol=1e-5, rtol=0)
        assert shared[key].abs().max() > 0, key

    # The sampler's prefill runs the distinct prompts of each micro-batch once.
    policy = loading.load_model(models["policy"], "cpu")
    shapes = forward_rows(policy)
    rows = slice(2, 8)                                       # rows of groups 0 and 1: two prompts
    g = torch.Generator().manual_seed(0)
    sample.sample_completions(policy, plain["prompt_ids"][rows], plain["prompt_mask"][rows], 3, 1.0, [1], 0, g)
    assert shapes[0][0] == 2 and all(s == (6, 1) for s in shapes[1:])
    shapes.clear()
    sample.sample_completions(policy, plain["prompt_ids"][rows], plain["prompt_mask"][rows], 3, 1.0, [1], 0, g,
                              share_prefix=False)
    assert shapes[0][0] == 6


def recorded_steps(policy, rollouts, advantages, argv, critic=None, returns=None, monkeypatch=None):
    """update.train_policy (and ppo_critic.train_critic) with plain SGD (a step linear in the gradient, so that two runs whose gradients
    differ by rounding stay as close for the next step); returns each step's gradients and the metrics."""
    args = update.parse_args(["--model", "m", "--rollouts", "r", "--advantages", "a", "--out", "o", *map(str, argv)])
    args.temperature, args.max_new_tokens = 0.7, 40
    grads = []

    def record(model, max_norm):
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return CLIP_GRADIENTS(model, max_norm)

    monkeypatch.setattr(optim, "clip_gradients", record)
    optimizer = torch.optim.SGD(policy.parameters(), lr=args.lr)
    if critic is not None:
        critic = ppo_critic.Critic(critic, torch.optim.SGD(critic.parameters(), lr=args.critic_lr))
    metrics = update.train_policy(policy, optimizer, rollouts, advantages, args)
    if critic is not None:
        metrics.update(ppo_critic.train_critic(critic, rollouts, returns, args))
    return grads, metrics


def max_relative_difference(a, b):
    """max over tensors of max |a − b| / max |b|."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)).item() for k in b)


@pytest.mark.parametrize("loss_agg, policy_loss, batching", [
    ("seq", "ppo", ["--epochs", 2, "--minibatch-size", 6, "--micro-batch-size", 4]),
    ("token", "ppo", ["--epochs", 2, "--minibatch-size", 6, "--micro-batch-size", 4]),
    ("dr_grpo", "ppo", ["--epochs", 2, "--minibatch-size", 6, "--micro-batch-size", 4]),
    ("seq", "gspo", ["--epochs", 1, "--minibatch-size", 0, "--micro-batch-size", 0]),
    ("token", "gspo", ["--epochs", 2, "--minibatch-size", 8, "--micro-batch-size", 3]),
    ("dr_grpo", "gspo", ["--epochs", 1, "--minibatch-size", 16, "--micro-batch-size", 5]),
    ("token", "cispo", ["--epochs", 2, "--minibatch-size", 6, "--micro-batch-size", 4]),
])
def test_update_gradients_and_metrics_equal_the_unshared_path(models, rollout_dir, monkeypatch, loss_agg,
                                                              policy_loss, batching):
    """Every step's policy gradient within 1e-5 (relative) of the unshared path's, and the metrics too;
    with the KL penalty, an entropy bonus and the recomputed π_old, for each --loss-agg and --policy-loss."""
    rollouts = files.load_tensors(str(rollout_dir / "rollouts.safetensors"), files.ROLLOUTS)[0]
    advantages = torch.randn(rollouts["group_ids"].numel(), generator=torch.Generator().manual_seed(4))
    argv = ["--lr", 1e-2, "--beta", 0.04, "--entropy-coef", 0.01, "--loss-agg", loss_agg, "--policy-loss",
            policy_loss, "--old-logprobs", "recompute", "--clip-eps", 0.1, *batching]
    runs = []
    for extra in ([], ["--no-prefix-sharing"]):
        policy = loading.load_model(models["policy"], "cpu")
        shapes = forward_rows(policy)
        runs.append((*recorded_steps(policy, rollouts, advantages, argv + extra, monkeypatch=monkeypatch), shapes))
    (shared, m_shared, s_shared), (plain, m_plain, s_plain) = runs
    assert len(shared) == len(plain) == m_plain["optimizer_steps"] > 0
    for step_shared, step_plain in zip(shared, plain):
        assert max_relative_difference(step_shared, step_plain) < 1e-5
    for key, value in m_plain.items():
        if isinstance(value, float) and key != "seconds":
            assert m_shared[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # The shared path's forward passes see fewer prompt tokens: 4 prompts, not 16 rows of them.
    assert sum(r * c for r, c in s_shared) < sum(r * c for r, c in s_plain)


def test_ppo_critic_shares_the_prefix_too(models, critic, rollout_dir, monkeypatch):
    rollouts = files.load_tensors(str(rollout_dir / "rollouts.safetensors"), files.ROLLOUTS)[0]
    g = torch.Generator().manual_seed(5)
    mask = rollouts["completion_mask"]
    rollouts = {**rollouts, "values": torch.randn(mask.shape, generator=g) * mask}
    returns = torch.randn(mask.shape, generator=g) * mask
    advantages = torch.randn(mask.shape, generator=g) * mask
    argv = ["--lr", 1e-2, "--critic", "c", "--critic-out", "co", "--minibatch-size", 8, "--micro-batch-size", 5,
            "--value-clip", 0.5]
    runs = []
    for extra in ([], ["--no-prefix-sharing"]):
        policy, value_model = loading.load_model(models["policy"], "cpu"), loading.load_critic(critic, "cpu")
        shapes = forward_rows(value_model)
        grads, metrics = recorded_steps(policy, rollouts, advantages, argv + extra, value_model, returns, monkeypatch)
        runs.append((grads, metrics, shapes))
    (shared, m_shared, s_shared), (plain, m_plain, s_plain) = runs
    assert len(shared) == len(plain) == 4                     # the policy's two steps, then the critic's
    for step_shared, step_plain in zip(shared, plain):
        assert max_relative_difference(step_shared, step_plain) < 1e-5
    for key in ("value_loss", "value_mean", "value_clip_frac", "value_grad_norm", "loss"):
        assert m_shared[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-6), key
    assert sum(r * c for r, c in s_shared) < sum(r * c for r, c in s_plain)


def test_a_model_without_a_plain_kv_cache_falls_back_with_one_warning(tmp_path, capsys):
    """A Mistral with sliding-window layers: its cache keeps a window, not the prompt as it is, so both
    paths compute each row's prompt; one warning, the same numbers."""
    from transformers import MistralConfig, MistralForCausalLM

    tok = builders.char_tokenizer()
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=64,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    builders.save_checkpoint(MistralForCausalLM(config), tok, str(tmp_path / "mistral"))
    model = loading.load_model(str(tmp_path / "mistral"), "cpu")
    ids, mask = prompting.left_pad([tok("What is 2 + 3?")["input_ids"], tok("1+1=")["input_ids"]], tok.pad_token_id)
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    out = []
    for share in (True, False, True):
        g = torch.Generator().manual_seed(1)
        out.append(sample.sample_completions(model, ids, mask, 6, 1.0, [tok.eos_token_id], tok.pad_token_id, g,
                                             share_prefix=share))
        with torch.no_grad():
            out.append(modeling.completion_logprobs(model, ids, mask, out[-1]["completion_ids"].clone(),
                                                    out[-1]["completion_mask"].clone(), 1.0, share_prefix=share))
    assert torch.equal(out[0]["completion_ids"], out[2]["completion_ids"]) and torch.equal(out[1], out[3])
    assert capsys.readouterr().err.count("prefix sharing: MistralForCausalLM") == 1
