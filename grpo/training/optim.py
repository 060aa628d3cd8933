"""AdamW for update.py and train.py: construction, the learning-rate schedule, gradient clipping, and
the steps skipped for a non-finite loss or gradient.

Whoever builds the optimizer (update.py for one update, train.py once per run), each step takes its
learning rate and weight decay from the update's own arguments (`schedule_lr`), so a setting cannot
be given to the update and lost on the way.
"""

import math
import os

import torch
from torch.distributed.tensor import DTensor

from grpo.cli import StageError, warn
from grpo.disk import checkpoints
from grpo.models import distributed, loading


def adamw(model, lr, weight_decay=0.0, state_file=None):
    """AdamW over the model's trainable parameters (a LoRA policy's adapters), continuing from
    `state_file` (optimizer.safetensors) if given."""
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel a step instead of a dozen passes over every weight, equal to torch's default
    # for-loop within float rounding (what it saves: docs/performance.md). FSDP2's sharded DTensors
    # keep torch's default.
    fused = not any(isinstance(p, DTensor) for p in params) or None
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)
    if state_file is not None:
        checkpoints.load_optimizer_state(model, optimizer, state_file)
    return optimizer


def optimizer_state(model, fresh=False):
    """The model folder's optimizer.safetensors, to continue AdamW from; None without one or when
    `fresh` (--fresh-optimizer)."""
    path = os.path.join(loading.model_dir(model), "optimizer.safetensors")
    return path if os.path.isfile(path) and not fresh else None


def scheduled_lr(step, lr, warmup_steps=0, schedule="constant", total_steps=None):
    """The learning rate of AdamW's step `step` (0 for the first): a linear warm-up over W =
    `warmup_steps`, lr·(step + 1)/W, so the first step already moves (transformers' schedulers start at
    0); then `lr`, constant or decaying (`schedule` linear, or cosine: a half cosine) to 0 at
    `total_steps`. The critic follows the same schedule from --critic-lr, by its own step count."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if schedule == "linear":
        return lr * (1 - progress)
    return lr * 0.5 * (1 + math.cos(math.pi * progress))


def adamw_steps(optimizer):
    """Steps AdamW has taken: its state's `step`, which optimizer.safetensors keeps across resumes."""
    state = next(iter(optimizer.state.values()), None)
    return int(state["step"]) if state else 0


def clip_gradients(model, max_norm):
    """Clip the model's gradient to max_norm; its norm before clipping, as a float (FSDP: the full norm)."""
    return float(distributed.full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))


def set_lr(optimizer, lr, weight_decay):
    """The learning rate and weight decay of the next step, from the update's own arguments whoever
    built the optimizer (optimizer.safetensors keeps its step count across resumes)."""
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = lr, weight_decay


def schedule_lr(optimizer, lr, warmup_steps, schedule, total_steps, weight_decay):
    """Set the learning rate of the optimizer's next step, `lr` by the schedule (scheduled_lr) at the
    optimizer's own step count, and the weight decay; returns that learning rate."""
    lr = scheduled_lr(adamw_steps(optimizer), lr, warmup_steps, schedule, total_steps)
    set_lr(optimizer, lr, weight_decay)
    return lr


def skip_step(optimizer, skipped, grad_norm, loss, max_bad_steps):
    """A non-finite loss or gradient would write NaN into every weight: drop the step, count it, and
    stop once more than max_bad_steps were dropped. Returns the new count."""
    optimizer.zero_grad(set_to_none=True)
    skipped += 1
    warn(f"update: non-finite {'loss' if not math.isfinite(loss) else 'gradient'} (grad norm {grad_norm}); "
         f"optimizer step skipped ({skipped} so far)")
    if skipped > max_bad_steps:
        raise StageError(f"{skipped} optimizer steps had a non-finite loss or gradient, more than "
                         f"--max-bad-steps {max_bad_steps}; stopping. Lower --lr, check the rewards and "
                         f"advantages, or look for NaN weights in --model")
    return skipped
