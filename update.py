"""Stage 4 of GRPO: update the policy with PPO's clipped objective and a β·KL penalty to π_ref.

For every completion token o_t of completion o_i (DeepSeekMath, eq. 3; docs/formats.md):

    ρ_t   = exp(log π_θ(o_t) − log π_old(o_t))
    ℓ_t   = −min(ρ_t·A_i, clip(ρ_t, 1−ε_low, 1+ε_high)·A_i) + β·k3_t        (--policy-loss ppo)
    k3_t  = exp(log π_ref(o_t) − log π_θ(o_t)) − (log π_ref(o_t) − log π_θ(o_t)) − 1
    loss  = mean over sequences of the masked token mean of ℓ_t          (--loss-agg seq)

Reads   --model DIR        the policy π_θ (π_old before the first step), and AdamW's state if DIR
                           holds optimizer.safetensors (unless --fresh-optimizer)
        --ref-model DIR    π_ref (default: the one the rollouts were sampled against)
        --rollouts FILE    rollouts.safetensors: ids and masks, old_logprobs [N, T]
        --advantages FILE  advantages.safetensors: advantages [N] (or [N, T]), group_ids [N]
Writes  --out DIR          a Hugging Face checkpoint, optimizer.safetensors, metrics.json (docs/formats.md)

PPO with a critic (--critic DIR --critic-out DIR): the advantages are per token (advantage.py
--estimator gae), and after the policy's steps the critic V takes its own on PPO's clipped value
loss (grpo/training/ppo_critic.py); --critic-only steps it alone.

Example:
    python update.py --model ckpt/ --rollouts it0/rollouts.safetensors \\
        --advantages it0/advantages.safetensors --out ckpt1/ --lr 1e-6 --beta 0.01 --clip-eps 0.2

Choices where the paper and docs/formats.md are silent (docs/numerics.md says why):
- log π_θ is modeling.completion_logprobs, sample.py's function, at the rollouts' τ. log π_old is the
  rollouts' on a CPU, recomputed before the first step on a GPU (--old-logprobs): bf16 rounding
  would otherwise count as policy change in a tight clip band.
- log π_ref is computed beside log π_θ, by the same call on the same rows without gradients (as TRL),
  so at θ = θ_ref the two are equal to the bit and a batch with no signal moves nothing.
- k3's x is clamped to ±20 (e^x overflows float32 at 88); β = 0 leaves the penalty out of ℓ_t.
- μ = --epochs seeded shuffles cut into minibatches of --minibatch-size, one AdamW step each, run in
  micro-batches whose losses carry the minibatch's normaliser: the gradient does not depend on the
  split, nor under torchrun on the ranks. Each distinct prompt of a micro-batch runs once.
- lr at step s is lr·(s + 1)/W over W = --warmup-steps (the first step moves), then --lr-schedule.
- Dropout is off, so ρ = 1 exactly on the first, on-policy step; gradients are clipped to
  --max-grad-norm. --out is replaced as a unit; the inputs must belong together (--allow-mismatch).
"""

import argparse
import json
import time
from typing import NamedTuple

import torch
from tqdm import tqdm

from grpo import lora, settings
from grpo.cli import ArgumentParser, StageError, add_runtime_flags, run_cli, warn, warn_once
from grpo.disk import checkpoints, outputs, provenance, stage_inputs
from grpo.loop import diagnostics
from grpo.models import distributed, loading, modeling
from grpo.settings import above, above_or_inf, at_least, between
from grpo.training import minibatches, optim, ppo_critic
from grpo.training.minibatches import aggregate
from grpo.training.update_metrics import UpdateMetrics


# ----------------------------------------------------------------------------------------
# The algorithm: the policy losses (one function each, chosen by --policy-loss) and the terms composed
# around them (importance weight, KL penalty, entropy bonus); --loss-agg's `aggregate` is minibatches'.
# Each policy loss maps log π_θ, log π_old, A (advantages [n] → [n, 1], or GAE's [n, T]) and the mask
# [n, T] to its token loss [n, T], the ratio it clips [n, T], and the tokens its clip acted on.

class Clip(NamedTuple):
    """The clip band [1 − ε_low, 1 + ε_high] (--clip-eps, --clip-eps-high) and dual-clip's C."""
    low: float
    high: float
    dual: float | None = None


def ppo_clip(logp, old_logp, A, mask, clip):
    """PPO's clipped surrogate (Schulman et al. 2017; DeepSeekMath eq. 3), with DAPO's clip-higher
    where ε_high > ε_low. A clipped token (the clip the active term) gets no gradient.

        ρ_t = exp(log π_θ(o_t) − log π_old(o_t))
        ℓ_t = −min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A)"""
    return clipped_surrogate(torch.exp(logp - old_logp), A, clip)


def gspo(logp, old_logp, A, mask, clip):
    """GSPO (Zheng et al. 2025): one ratio per completion, the exp of its mean token log-ratio, clipped
    as PPO's, with a far smaller band (GSPO's ε_low 3e-4, ε_high 4e-4). A clipped completion gets no
    gradient.

        ρ_i = exp((1/|o_i|) Σ_t (log π_θ(o_t) − log π_old(o_t)))
        ℓ_t = −min(ρ_i·A, clip(ρ_i, 1 − ε_low, 1 + ε_high)·A)          for every token t of o_i"""
    log_ratio = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return clipped_surrogate(torch.exp(log_ratio.expand_as(logp)), A, clip)    # ρ_i, constant along T [n, T]


def dual_clip(logp, old_logp, A, mask, clip):
    """Dual-clip PPO (Ye et al. 2020): PPO's clip, and for A < 0 a loss of at most C·|A| however large
    ρ_t grows (C = --dual-clip > 1). A token of either clip gets no gradient.

        ℓ_t = min(−min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A), C·|A|)     where A < 0"""
    pg_loss, ratio, clipped = ppo_clip(logp, old_logp, A, mask, clip)
    dual = (A < 0) & (pg_loss > clip.dual * A.abs())                           # [n, T]
    return torch.where(dual, clip.dual * A.abs(), pg_loss), ratio, {**clipped, "dual": dual}


def cispo(logp, old_logp, A, mask, clip):
    """CISPO (MiniMax-M1, 2025): the clipped ratio is a weight without gradient on the REINFORCE term,
    so every token keeps its gradient; a clipped token's weight is capped, its gradient not dropped.

        ρ_t = exp(log π_θ(o_t) − log π_old(o_t))
        ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high))·A·log π_θ(o_t)"""
    ratio = torch.exp(logp - old_logp)                                         # ρ_t [n, T]
    weight = torch.clamp(ratio, 1 - clip.low, 1 + clip.high).detach()          # sg(clip(ρ_t))
    return -weight * A * logp, ratio, {"low": ratio < 1 - clip.low, "high": ratio > 1 + clip.high}


def clipped_surrogate(ratio, A, clip):
    """−min(ρ·A, clip(ρ)·A) and where the clip is the active term, below and above the band."""
    pg_loss = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * A)   # [n, T]
    return pg_loss, ratio, {"low": (ratio < 1 - clip.low) & (A < 0), "high": (ratio > 1 + clip.high) & (A > 0)}


# --policy-loss NAME → (the loss, what its clip does to a token whose ratio leaves the band).
POLICY_LOSSES = {"ppo": (ppo_clip, "get no gradient"), "gspo": (gspo, "get no gradient"),
                 "dual_clip": (dual_clip, "get no gradient"), "cispo": (cispo, "keep their gradient, weight capped")}

# --kl-estimator: x = log π_ref − log π_θ (Schulman 2020). k1's expected gradient on-policy is 0 (noise
# only: warned); k2's is ∇KL(π_θ‖π_ref); k3's, ∇KL(π_ref‖π_θ). k3 is the KL reported whichever is used.
KL_ESTIMATORS = {"k1": lambda x: -x, "k2": lambda x: x ** 2 / 2, "k3": lambda x: torch.exp(x) - x - 1}


def token_loss(pg_loss, logp, ref_logp, *, beta, kl_estimator="k3", entropy=None, entropy_coef=0.0):
    """ℓ_t of docs/formats.md from the policy loss's term pg_t: plus β times the KL estimator k_t, minus
    c·H_t (`entropy`, with its gradient; verl). Returns ℓ_t, k3_t and k_t, [n, T] each.

        ℓ_t = pg_t + β·k_t − c·H_t"""
    kl = penalty = torch.zeros_like(logp)
    if ref_logp is not None:
        # x bounded to ±20 as verl does: e^x overflows float32 beyond 88.
        x = (ref_logp - logp).clamp(-20.0, 20.0)                               # [n, T]
        kl = KL_ESTIMATORS["k3"](x)                                            # k3_t, the KL reported
        penalty = KL_ESTIMATORS[kl_estimator](x)                               # k_t in the loss
    loss = pg_loss                                                             # ℓ_t [n, T]
    if beta != 0:                   # β = 0 adds no penalty at all (0·inf would be NaN)
        loss = loss + beta * penalty
    if entropy_coef != 0:
        loss = loss - entropy_coef * entropy
    return loss, kl, penalty


def rollout_is_weights(old_logp, sampler_logp, mode, cap, level="token", mask=None):
    """The importance weight between the trainer's π_old and the distribution q the tokens were drawn
    from (the sampler's after top-k/top-p/min-p, or another engine's), [n, T]:

        w_t = π_old(o_t) / q(o_t) = exp(log π_old(o_t) − log q(o_t))          --rollout-is-level token
        w_i = Π_t w_t = exp(Σ_t (log π_old(o_t) − log q(o_t)))               sequence: one per completion
        tis:  min(w, C)                        truncated importance sampling (Yao et al. 2025)
        mis:  w where w ≤ C, else 0            masked: a token (a completion) beyond the cap leaves the loss

    with C = --rollout-is-cap; w_i (TRL's and verl's) sums over the tokens of `mask` [n, T] (default:
    all) and is repeated along T. Without gradients: π_old and q are fixed before the update."""
    if level == "token":
        w = torch.exp(old_logp - sampler_logp)                                 # [n, T]
    else:   # summed in float64, the exponent kept below exp's overflow (709), so no inf can meet a 0
        x = old_logp.double() - sampler_logp.double()                          # log w_t [n, T]
        x = x if mask is None else torch.where(mask, x, 0.0)
        w = torch.exp(x.sum(-1, keepdim=True).clamp(max=700.0)).expand_as(x)   # w_i [n, 1] → [n, T]
    w = w.clamp(max=cap) if mode == "tis" else torch.where(w <= cap, w, 0.0)
    return w.to(old_logp.dtype)


# ----------------------------------------------------------------------------------------
# The loop: μ epochs → minibatches (one AdamW step each) → micro-batches (one backward each)

def train_policy(policy, optimizer, rollouts, advantages, args, ref_model=None):
    """μ epochs of clipped-objective AdamW steps on the rollouts; returns metrics.json's dict.

    log π_ref comes from `ref_model` by the very call that computes log π_θ, on the same rows and
    shapes, so at θ = θ_ref the two are equal to the bit (docs/numerics.md); without one, from the
    rollouts' ref_logprobs."""
    plan = minibatches.plan(len(rollouts["group_ids"]), args.epochs, args.minibatch_size, args.seed)
    rollouts = training_rows(policy, rollouts, advantages, args, plan[0])
    mismatch = (diagnostics.rollout_mismatch(rollouts, args.rollout_is_cap, args.rollout_is_level)
                if "sampler_logprobs" in rollouts else {})
    log = UpdateMetrics(Clip(args.clip_eps, args.clip_eps_high), ref_model is not None or "ref_logprobs" in rollouts)
    skipped = 0
    with (modeling.gradient_checkpointing([policy], args.gradient_checkpointing),
          lora.dropout(policy, args.lora_dropout, args.seed)):
        for rows in tqdm([rows for epoch in plan for rows in epoch], desc="update", leave=False,
                         disable=None if distributed.is_main() else True):                      # [M]
            if not policy_step(policy, optimizer, ref_model, rollouts, rows, args, log):
                skipped = optim.skip_step(optimizer, skipped, log.grad_norm, log.sums["loss"], args.max_bad_steps)
    for warning in log.warnings(POLICY_LOSSES[args.policy_loss][1]):
        warn(warning)
    return {**log.summary(skipped), **mismatch}


def policy_step(policy, optimizer, ref_model, rollouts, rows, args, log):
    """One AdamW step on the minibatch `rows`, its metrics recorded in `log`; False when its loss or
    gradient is not finite (NaN would reach every weight: no step then)."""
    num_seqs, num_tokens = len(rows), max(int(rollouts["loss_mask"][rows].sum()), 1)   # its normalisers
    optimizer.zero_grad(set_to_none=True)
    log.start()
    for batch, weight in minibatches.accumulation_passes(policy, rollouts, rows, args.micro_batch_size):
        loss, terms = micro_batch_loss(policy, ref_model, batch, args, num_seqs, num_tokens)
        (loss * weight).backward()                # DDP and FSDP average over ranks; × world: a sum
        if weight:                                # weight 0: a pass that pads this rank's share
            log.add(batch, loss, terms)
    grad_norm = optim.clip_gradients(policy, args.max_grad_norm)                # the norm before clipping
    if not log.end_minibatch(grad_norm):
        return False
    lr = optim.schedule_lr(optimizer, args.lr, args.warmup_steps, args.lr_schedule, args.total_steps,
                           args.weight_decay)
    optimizer.step()
    log.step(num_tokens, lr)
    return True


def micro_batch_loss(policy, ref_model, batch, args, num_seqs, num_tokens):
    """One micro-batch's share of the minibatch loss (with its gradient) and its per-token terms."""
    loss_mask = batch["loss_mask"]                                                         # [n, T]
    inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])
    ref_logp = batch.get("ref_logprobs")                                                   # [n, T]
    if ref_model is not None:
        with torch.no_grad():
            ref_logp = modeling.completion_logprobs(ref_model, *inputs, args.temperature,
                                                    share_prefix=args.prefix_sharing)          # log π_ref
    logp, entropy = modeling.completion_logprobs(
        policy, *inputs, args.temperature, with_entropy=True, entropy_grad=args.entropy_coef != 0,
        share_prefix=args.prefix_sharing)                                                  # log π_θ [n, T]
    A = batch["advantages"][:, None] if batch["advantages"].dim() == 1 else batch["advantages"]   # [n, 1] or [n, T]
    policy_loss = POLICY_LOSSES[args.policy_loss][0]
    pg_loss, ratio, clipped = policy_loss(logp, batch["old_logprobs"], A, batch["policy_tokens"],
                                          Clip(args.clip_eps, args.clip_eps_high, args.dual_clip))   # [n, T]
    if "is_weight" in batch:                      # the sampler's tokens reweighed to π_old (--rollout-is)
        pg_loss = batch["is_weight"] * pg_loss
    loss_t, kl, penalty = token_loss(pg_loss, logp, ref_logp, beta=args.beta, kl_estimator=args.kl_estimator,
                                     entropy=entropy, entropy_coef=args.entropy_coef)        # ℓ_t [n, T]
    loss = aggregate(loss_t, loss_mask, args.loss_agg, num_seqs, num_tokens, args.max_new_tokens)
    terms = {"pg_loss": pg_loss, "kl": kl, "kl_penalty": penalty, "ratio": ratio, "clipped_low": clipped["low"],
             "clipped_high": clipped["high"], "dual_clipped": clipped.get("dual"), "logp": logp,
             "ref_logp": ref_logp, "entropy": entropy, "policy_loss": aggregate(
                 pg_loss.detach(), loss_mask, args.loss_agg, num_seqs, num_tokens, args.max_new_tokens)}
    return loss, terms


def training_rows(policy, rollouts, advantages, args, first_epoch):
    """The rollouts the update trains on, with their advantages and loss_mask. With --old-logprobs
    recompute, log π_old comes from the policy as it is now, in the passes of the first epoch
    (`first_epoch`: its minibatches' rows), every rank's, so that the first step's ratio is exactly 1.
    With --rollout-is, each token's importance weight between that π_old and the sampler's q (its
    completion's, --rollout-is-level sequence): sampler_logprobs, or without them the file's old_logprobs,
    the sampling policy's own (the decoupled objective of stale rollouts, docs/numerics.md)."""
    rollouts = {**rollouts, "loss_mask": minibatches.loss_mask(rollouts, args.mask_truncated), "advantages": advantages,
                "policy_tokens": minibatches.policy_tokens(rollouts)}
    if args.rollout_is != "none" and "sampler_logprobs" not in rollouts:   # recomputed π_old (π_prox): q is
        rollouts["sampler_logprobs"] = rollouts["old_logprobs"]            # the sampler's own (π_behav)
    if args.old_logprobs == "recompute":   # every rank computes every row: under FSDP a forward is a collective
        passes = [idx for rows in first_epoch for idx in distributed.every_rank_passes(rows, args.micro_batch_size)]
        rollouts["old_logprobs"] = modeling.rollout_logprobs(policy, rollouts, args.temperature, 0,
                                                             args.prefix_sharing, passes).cpu()
    if args.rollout_is != "none":
        rollouts["is_weight"] = rollout_is_weights(rollouts["old_logprobs"], rollouts["sampler_logprobs"],
                                                   args.rollout_is, args.rollout_is_cap, args.rollout_is_level,
                                                   rollouts["policy_tokens"])                      # [N, T]
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
    paths.add_argument("--ref-model", default=None, help="π_ref, the frozen reference (default: the rollouts')")
    paths.add_argument("--critic", default=None, help="PPO: the critic V to train (from train.py --algo ppo)")
    paths.add_argument("--critic-out", default=None, help="PPO: output folder of the critic and its AdamW state")
    loss = p.add_argument_group("the algorithm: the clipped, KL-penalised loss")
    loss.add_argument("--beta", type=float, default=0.01, help="β: weight of the KL penalty (default 0.01)")
    loss.add_argument("--clip-eps", type=float, default=0.2, help="ε (ε_low): clip ρ to [1−ε, 1+ε] (0.2)")
    loss.add_argument("--clip-eps-high", type=float, default=None, help="ε_high: upper clip (default: ε)")
    loss.add_argument("--policy-loss", default="ppo", choices=list(POLICY_LOSSES),
                      help="the policy term of ℓ_t, a function of update.py:POLICY_LOSSES (default ppo)")
    loss.add_argument("--dual-clip", type=float, default=None, metavar="C", help="C > 1 of dual_clip (default 3)")
    loss.add_argument("--loss-agg", default="seq", choices=["seq", "token", "dr_grpo"],
                      help="how ℓ_t is averaged: seq (DeepSeekMath, default), token (DAPO), dr_grpo (Dr. GRPO)")
    loss.add_argument("--kl-estimator", default="k3", choices=list(KL_ESTIMATORS),
                      help="the KL estimator k_t in ℓ_t (Schulman 2020; default k3, the one reported)")
    loss.add_argument("--entropy-coef", type=float, default=0.0, help="c: add −c·H_t to ℓ_t (verl; default 0)")
    loss.add_argument("--mask-truncated", action="store_true",
                      help="no loss on completions that reached L_max without EOS (DAPO's overlong filtering)")
    loss.add_argument("--old-logprobs", default=None, choices=["sampler", "recompute"],
                      help="log π_old: the rollouts', or this forward's (default: sampler on a CPU, else recompute)")
    loss.add_argument("--ref-logprobs", default=None, choices=["recompute", "rollouts"],
                      help="log π_ref: beside log π_θ, or the rollouts' (default: recompute given a reference)")
    loss.add_argument("--rollout-is", default="none", choices=["none", "tis", "mis"],
                      help="w_t = π_old/q, the sampler's q: none (default), truncated at C, or masked beyond C")
    loss.add_argument("--rollout-is-level", default="token", choices=["token", "sequence"],
                      help="w's level: w_t per token (default), or w_i = Π_t w_t per completion (TRL, verl)")
    loss.add_argument("--rollout-is-cap", type=float, default=2.0, metavar="C",
                      help="C: the cap of --rollout-is (default 2: verl's, token level; TRL's default masks w_i at 3)")
    loss.add_argument("--temperature", type=float, default=None, help="τ of log π_θ (default: the rollouts')")
    loss.add_argument("--max-new-tokens", type=int, default=None, help="L_max of dr_grpo (default: rollouts')")
    opt = p.add_argument_group("the optimizer: epochs, minibatches, AdamW")
    opt.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (default 1e-6; 0: a frozen control)")
    opt.add_argument("--lr-schedule", default="constant", choices=["constant", "linear", "cosine"],
                     help="lr by AdamW step: constant, or a linear or cosine decay to 0 at --total-steps")
    opt.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up over this many AdamW steps")
    opt.add_argument("--total-steps", type=int, default=None, help="AdamW steps it spans (train.py sets it)")
    opt.add_argument("--epochs", type=int, default=1, help="μ: passes over the rollouts (default 1)")
    opt.add_argument("--minibatch-size", type=int, default=0, help="completions per AdamW step (0: all)")
    opt.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradient's norm to (1.0; inf: none)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    opt.add_argument("--max-bad-steps", type=int, default=5, help="non-finite steps skipped, at most (5)")
    opt.add_argument("--fresh-optimizer", action="store_true", help="ignore optimizer.safetensors in --model")
    opt.add_argument("--seed", type=int, default=0, help="seed of the minibatch shuffle (default 0)")
    ppo_critic.add_flags(p.add_argument_group("PPO's critic"))
    mem = p.add_argument_group("memory and devices")
    mem.add_argument("--micro-batch-size", type=int, default=0, help="rows per forward/backward (default: all)")
    mem.add_argument("--gradient-checkpointing", action="store_true",
                     help="recompute activations in the backward pass: less memory, the same numbers")
    mem.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=True,
                     help="run each distinct prompt of a micro-batch once (default; the same numbers)")
    mem.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 shards instead of DDP copies")
    add_runtime_flags(mem)
    lora.add_flags(p.add_argument_group("LoRA"))
    provenance.add_flag(paths)
    return p


# What each setting may be, checked before anything is read or written (train.py's runs too).
RULES = {"lr": between(0, 1), "warmup_steps": at_least(0), "beta": at_least(0), "clip_eps": between(0, 1, lo_open=True),
         "clip_eps_high": above(0), "dual_clip": above(1), "entropy_coef": at_least(0), **ppo_critic.RULES,
         "epochs": at_least(1), "minibatch_size": at_least(0), "rollout_is_cap": at_least(1),
         "micro_batch_size": at_least(0), "max_grad_norm": above_or_inf(0), "weight_decay": at_least(0),
         "temperature": above(0), "max_new_tokens": at_least(1), "max_bad_steps": at_least(0),
         **lora.RULES, "total_steps": at_least(1)}    # last: train.py derives it from the others


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    settings.check(args, RULES)
    if args.clip_eps_high is None:
        args.clip_eps_high = args.clip_eps
    if args.dual_clip is not None and args.policy_loss != "dual_clip":
        raise StageError(f"--dual-clip {args.dual_clip} is C of --policy-loss dual_clip, and the loss is "
                         f"{args.policy_loss}; add --policy-loss dual_clip or leave --dual-clip out")
    if args.policy_loss == "dual_clip" and args.dual_clip is None:
        args.dual_clip = 3.0
    if args.lora_r and args.fsdp:
        raise StageError("--lora-r with --fsdp: LoRA adapters are not sharded here yet; use DDP (no --fsdp)")
    if args.lr_schedule != "constant" and not args.total_steps:
        raise StageError(f"--lr-schedule {args.lr_schedule} decays to 0 at --total-steps, which is missing")
    if args.ref_model and args.ref_logprobs == "rollouts":
        raise StageError("--ref-model with --ref-logprobs rollouts: the file's log π_ref would be used and the "
                         "model not; give one")
    ppo_critic.check_flags(args)
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
    for warning in diagnostics.penalty_warnings(args.beta, args.kl_estimator):
        warn(warning)
    rollouts, advantages, returns = stage_inputs.update_inputs(args)
    device = distributed.init_distributed(args.device)
    tokenizer = loading.load_tokenizer(args.model, args.trust_remote_code)
    policy = lora.load_policy(args.model, device, args)          # or its LoRA adapters
    provenance.tokenizer_of_rollouts(args.rollouts, tokenizer, args.model, args.allow_mismatch)
    stage_inputs.check_token_ids(args.rollouts, rollouts, policy)
    if args.old_logprobs == "sampler":
        provenance.policy_of_rollouts(args.rollouts, policy, args.model, args.allow_mismatch)
    provenance.check_tokenizers(tokenizer, {"reference": args.ref_model, "critic": args.critic},
                                args.allow_mismatch, args.trust_remote_code)
    ref_model = args.ref_model and lora.load_reference(args.ref_model, policy, device, args.trust_remote_code)
    policy = distributed.distribute(policy, args.fsdp)                      # DDP or FSDP2 under torchrun
    optimizer = optim.adamw(policy, args.lr, args.weight_decay,
                            optim.optimizer_state(args.model, args.fresh_optimizer))
    critic = ppo_critic.load(args.critic, device, args) if args.critic else None

    if not advantages.any():
        warn(f"update: every advantage in {args.advantages} is 0, so the policy term moves nothing: the step "
             f"follows β·KL (0 while θ = θ_ref) and the entropy bonus alone")
    t0 = time.perf_counter()
    metrics = {} if args.critic_only else train_policy(policy, optimizer, rollouts, advantages, args, ref_model or None)
    if critic:
        metrics.update(ppo_critic.train_critic(critic, rollouts, returns, args))
    metrics["seconds"] = time.perf_counter() - t0
    checkpoints.save_policy(policy, tokenizer, optimizer, metrics, args, args.out)
    if critic:
        checkpoints.save_policy(critic.model, tokenizer, critic.optimizer, metrics, args, args.critic_out)
    if distributed.is_main():
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}))


if __name__ == "__main__":
    run_cli(main)
