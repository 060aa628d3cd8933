"""update.py: the loss against hand-computed vectors, gradient accumulation, learning, and the CLI."""

import json
import math
import os
import shutil

import pytest
import torch
from conftest import assert_user_error, cli, token_loss_terms
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from grpo.disk import files
from grpo.loop import diagnostics
from grpo.models import loading, modeling
from grpo.training import optim
import update

LN2 = math.log(2.0)
K3_AT_LN2 = 2.0 - LN2 - 1.0            # k3 when log π_ref − log π_θ = ln 2: e^x − x − 1 = 0.30685


def hand_batch():
    """Two completions, three token slots; the second completion has two tokens.

    Row 0, A = +1: ρ = 1.5 (clipped to 1.2: the clip is active), 0.5 (min picks 0.5), 1.0.
    Row 1, A = −2: ρ = 0.5 (clip 0.8 → −1.6 is the min: active), 1.5 (−3 is the min), and a masked slot.
    log π_ref − log π_θ = ln 2 on every token, so k3 = 2 − ln 2 − 1.
    """
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.1]])
    logp = torch.log(torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.25, 0.5]]))
    old = logp - torch.log(ratio)
    ref = logp + LN2
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, old, ref, adv, mask


def test_token_loss_hand_vector():
    logp, old, ref, adv, mask = hand_batch()
    loss, terms = token_loss_terms(logp, old, ref, adv, mask, beta=0.1, clip_eps=0.2, clip_eps_high=0.2)
    expected_pg = torch.tensor([[-1.2, -0.5, -1.0], [1.6, 3.0, 2.2]])
    torch.testing.assert_close(terms["pg_loss"], expected_pg)
    torch.testing.assert_close(terms["kl"], torch.full((2, 3), K3_AT_LN2))
    torch.testing.assert_close(loss, expected_pg + 0.1 * K3_AT_LN2)
    assert terms["clipped_high"].tolist() == [[True, False, False], [False, False, False]]
    assert terms["clipped_low"].tolist() == [[False, False, False], [True, False, False]]


def test_clip_higher_is_asymmetric():
    logp, old, ref, adv, mask = hand_batch()
    _, terms = token_loss_terms(logp, old, ref, adv, mask, beta=0.0, clip_eps=0.2, clip_eps_high=0.28)
    # ρ = 1.5 with A = +1 is now clipped at 1.28; the low side is unchanged.
    assert terms["pg_loss"][0, 0].item() == pytest.approx(-1.28)
    assert terms["pg_loss"][1, 0].item() == pytest.approx(1.6)


def test_cispo_hand_vector_and_every_token_keeps_its_gradient():
    """CISPO: ℓ_t = −sg(clip(ρ_t, 0.8, 1.2))·A·log π_θ. Weights: row 0 (A = +1) 1.2, 0.8, 1.0; row 1
    (A = −2) 0.8, 1.2, 1.1. The gradient in log π_θ is −clip(ρ_t)·A on every token, clipped ones too,
    where PPO's is 0 on the two tokens its clip is active on."""
    logp, old, ref, adv, mask = hand_batch()
    theta = logp.clone().requires_grad_(True)
    loss, terms = token_loss_terms(theta, old, ref, adv, mask, beta=0.0, clip_eps=0.2, clip_eps_high=0.2,
                                   policy_loss="cispo")
    weight = torch.tensor([[1.2, 0.8, 1.0], [0.8, 1.2, 1.1]])
    torch.testing.assert_close(terms["pg_loss"], -weight * adv[:, None] * logp)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    torch.testing.assert_close(grad, -weight * adv[:, None])
    assert terms["clipped_high"].tolist() == [[True, False, False], [False, True, False]]   # ρ > 1.2, any A
    assert terms["clipped_low"].tolist() == [[False, True, False], [True, False, False]]
    ppo_loss, ppo_terms = token_loss_terms(theta, old, ref, adv, mask, beta=0.0, clip_eps=0.2, clip_eps_high=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo_loss.sum(), theta)
    active = ppo_terms["clipped_low"] | ppo_terms["clipped_high"]
    assert active.sum() == 2 and (ppo_grad[active] == 0).all() and (ppo_grad[~active] != 0).all()


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "dual_clip", "cispo"])
def test_what_the_clip_warning_says_each_loss_does_is_what_it_does(policy_loss):
    """update.POLICY_LOSSES says what each loss's clip does to a token outside the band, and the
    on-policy warning repeats it: the gradient of a token the loss counts clipped is 0 exactly when it
    says so (on the hand batch, whose ratios are outside the band)."""
    logp, old, ref, adv, mask = hand_batch()
    theta = logp.clone().requires_grad_(True)
    eps = 0.05 if policy_loss == "gspo" else 0.2               # GSPO's row ratios are 0.91 and 0.87
    loss, terms = token_loss_terms(theta, old, ref, adv, mask, beta=0.0, clip_eps=eps, clip_eps_high=eps,
                                   policy_loss=policy_loss, dual_clip=1.2 if policy_loss == "dual_clip" else None)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    clipped = (terms["clipped_low"] | terms["clipped_high"]) & mask
    assert clipped.any()
    effect = update.POLICY_LOSSES[policy_loss][1]
    assert ((grad[clipped] == 0).all() if effect == "get no gradient" else (grad[clipped] != 0).all()), effect
    assert effect in diagnostics.clip_band_warning(0.5, effect)


@pytest.mark.parametrize("loss_agg, expected", [
    # seq: row means (−1.2 − 0.5 − 1.0)/3 = −0.9 and (1.6 + 3.0)/2 = 2.3, their mean 0.7; plus β·k3.
    ("seq", 0.7 + 0.1 * K3_AT_LN2),
    # token: (−2.7 + 4.6)/5 tokens = 0.38; plus β·k3.
    ("token", 0.38 + 0.1 * K3_AT_LN2),
    # dr_grpo: Σ ℓ / (N × L_max) = (1.9 + 5·0.1·k3)/(2 × 4).
    ("dr_grpo", (1.9 + 5 * 0.1 * K3_AT_LN2) / 8),
])
def test_aggregation_hand_vector(loss_agg, expected):
    logp, old, ref, adv, mask = hand_batch()
    loss, _ = token_loss_terms(logp, old, ref, adv, mask, beta=0.1, clip_eps=0.2, clip_eps_high=0.2)
    value = update.aggregate(loss, mask, loss_agg, num_seqs=2, num_tokens=5, max_new_tokens=4)
    assert value.item() == pytest.approx(expected, abs=1e-6)
    # Split into one micro-batch per row, normalised by the minibatch: the same total.
    split = sum(update.aggregate(loss[i:i + 1], mask[i:i + 1], loss_agg, 2, 5, 4) for i in range(2))
    assert split.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("chunk", [1 << 21, 7, 1])       # one chunk; two rows of 4 × 11 at a time… one
def test_log_probs_and_entropy_have_the_formulas_values_and_gradients_in_any_chunking(chunk, monkeypatch):
    """modeling.logprobs_from_logits writes its backward out, chunk by chunk: its values are
    log_softmax(x / τ) at the token and −Σ p log p, and its gradients (torch's finite differences,
    float64) those of the formula, for the log-prob, the entropy bonus, and both at once."""
    monkeypatch.setattr(modeling._TokenLogprobs, "CHUNK", chunk)
    x = torch.randn(3, 4, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    tokens = torch.randint(11, (3, 4), generator=torch.Generator().manual_seed(1))
    logp, entropy = modeling.logprobs_from_logits(x, tokens, 0.7, with_entropy=True, entropy_grad=True)
    log_p = torch.log_softmax(x / 0.7, -1)
    torch.testing.assert_close(logp, log_p.gather(-1, tokens[..., None])[..., 0])
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))
    assert torch.autograd.gradcheck(lambda x: modeling.logprobs_from_logits(x, tokens, 0.7), (x,))
    assert torch.autograd.gradcheck(lambda x: modeling.logprobs_from_logits(
        x, tokens, 1.3, with_entropy=True, entropy_grad=True)[1], (x,))
    assert torch.autograd.gradcheck(lambda x: modeling.logprobs_from_logits(
        x, tokens, 1.3, with_entropy=True, entropy_grad=True), (x,))


def test_left_padding_does_not_change_logprobs(models):
    policy = loading.load_model(models["policy"], "cpu")
    tok = loading.load_tokenizer(models["policy"])
    short, long = tok("1+1=")["input_ids"], tok("What is 12 plus 30?")["input_ids"]
    completion = torch.tensor([tok("42")["input_ids"] + [tok.eos_token_id]] * 2)           # [2, 3]
    P = len(long)
    prompt_ids = torch.tensor([[tok.pad_token_id] * (P - len(short)) + short, long])       # [2, P]
    prompt_mask = prompt_ids != tok.pad_token_id
    cmask = torch.ones_like(completion, dtype=torch.bool)
    with torch.no_grad():
        batched = modeling.completion_logprobs(policy, prompt_ids, prompt_mask, completion, cmask, 0.8)
        for i, prompt in enumerate([short, long]):
            alone = modeling.completion_logprobs(policy, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool),
                                               completion[i:i + 1], cmask[i:i + 1], 0.8)
            torch.testing.assert_close(batched[i:i + 1], alone, atol=2e-5, rtol=0)



def run_update(model_dir, rollouts, advantages, **flags):
    """update.train_policy with update.py's own defaults and these flags on top (no files: the paths
    are never opened)."""
    flags = {"lr": 1e-3, "max_grad_norm": 1e9, "temperature": 0.7, "max_new_tokens": 40, **flags}
    argv = ["--model", model_dir, "--rollouts", "-", "--advantages", "-", "--out", "-"]
    for name, value in flags.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    args = update.parse_args(argv)
    policy = loading.load_model(model_dir, "cpu")
    optimizer = optim.adamw(policy, args.lr)
    return policy, update.train_policy(policy, optimizer, rollouts, advantages, args)


def rollouts_of(rollout_dir):
    return files.load_tensors(str(rollout_dir / "rollouts.safetensors"), files.ROLLOUTS)[0]


@pytest.mark.parametrize("loss_agg", ["seq", "token", "dr_grpo"])
def test_gradient_accumulation_gives_the_same_step(models, rollout_dir, loss_agg):
    rollouts = rollouts_of(rollout_dir)
    adv = torch.linspace(-1.5, 1.5, rollouts["group_ids"].numel())
    whole, m1 = run_update(models["policy"], rollouts, adv, loss_agg=loss_agg, micro_batch_size=0)
    parts, m2 = run_update(models["policy"], rollouts, adv, loss_agg=loss_agg, micro_batch_size=3)
    # One minibatch, so .grad still holds its whole gradient (Adam's step itself would magnify
    # float noise in near-zero gradients, so the gradients are what is compared).
    for (name, a), b in zip(whole.named_parameters(), parts.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-4, msg=name)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)


def test_first_step_is_on_policy(models, rollout_dir):
    rollouts = rollouts_of(rollout_dir)
    adv = torch.linspace(-1, 1, rollouts["group_ids"].numel())
    _, m = run_update(models["policy"], rollouts, adv)
    # One step, measured before it: π_θ = π_old, so ρ = 1 and nothing is clipped.
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["clip_frac"] == 0.0
    assert m["kl"] > 0.0                                   # the reference is a different model
    assert m["tokens"] == int(rollouts["completion_mask"].sum())
    # With zero advantages the policy term is exactly zero and the loss is β·KL.
    _, m0 = run_update(models["policy"], rollouts, torch.zeros_like(adv), epochs=1)
    assert m0["policy_loss"] == 0.0


def test_update_moves_probability_toward_positive_advantages(models, rollout_dir):
    rollouts = rollouts_of(rollout_dir)
    N = rollouts["group_ids"].numel()
    adv = torch.tensor([1.0, -1.0] * (N // 2))
    policy, _ = run_update(models["policy"], rollouts, adv, beta=0.0, lr=3e-3, epochs=4, max_grad_norm=1.0)
    with torch.no_grad():
        after = modeling.completion_logprobs(policy, rollouts["prompt_ids"], rollouts["prompt_mask"],
                                           rollouts["completion_ids"], rollouts["completion_mask"], 0.7)
    mask = rollouts["completion_mask"]
    change = ((after - rollouts["old_logprobs"]) * mask).sum(-1) / mask.sum(-1)          # [N]
    assert change[adv > 0].mean() > 0.05
    assert change[adv < 0].mean() < -0.05


def test_cli_writes_checkpoint_optimizer_and_metrics(models, rollout_dir, tmp_path):
    adv_file = tmp_path / "adv.safetensors"
    N = rollouts_of(rollout_dir)["group_ids"].numel()
    save_file({"advantages": torch.linspace(-1, 1, N), "group_ids": rollouts_of(rollout_dir)["group_ids"]},
              str(adv_file), metadata={"schema": "advantages/1"})
    out = tmp_path / "policy1"
    r = cli("update.py", "--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors",
            "--advantages", adv_file, "--out", out, "--lr", 1e-3, "--beta", 0.01, "--clip-eps", 0.2,
            "--loss-agg", "token", "--epochs", 2, "--minibatch-size", 8, "--micro-batch-size", 4)
    assert r.code == 0, r.err
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ["loss", "policy_loss", "kl", "clip_frac", "ratio_mean", "ratio_max", "entropy", "grad_norm", "tokens"]:
        assert isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]), key
    assert metrics["optimizer_steps"] == 4
    model = AutoModelForCausalLM.from_pretrained(out)
    before = AutoModelForCausalLM.from_pretrained(models["policy"])
    assert not torch.equal(model.model.embed_tokens.weight, before.model.embed_tokens.weight)
    state = load_file(out / "optimizer.safetensors")
    assert "model.embed_tokens.weight/exp_avg" in state and state["model.embed_tokens.weight/step"].item() == 4

    # A second update from that folder continues AdamW's state (step 4 -> 6): on the same rollouts, which
    # another policy sampled, so deliberately (--allow-mismatch).
    out2 = tmp_path / "policy2"
    r = cli("update.py", "--model", out, "--rollouts", rollout_dir / "rollouts.safetensors",
            "--advantages", adv_file, "--out", out2, "--lr", 1e-3, "--epochs", 2, "--allow-mismatch")
    assert r.code == 0, r.err
    assert load_file(out2 / "optimizer.safetensors")["model.embed_tokens.weight/step"].item() == 6


def test_mismatched_inputs_are_errors_before_anything_is_written(models, rollout_dir, tmp_path):
    rollouts = rollouts_of(rollout_dir)
    N = rollouts["group_ids"].numel()
    out = tmp_path / "out"
    common_args = ["--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors", "--out", out]

    short = tmp_path / "short.safetensors"
    save_file({"advantages": torch.zeros(N - 4), "group_ids": rollouts["group_ids"][:-4]}, str(short))
    assert_user_error(cli("update.py", *common_args, "--advantages", short), "short.safetensors", f"{N}")

    shuffled = tmp_path / "shuffled.safetensors"
    save_file({"advantages": torch.zeros(N), "group_ids": rollouts["group_ids"].flip(0)}, str(shuffled))
    assert_user_error(cli("update.py", *common_args, "--advantages", shuffled), "group_ids differ")

    nan = tmp_path / "nan.safetensors"
    save_file({"advantages": torch.full((N,), float("nan")), "group_ids": rollouts["group_ids"]}, str(nan))
    assert_user_error(cli("update.py", *common_args, "--advantages", nan), "NaN or infinite")

    no_ref = tmp_path / "noref.safetensors"
    save_file({k: v for k, v in rollouts.items() if k != "ref_logprobs"}, str(no_ref))
    good_adv = tmp_path / "adv.safetensors"
    save_file({"advantages": torch.zeros(N), "group_ids": rollouts["group_ids"]}, str(good_adv))
    assert_user_error(cli("update.py", "--model", models["policy"], "--rollouts", no_ref, "--advantages", good_adv,
                          "--out", out, "--beta", 0.01), "ref_logprobs", "--beta")
    assert not out.exists()
    # β = 0 needs no reference; kl is then not measured (null), not reported as 0.
    r = cli("update.py", "--model", models["policy"], "--rollouts", no_ref, "--advantages", good_adv,
            "--out", out, "--beta", 0)
    assert r.code == 0, r.err
    assert json.loads((out / "metrics.json").read_text())["kl"] is None
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_empty_completion_row_and_damaged_optimizer_state(models, rollout_dir, tmp_path):
    rollouts = rollouts_of(rollout_dir)
    N = rollouts["group_ids"].numel()
    adv = tmp_path / "adv.safetensors"
    save_file({"advantages": torch.zeros(N), "group_ids": rollouts["group_ids"]}, str(adv))
    empty_row = dict(rollouts, completion_mask=rollouts["completion_mask"].clone())
    empty_row["completion_mask"][5] = False
    save_file(empty_row, str(tmp_path / "empty_row.safetensors"))
    out = tmp_path / "out"
    assert_user_error(cli("update.py", "--model", models["policy"], "--rollouts", tmp_path / "empty_row.safetensors",
                          "--advantages", adv, "--out", out), "rows 5", "no completion token")

    damaged = tmp_path / "damaged_model"
    shutil.copytree(models["policy"], damaged)
    (damaged / "optimizer.safetensors").write_text("junk")
    args = ["--model", damaged, "--rollouts", rollout_dir / "rollouts.safetensors", "--advantages", adv, "--out", out]
    assert_user_error(cli("update.py", *args), "optimizer.safetensors", "--fresh-optimizer")
    assert not out.exists()
    assert cli("update.py", *args, "--fresh-optimizer").code == 0


def test_out_folder_with_other_files_is_refused_and_dr_grpo_needs_l_max(models, rollout_dir, tmp_path):
    adv = tmp_path / "adv.safetensors"
    group_ids = load_file(rollout_dir / "rollouts.safetensors")["group_ids"]
    save_file({"advantages": torch.ones(16), "group_ids": group_ids}, str(adv))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "rollouts.safetensors").write_bytes(b"keep me")
    args = ["--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors", "--advantages", adv]
    assert_user_error(cli("update.py", *args, "--out", busy), "--out", "rollouts.safetensors", "new or empty")
    assert (busy / "rollouts.safetensors").read_bytes() == b"keep me"
    # A checkpoint folder (say, the --model itself one step later) is replaced as a whole.
    assert cli("update.py", *args, "--out", tmp_path / "ckpt").code == 0
    assert cli("update.py", *args, "--out", tmp_path / "ckpt").code == 0

    no_meta = tmp_path / "no_meta.safetensors"
    save_file(load_file(rollout_dir / "rollouts.safetensors"), str(no_meta))
    args[3] = no_meta
    assert_user_error(cli("update.py", *args, "--out", tmp_path / "x", "--loss-agg", "dr_grpo"),
                      "dr_grpo", "--max-new-tokens")
    assert cli("update.py", *args, "--out", tmp_path / "x", "--loss-agg", "dr_grpo", "--max-new-tokens", 40).code == 0


def test_gradient_checkpointing_recomputes_and_takes_the_same_step(models, rollout_dir):
    """With --gradient-checkpointing each decoder layer runs twice per micro-batch (forward, then again
    in the backward pass), the step is the same (as that of the unshared path, which checkpointing
    takes), and afterwards the layers are out of training mode
    and checkpointing is off (so sampling keeps its KV cache)."""
    rollouts = rollouts_of(rollout_dir)
    adv = torch.linspace(-1.5, 1.5, rollouts["group_ids"].numel())
    calls = []

    def counting_load(path, device):
        model = loading.load_model(path, device)
        model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        return model

    results = {}
    for on in (False, True):
        calls.clear()
        args = update.parse_args(["--model", "m", "--rollouts", "r", "--advantages", "a", "--out", "o",
                                  "--lr", "1e-3", "--micro-batch-size", "4", "--no-prefix-sharing"]
                                 + ["--gradient-checkpointing"] * on)
        args.temperature = 0.7
        policy = counting_load(models["policy"], "cpu")
        metrics = update.train_policy(policy, optim.adamw(policy, args.lr), rollouts, adv, args)
        results[on] = (policy, metrics, len(calls))
    (plain, m0, n0), (checkpointed, m1, n1) = results[False], results[True]
    assert n1 == 2 * n0 > 0
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a, b)
    assert m0["loss"] == m1["loss"] and m0["grad_norm"] == m1["grad_norm"]
    assert not checkpointed.model.layers[0].training and not checkpointed.is_gradient_checkpointing
