"""How update.py cuts the rollouts into AdamW steps: each epoch's shuffled minibatches, the tokens
the losses train on, and one minibatch's gradient accumulated over micro-batches (and ranks) so that it
does not depend on the split. The policy's steps and PPO's critic's use them alike.
"""

import torch

from grpo import distributed, optim


def plan(rollouts, epochs, args):
    """[epochs][M] the rows of each AdamW step: each epoch a shuffle (seeded by --seed) of the N rows
    cut into minibatches of --minibatch-size. The policy's and the critic's plans share their first
    epochs."""
    N = rollouts["group_ids"].shape[0]
    generator = torch.Generator().manual_seed(args.seed)
    minibatches = distributed.row_slices(N, args.minibatch_size)
    return [[order[mb] for mb in minibatches] for order in (torch.randperm(N, generator=generator)
                                                           for _ in range(epochs))]


def loss_mask(rollouts, args):
    """The tokens the losses train on: completion_mask, less the truncated rows with --mask-truncated
    (DAPO's overlong filtering). [N, T]"""
    mask = rollouts["completion_mask"]
    return mask & ~rollouts["truncated"][:, None] if args.mask_truncated else mask


def gradient(model, rollouts, rows, args, record, loss_of):
    """The gradient of one minibatch's loss in `model`, from this rank's share of its `rows`
    (distributed.micro_batches) in micro-batches of --micro-batch-size, each backward carrying the
    whole minibatch's normalisers, so that the gradient does not depend on the split; returns its norm
    before clipping to --max-grad-norm. `loss_of(batch)` gives a micro-batch's (loss, terms), which
    `record(batch, loss, terms)` takes. A pass of weight 0 pads a rank's share so that every rank joins
    the same collectives; it adds nothing and is not recorded."""
    device = next(model.parameters()).device
    passes = distributed.micro_batches(rows, args.micro_batch_size)
    for k, (idx, weight) in enumerate(passes):
        batch = {key: v[idx].to(device) for key, v in rollouts.items()}
        with distributed.grad_sync(model, k == len(passes) - 1):
            loss, terms = loss_of(batch)
            (loss * weight).backward()   # DDP and FSDP average over ranks; × world: a sum
        if weight:
            record(batch, loss, terms)
    return optim.clip_gradients(model, args.max_grad_norm)
