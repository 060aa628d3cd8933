"""Stage 4 of GRPO: update the policy with PPO's clipped objective and a β·KL penalty to π_ref.

For every completion token o_t of completion o_i (DeepSeekMath, eq. 3; docs/formats.md):

    ρ_t   = exp(log π_θ(o_t) − log π_old(o_t))
    ℓ_t   = −min(ρ_t·A_i, clip(ρ_t, 1−ε_low, 1+ε_high)·A_i) + β·k3_t
    k3_t  = exp(log π_ref(o_t) − log π_θ(o_t)) − (log π_ref(o_t) − log π_θ(o_t)) − 1
    loss  = mean over sequences of the masked token mean of ℓ_t          (--loss-agg seq)

Reads   --model DIR        the policy π_θ (π_old before the first step), and AdamW's state if DIR
                           holds optimizer.safetensors (unless --fresh-optimizer)
        --ref-model DIR    π_ref (default: the one the rollouts were sampled against)
        --rollouts FILE    rollouts.safetensors: ids and masks, old_logprobs [N, T]
        --advantages FILE  advantages.safetensors: advantages [N] (or [N, T]), group_ids [N]
Writes  --out DIR          a Hugging Face checkpoint, optimizer.safetensors, metrics.json (docs/formats.md)

PPO with a critic (--critic DIR --critic-out DIR): the advantages are per token (advantage.py
--estimator gae), and after the policy's steps the critic V takes its own (train_critic): --critic-epochs
shuffles in minibatches of --minibatch-size, an AdamW step each at --critic-lr, on the clipped value
loss aggregated over tokens like the policy loss (--loss-agg); --critic-only steps the critic alone:

    L_V = vf_coef · ½·max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t, −ε_v, ε_v) − R_t)²)

with R_t the advantages file's `returns` and V_old the rollouts' `values`.

Example:
    python update.py --model ckpt/ --rollouts it0/rollouts.safetensors \\
        --advantages it0/advantages.safetensors --out ckpt1/ --lr 1e-6 --beta 0.01 --clip-eps 0.2 \\
        --loss-agg seq --epochs 1 --minibatch-size 16

Choices where the paper and docs/formats.md are silent:
- log π_θ comes from modeling.completion_logprobs, the function sample.py uses, at the sampling
  temperature of the rollouts' metadata (--temperature overrides). log π_old is the rollouts'
  old_logprobs on a CPU, where sampler and update both run in float32 and agree to about 1e-6;
  on a GPU it is recomputed by this forward before the first step (--old-logprobs recompute),
  because the sampler's bf16 steps differ from a full forward by rounding, and a tight clip band
  (GSPO's) would count that rounding as policy change.
- log π_ref is computed in every micro-batch by the call that computes log π_θ, on the same rows
  and shapes, without gradients (as TRL does), not read from the rollouts' ref_logprobs: computed
  in the sampler's shapes those differ by ~1e-5, and AdamW turns that rounding into lr-sized steps
  away from π_ref on a batch with no signal (docs/numerics.md; --ref-logprobs rollouts reads them).
- x = log π_ref − log π_θ is clamped to ±20 inside k3 (e^x overflows float32 at 88), and β = 0
  leaves the penalty out of ℓ_t altogether.
- μ = --epochs passes, each a seeded shuffle of the N rows cut into minibatches of
  --minibatch-size completions, one AdamW step each. A minibatch runs in micro-batches of
  --micro-batch-size rows whose losses carry the minibatch's normaliser, so the gradient does not
  depend on the split; under torchrun the ranks share each minibatch the same way.
- Each distinct prompt of a micro-batch (equal ids under the mask) runs once, and its rows'
  completions attend to its cached keys and values (modeling.completion_outputs); the backward pass
  sums their gradients into it. --no-prefix-sharing gives every row its own prompt: the same loss,
  metrics and gradients to rounding.
- The learning rate of AdamW's step s (optim.scheduled_lr): lr·(s + 1)/W during a warm-up of W =
  --warmup-steps, so the first step already moves (transformers' schedulers start at 0), then
  --lr-schedule; --weight-decay is AdamW's decoupled decay. Both are set from these arguments at
  every step, whoever built the optimizer (train.py builds it once per run).
- Dropout is off (eval mode) so that ρ = 1 exactly on the first, on-policy step; gradients are
  clipped to --max-grad-norm; a row with no completion token is an error.
- --out DIR is replaced as a unit, so it must be new, empty, or an earlier output of update.py
  (grpo/outputs.py); the inputs must belong together (grpo/provenance.py, --allow-mismatch).
"""

import argparse
import json
import math
import time
from collections import Counter

import torch
from tqdm import tqdm

from grpo import (checkpoints, diagnostics, distributed, loading, lora, minibatches, modeling, optim, outputs,
                  provenance, settings, stage_inputs)
from grpo.cli import ArgumentParser, StageError, add_runtime_flags, run_cli, warn, warn_once
from grpo.settings import above, above_or_inf, at_least, between
from grpo.update_metrics import UpdateMetrics


# ----------------------------------------------------------------------------------------
# The algorithm: the clipped, KL-penalised token loss, its aggregation, and PPO's value loss

def grpo_token_loss(logp, old_logp, ref_logp, advantages, mask, *, beta, clip_eps, clip_eps_high,
                    dual_clip=None, ratio_level="token", kl_estimator="k3", entropy=None, entropy_coef=0.0,
                    is_weight=None):
    """ℓ_t of docs/formats.md for every token, and its terms. Tensors [n, T]; advantages [n] or [n, T].
    With entropy_coef c, ℓ_t also holds −c·H_t (`entropy` [n, T], with its gradient; verl). With
    `is_weight` w_t [n, T] (rollout_is_weights), the policy term is w_t times its own: the tokens came
    from another distribution than π_old, and w_t reweighs them to π_old."""
    A = advantages[:, None] if advantages.dim() == 1 else advantages          # [n, 1] or [n, T]
    log_ratio = logp - old_logp                                                # [n, T]
    if ratio_level == "sequence":  # GSPO: one ratio per completion, exp of the mean token log-ratio
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(logp)                                  # [n, T], constant along T
    ratio = torch.exp(log_ratio)                                               # ρ_t            [n, T]
    pg_unclipped = ratio * A                                                   # ρ_t·A
    pg_clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * A      # clip(ρ_t)·A
    pg_loss = -torch.min(pg_unclipped, pg_clipped)                             # −min(·,·)      [n, T]
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:      # dual-clip PPO: with A < 0 the loss is at most C·|A|, however large ρ is
        dual_clipped = (A < 0) & (pg_loss > dual_clip * A.abs())
        pg_loss = torch.where(dual_clipped, dual_clip * A.abs(), pg_loss)
    if is_weight is not None:       # the sampler's tokens reweighed to π_old (--rollout-is)
        pg_loss = is_weight * pg_loss
    kl = penalty = torch.zeros_like(logp)
    if ref_logp is not None:
        # x = log π_ref − log π_θ, bounded to ±20 as verl does: e^x overflows float32 beyond 88.
        x = (ref_logp - logp).clamp(-20.0, 20.0)                               # [n, T]
        kl = torch.exp(x) - x - 1                                              # k3_t, the KL that is reported
        if kl_estimator == "k1":    # E[∇k1] = −E[∇ log π_θ] = 0 on-policy: noise only (warned)
            penalty = -x
        elif kl_estimator == "k2":  # E[∇k2] = ∇ KL(π_θ‖π_ref)
            penalty = x ** 2 / 2
        else:                       # E[∇k3] = ∇ KL(π_ref‖π_θ)
            penalty = kl
    loss = pg_loss                                                             # ℓ_t            [n, T]
    if beta != 0:                   # β = 0 adds no penalty at all (0·inf would be NaN)
        loss = loss + beta * penalty
    if entropy_coef != 0:
        loss = loss - entropy_coef * entropy
    terms = {"pg_loss": pg_loss, "kl": kl, "kl_penalty": penalty, "ratio": ratio,
             "dual_clipped": dual_clipped,
             "clipped_low": (ratio < 1 - clip_eps) & (A < 0),                  # the clip is the active term
             "clipped_high": (ratio > 1 + clip_eps_high) & (A > 0)}
    return loss, terms


def rollout_is_weights(old_logp, sampler_logp, mode, cap):
    """The importance weight of each token between the trainer's π_old and the distribution q it was
    drawn from (the sampler's after top-k/top-p/min-p, or another engine's), [n, T]:

        w_t = π_old(o_t) / q(o_t) = exp(log π_old(o_t) − log q(o_t))
        tis:  min(w_t, C)                      truncated importance sampling (Yao et al. 2025)
        mis:  w_t where w_t ≤ C, else 0        masked: a token beyond the cap leaves the loss

    with C = --rollout-is-cap. Without gradients: π_old and q are fixed before the update."""
    w = torch.exp(old_logp - sampler_logp)                                     # [n, T]
    return w.clamp(max=cap) if mode == "tis" else torch.where(w <= cap, w, 0.0)


def aggregate(token_loss, mask, loss_agg, num_seqs, num_tokens, max_new_tokens):
    """This micro-batch's share of the minibatch loss; the minibatch's sequences and tokens normalise."""
    masked = torch.where(mask, token_loss, 0.0)                                # [n, T]
    if loss_agg == "seq":      # mean over sequences of the masked token mean (DeepSeekMath)
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if loss_agg == "token":    # Σ ℓ_t / Σ |o_i| over the minibatch (DAPO)
        return masked.sum() / num_tokens
    return masked.sum() / (num_seqs * max_new_tokens)  # dr_grpo: Σ ℓ_t / (N × L_max)


def clipped_value_loss(values, old_values, returns, value_clip):
    """PPO's clipped value loss per token, ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²),
    and where the clipped term is the larger (so the step cannot move V further than ε_v). [n, T] each."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)     # [n, T]
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.max(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq


# ----------------------------------------------------------------------------------------
# The loop: μ epochs → minibatches (one AdamW step each) → micro-batches (one backward each)

def train_policy(policy, optimizer, rollouts, advantages, args, ref_model=None):
    """μ epochs of clipped-objective AdamW steps on the rollouts; returns metrics.json's dict.

    log π_ref comes from `ref_model` by the very call that computes log π_θ, on the same rows and
    shapes, so at θ = θ_ref the two are equal to the bit (docs/numerics.md); without one, from the
    rollouts' ref_logprobs."""
    plan = minibatches.plan(rollouts, args.epochs, args)
    rollouts = training_rows(policy, rollouts, advantages, args, plan[0])
    mismatch = diagnostics.rollout_mismatch(rollouts, args.rollout_is_cap) if "sampler_logprobs" in rollouts else {}
    log = UpdateMetrics(args.clip_eps, args.clip_eps_high, args.ratio_level,
                        ref_model is not None or "ref_logprobs" in rollouts)
    skipped = 0
    bar = tqdm(total=sum(map(len, plan)), desc="update", leave=False, disable=None if distributed.is_main() else True)
    with (modeling.gradient_checkpointing([policy], args.gradient_checkpointing),
          lora.dropout(policy, args.lora_dropout, args.seed)):
        for rows in (rows for epoch in plan for rows in epoch):                                   # [M]
            num_seqs, num_tokens = len(rows), max(int(rollouts["loss_mask"][rows].sum()), 1)
            optimizer.zero_grad(set_to_none=True)
            log.start()
            grad_norm = minibatches.gradient(policy, rollouts, rows, args, log.add, lambda batch: micro_batch_loss(
                policy, ref_model, batch, args, num_seqs, num_tokens))
            bar.update(1)
            if not log.end_minibatch(grad_norm):      # NaN or inf would reach every weight
                skipped = optim.skip_step(optimizer, skipped, grad_norm, log.sums["loss"], args.max_bad_steps)
                continue
            lr = optim.step(optimizer, args, args.lr)
            log.step(num_tokens, lr)
            bar.set_postfix(loss=f"{log.sums['loss']:.4f}")
    bar.close()
    for warning in log.warnings():
        warn(warning)
    return {**log.summary(skipped), **mismatch}


def micro_batch_loss(policy, ref_model, batch, args, num_seqs, num_tokens):
    """One micro-batch's share of the minibatch loss (with its gradient) and its per-token terms."""
    mask, loss_mask = batch["completion_mask"], batch["loss_mask"]                          # [n, T]
    inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask)
    ref_logp = batch.get("ref_logprobs")                                                   # [n, T]
    if ref_model is not None:
        with torch.no_grad():
            ref_logp = modeling.completion_logprobs(ref_model, *inputs, args.temperature,
                                                    share_prefix=args.prefix_sharing)          # log π_ref
    logp, entropy = modeling.completion_logprobs(
        policy, *inputs, args.temperature, with_entropy=True, entropy_grad=args.entropy_coef != 0,
        share_prefix=args.prefix_sharing)                                                  # log π_θ [n, T]
    token_loss, terms = grpo_token_loss(
        logp, batch["old_logprobs"], ref_logp, batch["advantages"], mask, beta=args.beta, clip_eps=args.clip_eps,
        clip_eps_high=args.clip_eps_high, dual_clip=args.dual_clip, ratio_level=args.ratio_level,
        kl_estimator=args.kl_estimator, entropy=entropy, entropy_coef=args.entropy_coef,
        is_weight=batch.get("is_weight"))                                                  # ℓ_t [n, T]
    loss = aggregate(token_loss, loss_mask, args.loss_agg, num_seqs, num_tokens, args.max_new_tokens)
    terms.update(logp=logp, ref_logp=ref_logp, entropy=entropy, policy_loss=aggregate(
        terms["pg_loss"].detach(), loss_mask, args.loss_agg, num_seqs, num_tokens, args.max_new_tokens))
    return loss, terms


def train_critic(critic, rollouts, returns, args):
    """PPO's critic V: --critic-epochs seeded shuffles of the rows in minibatches of --minibatch-size,
    one AdamW step each (at --critic-lr) on the clipped value loss towards `returns`, aggregated over
    tokens like the policy loss; returns its metrics: the means over its steps and the explained
    variance of the sampled V_old (how much of the returns' variance the critic predicted)."""
    plan = minibatches.plan(rollouts, args.critic_epochs, args)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "values")
    rollouts = {**{k: rollouts[k] for k in keys}, "returns": returns,
                "loss_mask": minibatches.loss_mask(rollouts, args)}
    steps, skipped = [], 0
    with modeling.gradient_checkpointing([critic.model], args.gradient_checkpointing):
        for rows in (rows for epoch in plan for rows in epoch):                                   # [M]
            num_seqs, num_tokens = len(rows), max(int(rollouts["loss_mask"][rows].sum()), 1)
            critic.optimizer.zero_grad(set_to_none=True)
            step = Counter(dict.fromkeys(("value_loss", "value_clipped", "value_sum"), 0.0))
            grad_norm = minibatches.gradient(critic.model, rollouts, rows, args, lambda _, __, sums: step.update(sums),
                                             lambda batch: value_loss(critic.model, batch, args, num_seqs, num_tokens))
            step = distributed.all_reduce(step, "sum")
            if not (math.isfinite(step["value_loss"]) and math.isfinite(grad_norm)):
                skipped = optim.skip_step(critic.optimizer, skipped, grad_norm, step["value_loss"],
                                          args.max_bad_steps)
                continue
            optim.step(critic.optimizer, args, args.critic_lr)
            steps.append({"value_loss": step["value_loss"], "value_grad_norm": grad_norm,
                          "value_clip_frac": step["value_clipped"] / num_tokens,
                          "value_mean": step["value_sum"] / num_tokens})
    metrics = {k: sum(s[k] for s in steps) / len(steps) if steps else None
               for k in ("value_loss", "value_grad_norm", "value_clip_frac", "value_mean")}
    return {**metrics, "critic_steps": len(steps), "critic_skipped_steps": skipped,
            "explained_variance": diagnostics.explained_variance(rollouts["values"], returns,
                                                                 rollouts["completion_mask"])}


def value_loss(critic, batch, args, num_seqs, num_tokens):
    """One micro-batch's share of the critic's minibatch loss, vf_coef·L_V (with its gradient), and
    the sums its step metrics are made of: L_V itself, the clipped tokens and Σ V_t."""
    V = modeling.completion_values(critic, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"], args.prefix_sharing)             # V_t [n, T]
    token_loss, clipped = clipped_value_loss(V, batch["values"], batch["returns"], args.value_clip)
    loss = aggregate(token_loss, batch["loss_mask"], args.loss_agg, num_seqs, num_tokens, args.max_new_tokens)
    return args.vf_coef * loss, {"value_loss": loss.item(), "value_clipped": clipped[batch["loss_mask"]].sum().item(),
                                 "value_sum": torch.where(batch["loss_mask"], V.detach(), 0.0).sum().item()}


def training_rows(policy, rollouts, advantages, args, first_epoch):
    """The rollouts the update trains on, with their advantages and loss_mask. With --old-logprobs
    recompute, log π_old comes from the policy as it is now, in the passes of the first epoch
    (`first_epoch`: its minibatches' rows), every rank's, so that the first step's ratio is exactly 1.
    With --rollout-is, each token's importance weight between that π_old and the sampler's q."""
    rollouts = {**rollouts, "loss_mask": minibatches.loss_mask(rollouts, args), "advantages": advantages}
    if args.old_logprobs == "recompute":   # every rank computes every row: under FSDP a forward is a collective
        passes = [idx for rows in first_epoch for idx in distributed.every_rank_passes(rows, args.micro_batch_size)]
        rollouts["old_logprobs"] = modeling.rollout_logprobs(policy, rollouts, args.temperature, 0,
                                                             args.prefix_sharing, passes).cpu()
    if args.rollout_is != "none":
        rollouts["is_weight"] = rollout_is_weights(rollouts["old_logprobs"], rollouts["sampler_logprobs"],
                                                   args.rollout_is, args.rollout_is_cap)           # [N, T]
    return rollouts


# ----------------------------------------------------------------------------------------
# The command line

def build_parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    paths = p.add_argument_group("files")
    paths.add_argument("--model", required=True, help="policy π_θ to update (HF checkpoint folder or Hub id)")
    paths.add_argument("--rollouts", required=True, help="rollouts.safetensors (log π_old, log π_ref)")
    paths.add_argument("--advantages", required=True, help="advantages.safetensors from advantage.py (A)")
    paths.add_argument("--out", required=True, help="output folder: checkpoint, optimizer state, metrics.json")
    paths.add_argument("--ref-model", default=None,
                       help="π_ref: the frozen reference (folder or Hub id; default: the rollouts' --ref-model);\n"
                            "its log-probs are computed in each micro-batch by the call that computes log π_θ")
    paths.add_argument("--critic", default=None, help="PPO: the critic V to train (from train.py --algo ppo)")
    paths.add_argument("--critic-out", default=None, help="PPO: output folder of the critic and its AdamW state")
    loss = p.add_argument_group("the algorithm: the clipped, KL-penalised loss")
    loss.add_argument("--beta", type=float, default=0.01, help="β: weight of the KL penalty (default 0.01)")
    loss.add_argument("--clip-eps", type=float, default=0.2, help="ε (ε_low): clip ρ to [1−ε, 1+ε] (0.2)")
    loss.add_argument("--clip-eps-high", type=float, default=None, help="ε_high: upper clip (default: ε)")
    loss.add_argument("--loss-agg", default="seq", choices=["seq", "token", "dr_grpo"],
                      help="how ℓ_t is averaged: seq, the mean of the sequences' token means (DeepSeekMath,\n"
                           "default); token, Σ ℓ_t / token count (DAPO); dr_grpo, Σ ℓ_t / (N × L_max)")
    loss.add_argument("--dual-clip", type=float, default=None, metavar="C",
                      help="C: for A < 0 cap the token loss at C·|A|, C > 1 (dual-clip PPO, Ye et al. 2020)")
    loss.add_argument("--ratio-level", default="token", choices=["token", "sequence"],
                      help="token: ρ_t per token (default); sequence: one ρ_i = exp(mean_t log ρ_t) per\n"
                           "completion (GSPO, Zheng et al. 2025, with a far smaller ε: 3e-4, ε_high 4e-4)")
    loss.add_argument("--kl-estimator", default="k3", choices=["k1", "k2", "k3"],
                      help="KL estimator in the loss, x = log π_ref − log π_θ (Schulman 2020): k1 = −x,\n"
                           "whose expected gradient on-policy is 0 (noise only); k2 = x²/2, the gradient of\n"
                           "KL(π_θ‖π_ref); k3 = eˣ − x − 1 (default), that of KL(π_ref‖π_θ).\n"
                           "metrics: k3")
    loss.add_argument("--entropy-coef", type=float, default=0.0,
                      help="c: add −c·H_t to ℓ_t (verl; default 0)")
    loss.add_argument("--mask-truncated", action="store_true",
                      help="no loss on completions that reached L_max without EOS (DAPO's overlong filtering)")
    loss.add_argument("--old-logprobs", default=None, choices=["sampler", "recompute"],
                      help="log π_old: the rollouts' (sampler), or this forward's before the first step\n"
                           "(recompute, as TRL and verl do); default: sampler on a CPU, recompute on a GPU")
    loss.add_argument("--ref-logprobs", default=None, choices=["recompute", "rollouts"],
                      help="log π_ref: recompute, from --ref-model beside log π_θ, in its shapes (equal to the bit\n"
                           "at θ = θ_ref); rollouts, the file's ref_logprobs (computed in other shapes, they\n"
                           "differ by rounding, which AdamW can turn into a step: docs/numerics.md). Default:\n"
                           "recompute when a reference is named (--ref-model, or the rollouts'), else rollouts")
    loss.add_argument("--rollout-is", default="none", choices=["none", "tis", "mis"],
                      help="importance weight w_t = π_old/q between π_old and the distribution q the sampler drew\n"
                           "from (the rollouts' sampler_logprobs: top-k/top-p/min-p, or another engine): none\n"
                           "(default); tis, min(w_t, C); mis, w_t, or 0 beyond C (update.py:rollout_is_weights)")
    loss.add_argument("--rollout-is-cap", type=float, default=2.0, metavar="C",
                      help="C: the cap of --rollout-is (default 2, TRL's and verl's)")
    loss.add_argument("--temperature", type=float, default=None, help="τ of log π_θ (default: the rollouts')")
    loss.add_argument("--max-new-tokens", type=int, default=None, help="L_max of dr_grpo (default: rollouts')")
    opt = p.add_argument_group("the optimizer: epochs, minibatches, AdamW")
    opt.add_argument("--lr", type=float, default=1e-6,
                     help="AdamW learning rate (default 1e-6; 0: a frozen control run)")
    opt.add_argument("--lr-schedule", default="constant", choices=["constant", "linear", "cosine"],
                     help="lr by AdamW step: constant, or a linear or cosine decay to 0 at --total-steps")
    opt.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up over this many AdamW steps")
    opt.add_argument("--total-steps", type=int, default=None, help="AdamW steps it spans (train.py sets it)")
    opt.add_argument("--epochs", type=int, default=1, help="μ: passes over the rollouts (default 1)")
    opt.add_argument("--minibatch-size", type=int, default=0, help="completions per AdamW step (0: all)")
    opt.add_argument("--max-grad-norm", type=float, default=1.0,
                     help="clip the gradient's norm to this (default 1.0; inf: no clipping)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    opt.add_argument("--max-bad-steps", type=int, default=5, help="non-finite steps skipped, at most (5)")
    opt.add_argument("--fresh-optimizer", action="store_true", help="ignore optimizer.safetensors in --model")
    opt.add_argument("--seed", type=int, default=0, help="seed of the minibatch shuffle (default 0)")
    ppo = p.add_argument_group("PPO's critic")
    ppo.add_argument("--critic-lr", type=float, default=None,
                     help="the critic's AdamW lr (default 10 × --lr: its head starts from zero and must fit\n"
                          "the returns within a few steps while the policy moves slowly; verl's defaults)")
    ppo.add_argument("--critic-epochs", type=int, default=None,
                     help="PPO: the critic's passes over the rollouts, each a shuffle cut into minibatches of\n"
                          "--minibatch-size, one AdamW step each (default: --epochs; verl's critic.ppo_epochs)")
    ppo.add_argument("--critic-only", action="store_true",
                     help="PPO: step the critic alone; --out gets the policy unchanged (train.py --critic-warmup)")
    ppo.add_argument("--vf-coef", type=float, default=1.0, help="c_V: weight of the value loss (default 1)")
    ppo.add_argument("--value-clip", type=float, default=0.2,
                     help="ε_v: clip V − V_old to ±ε_v (default 0.2)")
    mem = p.add_argument_group("memory and devices")
    mem.add_argument("--micro-batch-size", type=int, default=0, help="rows per forward/backward (default: all)")
    mem.add_argument("--gradient-checkpointing", action="store_true",
                     help="recompute each layer's activations in the backward pass instead of keeping them:\n"
                          "less memory, about one more forward pass of time; the same numbers")
    mem.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=True,
                     help="run each distinct prompt of a micro-batch once and let its completions attend to\n"
                          "its keys and values (default); --no-prefix-sharing: each row's prompt its own\n"
                          "(the reference path; the same numbers). Off under --gradient-checkpointing")
    mem.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 shards instead of DDP copies")
    add_runtime_flags(mem)
    lora.add_flags(p.add_argument_group("LoRA"))
    provenance.add_flag(paths)
    return p


# What each setting may be, checked before anything is read or written (train.py's runs too).
RULES = {"lr": between(0, 1), "warmup_steps": at_least(0), "beta": at_least(0),
         "clip_eps": between(0, 1, lo_open=True), "clip_eps_high": above(0), "dual_clip": above(1),
         "entropy_coef": at_least(0), "critic_lr": between(0, 1, lo_open=True), "critic_epochs": at_least(1), "vf_coef": at_least(0),
         "value_clip": above(0), "epochs": at_least(1), "minibatch_size": at_least(0), "rollout_is_cap": at_least(1),
         "micro_batch_size": at_least(0), "max_grad_norm": above_or_inf(0), "weight_decay": at_least(0),
         "temperature": above(0), "max_new_tokens": at_least(1), "max_bad_steps": at_least(0),
         **lora.RULES, "total_steps": at_least(1)}    # last: train.py derives it from the others


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    settings.check(args, RULES)
    if args.clip_eps_high is None:
        args.clip_eps_high = args.clip_eps
    if args.lora_r and args.fsdp:
        raise StageError("--lora-r with --fsdp: LoRA adapters are not sharded here yet; use DDP (no --fsdp)")
    if args.lr_schedule != "constant" and not args.total_steps:
        raise StageError(f"--lr-schedule {args.lr_schedule} decays to 0 at --total-steps, which is missing")
    if args.ref_model and args.ref_logprobs == "rollouts":
        raise StageError("--ref-model with --ref-logprobs rollouts: the file's log π_ref would be used and the "
                         "model not; give one")
    if (args.critic is None) != (args.critic_out is None):
        raise StageError("--critic and --critic-out go together: the critic read and the critic written")
    if args.critic_only and not args.critic:
        raise StageError("--critic-only steps the critic alone, and no --critic is given")
    if args.critic_lr is None:
        args.critic_lr = 10 * args.lr
    if args.critic_epochs is None:
        args.critic_epochs = args.epochs
    if args.prefix_sharing and args.gradient_checkpointing:
        warn_once("update: no prefix sharing under --gradient-checkpointing (transformers' checkpointed "
                  "layers take no KV cache); each row computes its own prompt")
        args.prefix_sharing = False
    if args.old_logprobs is None:   # bf16 autocast on a GPU makes the sampler's and the update's differ
        args.old_logprobs = "recompute" if distributed.pick_device(args.device).type == "cuda" else "sampler"
    return args


def main(argv=None):
    args = parse_args(argv)
    outputs.check_dir(args.out, "update.py", apart={"--model": args.model})
    if args.critic_out:
        outputs.check_dir(args.critic_out, "update.py", "--critic-out",
                          apart={"--out": args.out, "--critic": args.critic, "--model": args.model})
    if args.beta == 0:
        warn(diagnostics.BETA_ZERO_WARNING)
    if args.kl_estimator == "k1" and args.beta != 0:
        warn(diagnostics.K1_WARNING)
    rollouts, advantages, returns = stage_inputs.update_inputs(args)
    device = distributed.init_distributed(args.device)
    tokenizer = loading.load_tokenizer(args.model, args.trust_remote_code)
    policy = lora.load_policy(args.model, device, args)          # or its LoRA adapters
    provenance.tokenizer_of_rollouts(args.rollouts, tokenizer, args.model, args.allow_mismatch)
    stage_inputs.check_token_ids(args.rollouts, rollouts, policy)
    if args.old_logprobs == "sampler":
        provenance.policy_of_rollouts(args.rollouts, policy, args.model, args.allow_mismatch)
    provenance.check_tokenizers(tokenizer, args)
    ref_model = args.ref_model and lora.load_reference(args.ref_model, policy, device, args.trust_remote_code)
    policy = distributed.distribute(policy, args.fsdp)                      # DDP or FSDP2 under torchrun
    optimizer = optim.adamw(policy, args.lr, args.weight_decay,
                            optim.optimizer_state(args.model, args.fresh_optimizer))
    critic = None
    if args.critic:
        critic_model = loading.load_critic(args.critic, device, args.trust_remote_code)
        critic_model = distributed.distribute(critic_model, args.fsdp)
        critic = optim.Critic(critic_model, optim.adamw(critic_model, args.critic_lr, args.weight_decay,
                                                        optim.optimizer_state(args.critic, args.fresh_optimizer)))

    if not advantages.any():
        warn(f"update: every advantage in {args.advantages} is 0, so the policy term moves nothing: the step "
             f"follows β·KL (0 while θ = θ_ref) and the entropy bonus alone")
    t0 = time.perf_counter()
    metrics = {} if args.critic_only else train_policy(policy, optimizer, rollouts, advantages, args, ref_model or None)
    if critic:
        metrics.update(train_critic(critic, rollouts, returns, args))
    metrics["seconds"] = time.perf_counter() - t0
    checkpoints.save_policy(policy, tokenizer, optimizer, metrics, args, args.out)
    if critic:
        checkpoints.save_policy(critic.model, tokenizer, critic.optimizer, metrics, args, args.critic_out)
    if distributed.is_main():
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}))


if __name__ == "__main__":
    run_cli(main)
