"""PPO's critic (update.py --critic): the value network V, its flags, its clipped value loss and its
AdamW steps, taken after the policy's on the same rollouts and read the same way as update.py:policy_step.

    L_V = vf_coef · ½·max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t, ±ε_v) − R_t)²)

R_t the advantages file's `returns`, V_old the rollouts' `values` (the critic's at sampling time),
aggregated over the policy's tokens like the policy loss (--loss-agg). `args` is update.py's: its
critic flags are this module's (add_flags, RULES, check_flags), as LoRA's are grpo/lora.py's.
"""

import math
from collections import Counter
from dataclasses import dataclass

import torch

from grpo.cli import StageError
from grpo.loop import diagnostics
from grpo.models import distributed, loading, modeling
from grpo.settings import above, at_least, between
from grpo.training import minibatches, optim

# What the critic's flags may be, in update.py's RULES.
RULES = {"critic_lr": between(0, 1, lo_open=True), "critic_epochs": at_least(1), "vf_coef": at_least(0),
         "value_clip": above(0)}


@dataclass
class Critic:
    """PPO's value network V and its own AdamW."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def add_flags(parser):
    """update.py's flags of PPO's critic (the critic's folders are among its files)."""
    parser.add_argument("--critic-lr", type=float, default=None, help="the critic's AdamW lr (default 10 × --lr)")
    parser.add_argument("--critic-epochs", type=int, default=None, help="the critic's passes (default: --epochs)")
    parser.add_argument("--critic-only", action="store_true",
                        help="PPO: step the critic alone; --out gets the policy unchanged (train.py --critic-warmup)")
    parser.add_argument("--vf-coef", type=float, default=1.0, help="c_V: weight of the value loss (default 1)")
    parser.add_argument("--value-clip", type=float, default=0.2, help="ε_v: clip V − V_old to ±ε_v (default 0.2)")


def check_flags(args):
    """update.py's critic flags together, and the defaults that follow the policy's (lr, epochs)."""
    if (args.critic is None) != (args.critic_out is None):
        raise StageError("--critic and --critic-out go together: the critic read and the critic written")
    if args.critic_only and not args.critic:
        raise StageError("--critic-only steps the critic alone, and no --critic is given")
    if args.critic_lr is None:
        args.critic_lr = 10 * args.lr
    if args.critic_epochs is None:
        args.critic_epochs = args.epochs


def load(path, device, args):
    """The critic of `path` on `device` (DDP or FSDP2 under torchrun), with its AdamW continued from the
    folder's optimizer.safetensors (unless --fresh-optimizer)."""
    model = distributed.distribute(loading.load_critic(path, device, args.trust_remote_code), args.fsdp)
    return Critic(model, optim.adamw(model, args.critic_lr, args.weight_decay,
                                     optim.optimizer_state(path, args.fresh_optimizer)))


def clipped_value_loss(values, old_values, returns, value_clip):
    """PPO's clipped value loss per token, ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²),
    and where the clipped term is the larger (so the step cannot move V further than ε_v). [n, T] each."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)     # [n, T]
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.max(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq


def train_critic(critic, rollouts, returns, args):
    """--critic-epochs seeded shuffles of the rows in minibatches of --minibatch-size, one AdamW step
    each (at --critic-lr) on the clipped value loss towards `returns`; returns its metrics: the means
    over its steps and the explained variance of the sampled V_old (how much of the returns' variance
    the critic predicted)."""
    plan = minibatches.plan(len(rollouts["group_ids"]), args.critic_epochs, args.minibatch_size, args.seed)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "values")
    rollouts = {**{k: rollouts[k] for k in keys}, "returns": returns, "policy_tokens": minibatches.policy_tokens(rollouts),
                "loss_mask": minibatches.loss_mask(rollouts, args.mask_truncated)}
    steps, skipped = [], 0
    with modeling.gradient_checkpointing([critic.model], args.gradient_checkpointing):
        for rows in (rows for epoch in plan for rows in epoch):                                   # [M]
            step = critic_step(critic, rollouts, rows, args)
            if not (math.isfinite(step["value_loss"]) and math.isfinite(step["value_grad_norm"])):
                skipped = optim.skip_step(critic.optimizer, skipped, step["value_grad_norm"], step["value_loss"],
                                          args.max_bad_steps)
                continue
            steps.append(step)
    metrics = {k: sum(s[k] for s in steps) / len(steps) if steps else None
               for k in ("value_loss", "value_grad_norm", "value_clip_frac", "value_mean")}
    return {**metrics, "critic_steps": len(steps), "critic_skipped_steps": skipped,
            "explained_variance": diagnostics.explained_variance(rollouts["values"], returns,
                                                                 rollouts["policy_tokens"])}


def critic_step(critic, rollouts, rows, args):
    """One AdamW step of the critic on the minibatch `rows` (none when its loss or gradient is not
    finite); returns its metrics."""
    num_seqs, num_tokens = len(rows), max(int(rollouts["loss_mask"][rows].sum()), 1)   # its normalisers
    critic.optimizer.zero_grad(set_to_none=True)
    sums = Counter(dict.fromkeys(("value_loss", "value_clipped", "value_sum"), 0.0))
    for batch, weight in minibatches.accumulation_passes(critic.model, rollouts, rows, args.micro_batch_size):
        loss, batch_sums = value_loss(critic.model, batch, args, num_seqs, num_tokens)
        (loss * weight).backward()
        if weight:
            sums.update(batch_sums)
    sums = distributed.all_reduce(sums, "sum")
    grad_norm = optim.clip_gradients(critic.model, args.max_grad_norm)
    if math.isfinite(sums["value_loss"]) and math.isfinite(grad_norm):
        # The policy's schedule, counted in the critic's own steps.
        optim.schedule_lr(critic.optimizer, args.critic_lr, args.warmup_steps, args.lr_schedule, args.total_steps,
                          args.weight_decay)
        critic.optimizer.step()
    return {"value_loss": sums["value_loss"], "value_grad_norm": grad_norm,
            "value_clip_frac": sums["value_clipped"] / num_tokens, "value_mean": sums["value_sum"] / num_tokens}


def value_loss(model, batch, args, num_seqs, num_tokens):
    """One micro-batch's share of the critic's minibatch loss, vf_coef·L_V (with its gradient), and
    the sums its step metrics are made of: L_V itself, the clipped tokens and Σ V_t."""
    V = modeling.completion_values(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"], args.prefix_sharing)             # V_t [n, T]
    token_loss, clipped = clipped_value_loss(V, batch["values"], batch["returns"], args.value_clip)
    loss = minibatches.aggregate(token_loss, batch["loss_mask"], args.loss_agg, num_seqs, num_tokens,
                                 args.max_new_tokens)
    return args.vf_coef * loss, {"value_loss": loss.item(), "value_clipped": clipped[batch["loss_mask"]].sum().item(),
                                 "value_sum": torch.where(batch["loss_mask"], V.detach(), 0.0).sum().item()}
