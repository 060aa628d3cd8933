"""How update.py cuts the rollouts into AdamW steps: each epoch's shuffled minibatches, the tokens
the losses train on, how a micro-batch's token losses become its share of the minibatch's loss
(--loss-agg), and the bookkeeping of gradient accumulation over micro-batches and ranks. The
policy's steps and PPO's critic's use them alike.
"""

import torch

from grpo.models import distributed


def plan(num_rows, epochs, minibatch_size, seed):
    """[epochs][M] the rows of each AdamW step: each epoch a shuffle (seeded by `seed`) of the N rows
    cut into minibatches of `minibatch_size` (0: all). The policy's and the critic's plans share their
    first epochs."""
    generator = torch.Generator().manual_seed(seed)
    minibatches = distributed.row_slices(num_rows, minibatch_size)
    return [[order[mb] for mb in minibatches] for order in (torch.randperm(num_rows, generator=generator)
                                                           for _ in range(epochs))]


def policy_tokens(rollouts):
    """The completion tokens the policy drew: the rollouts' loss_mask (an episode's, whose environment
    turns are not the policy's), or without one every completion token. [N, T]"""
    return rollouts.get("loss_mask", rollouts["completion_mask"])


def loss_mask(rollouts, mask_truncated):
    """The tokens the losses train on: the policy's (policy_tokens), less the truncated rows with
    `mask_truncated` (--mask-truncated, DAPO's overlong filtering). [N, T]"""
    mask = policy_tokens(rollouts)
    return mask & ~rollouts["truncated"][:, None] if mask_truncated else mask


def aggregate(token_loss, mask, loss_agg, num_seqs, num_tokens, max_new_tokens):
    """--loss-agg: this micro-batch's share of its minibatch's loss, normalised by the minibatch's
    `num_seqs` sequences and `num_tokens` tokens, so the gradient does not depend on the split."""
    masked = torch.where(mask, token_loss, 0.0)                                # [n, T]
    if loss_agg == "seq":      # mean over sequences of the masked token mean (DeepSeekMath)
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if loss_agg == "token":    # Σ ℓ_t / Σ |o_i| over the minibatch (DAPO)
        return masked.sum() / num_tokens
    return masked.sum() / (num_seqs * max_new_tokens)  # dr_grpo: Σ ℓ_t / (N × L_max)


def accumulation_passes(model, rollouts, rows, micro_batch_size):
    """Gradient accumulation's bookkeeping: yields (batch, weight) for this rank's share of the
    minibatch `rows` (distributed.micro_batches) in micro-batches of `micro_batch_size` rows, on the
    model's device; the caller's backward of weight × loss runs inside, with the ranks' gradients
    synchronised on the last pass only. A pass of weight 0 pads a rank's share so that every rank joins
    the same collectives; it adds nothing, and its metrics are not recorded."""
    device = next(model.parameters()).device
    passes = distributed.micro_batches(rows, micro_batch_size)
    for k, (idx, weight) in enumerate(passes):
        batch = {key: v[idx].to(device) for key, v in rollouts.items()}
        with distributed.grad_sync(model, k == len(passes) - 1):
            yield batch, weight
