"""Forward passes over completions: per-token log-probs (and entropy), the critic's values, and
prefix sharing (each distinct prompt of a batch computed once).

`completion_logprobs` is the one definition of a completion token's log-prob: sample.py applies
it to the reference model, update.py to the policy it trains, and the sampler takes log π_old from
the same `logprobs_from_logits`, so π_old, π_ref and π_θ are computed the same way.
"""

import contextlib
import inspect
import weakref

import torch

from grpo.cli import StageError, warn_once
from grpo.models import distributed
from grpo.models.distributed import row_slices


@contextlib.contextmanager
def gradient_checkpointing(models, on=True):
    """Within this block the models' decoder layers recompute their activations in the backward pass
    (transformers' gradient checkpointing) instead of keeping them for it.

    transformers checkpoints a layer only while the layer is in training mode, and the models stay in
    eval mode (no dropout, so that π_θ = π_old on-policy): so the layers alone are flagged as training
    for the block, which nothing in them reads but the checkpointing switch (attention dropout is
    read from the attention module). Afterwards, sampling runs with its KV cache again."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not on:
        yield
        return
    models = [distributed.unwrap(m) for m in models]
    layers = [m for model in models for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise StageError(f"--gradient-checkpointing: {type(models[0]).__name__} has no layers that "
                         f"transformers can checkpoint")
    for model in models:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False
        for model in models:
            model.gradient_checkpointing_disable()


# ----------------------------------------------------------------------------------------
# Prompts to token ids


# ----------------------------------------------------------------------------------------
# Per-token log-probs

def logprobs_from_logits(logits, tokens, temperature, with_entropy=False, entropy_grad=False):
    """log softmax(logits / τ) at `tokens`: z_tok − logsumexp(z) with z = logits / τ.

    logits [..., V], tokens [...] -> [...], in float32 whatever the forward pass ran in (float64
    stays float64). With `with_entropy`, also the entropy of each distribution, H = lse − Σ p·z:
    detached (a metric), or with its gradient when `entropy_grad` (an entropy bonus in the loss).
    Computed a few rows at a time (_TokenLogprobs), so that no [..., V] float32 tensor the size of
    the logits is ever made, in the forward pass or the backward.
    """
    logp, entropy = _TokenLogprobs.apply(logits, tokens, temperature, with_entropy)
    if not with_entropy:
        return logp
    return logp, entropy if entropy_grad and torch.is_grad_enabled() else entropy.detach()


class _TokenLogprobs(torch.autograd.Function):
    """logprobs_from_logits in chunks of rows of the logits, with its backward written out:

        ∂ log p_tok / ∂z_j = 1[j = tok] − p_j        ∂H / ∂z_j = −p_j·(log p_j + H)        ∂z/∂logits = 1/τ

    The softmax p is recomputed chunk by chunk in the backward pass from the logits (which the LM
    head's output already holds) and the saved lse, rather than kept: autograd through
    log_softmax or logsumexp keeps or makes several [..., V] float32 tensors (z, the softmax, the
    gather's scatter), the largest tensors of an update (docs/performance.md)."""

    CHUNK = 1 << 21                    # float32 elements of z a chunk holds at most (8 MB)

    @staticmethod
    def chunks(logits):
        """Slices of the first dimension of logits [n, ..., V] holding at most CHUNK elements each."""
        per_row = max(1, logits[:1].numel())
        rows = max(1, _TokenLogprobs.CHUNK // per_row)
        return [slice(i, i + rows) for i in range(0, logits.shape[0], rows)]

    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy):
        dtype = torch.promote_types(logits.dtype, torch.float32)       # bf16 → float32; float64 stays
        logp = torch.empty(tokens.shape, dtype=dtype, device=logits.device)          # [...]
        lse = torch.empty_like(logp)                                                  # [...]
        entropy = torch.zeros_like(logp)                                              # [...]
        for rows in _TokenLogprobs.chunks(logits):
            z = logits[rows].to(dtype) / temperature                                  # [c, ..., V]
            lse[rows] = z.logsumexp(-1)
            logp[rows] = z.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            if with_entropy:
                p = (z - lse[rows].unsqueeze(-1)).exp_()                              # softmax(z)
                entropy[rows] = lse[rows] - torch.einsum("...v,...v->...", p, z)     # H = lse − Σ p z
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)          # a gradient left None (the entropy metric's) costs nothing
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)       # [..., V]
        for rows in _TokenLogprobs.chunks(logits):
            z = logits[rows].to(lse.dtype) / ctx.temperature                          # [c, ..., V]
            log_p = z - lse[rows].unsqueeze(-1)                                       # log softmax(z)
            p = log_p.exp()
            if grad_logp is None:
                g = torch.zeros_like(z)
            else:
                g = -grad_logp[rows].unsqueeze(-1) * p                                # −g·p_j
                g.scatter_add_(-1, tokens[rows].unsqueeze(-1), grad_logp[rows].unsqueeze(-1))  # + g·1[j = tok]
            if grad_entropy is not None:
                g -= grad_entropy[rows].unsqueeze(-1) * p * (log_p + entropy[rows].unsqueeze(-1))
            grad[rows] = g / ctx.temperature
        return grad, None, None, None


def autocast(device):
    """bf16 autocast for forward passes on a GPU (log-probs stay float32); nothing on a CPU."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def completion_outputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prefix=False):
    """The model's outputs at the positions whose logits give each completion token (the last prompt
    token's for t = 0): [n, T', ...] with T' the completion columns any row uses, and the completion's
    ids and mask cut to [n, T'].

    With share_prefix, each distinct prompt runs once and the completions attend to its cached keys
    and values (shared_prefix_outputs); otherwise, and for a model that cannot, prompt and completion
    run as one sequence per row, without the padding columns no row uses. Position ids count real
    tokens only, so left padding does not move them."""
    T = int(completion_mask.any(0).nonzero().max()) + 1 if completion_mask.any() else 1
    completion_ids, completion_mask = completion_ids[:, :T], completion_mask[:, :T]         # [n, T']
    outputs = None
    if share_prefix:
        outputs = shared_prefix_outputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    if outputs is None:
        first = int(prompt_mask.any(0).long().argmax())
        input_ids = torch.cat([prompt_ids[:, first:], completion_ids], dim=1)                  # [n, P'+T']
        attention_mask = torch.cat([prompt_mask[:, first:], completion_mask], dim=1).long()    # [n, P'+T']
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                           # [n, P'+T']
        with autocast(completion_ids.device):
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **_keep_last(model, T + 1)).logits[:, -(T + 1):-1]
    return outputs, completion_ids, completion_mask


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                        with_entropy=False, entropy_grad=False, share_prefix=False):
    """Per-token log-probs of the completions under `model` at temperature τ, 0 where the mask is false.

    prompt_ids/prompt_mask [n, P] (left-padded), completion_ids/completion_mask [n, T].
    Returns logp [n, T] and, with `with_entropy`, the entropy of each next-token distribution [n, T]
    (detached, unless `entropy_grad`). share_prefix: see completion_outputs.
    """
    T_full = completion_ids.shape[1]
    logits, completion_ids, completion_mask = completion_outputs(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prefix)       # [n, T', V]
    out = logprobs_from_logits(logits, completion_ids, temperature, with_entropy, entropy_grad)
    logp, entropy = out if with_entropy else (out, None)                         # [n, T']
    logp = pad_columns(logp.masked_fill(~completion_mask, 0.0), T_full)          # [n, T]
    if not with_entropy:
        return logp
    return logp, pad_columns(entropy.masked_fill(~completion_mask, 0.0), T_full)


def completion_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prefix=False):
    """V_t of the PPO critic for every completion token: its output at the position whose logits give
    token t under the policy (the last prompt token for t = 0), the alignment of the log-probs.
    Shapes as completion_logprobs; [n, T] float32, 0 where the mask is false."""
    T_full = completion_ids.shape[1]
    values, _, completion_mask = completion_outputs(critic, prompt_ids, prompt_mask, completion_ids,
                                                    completion_mask, share_prefix)
    values = values[..., 0].float()                                              # [n, T']
    return pad_columns(values.masked_fill(~completion_mask, 0.0), T_full)        # [n, T]


@torch.no_grad()
def rollout_logprobs(model, rollouts, temperature, micro_batch_size, share_prefix=False, passes=None):
    """log-probs of every completion token of a rollouts dict under `model`, without gradients, in
    passes of at most `micro_batch_size` rows, or in `passes` (a list of row indices: the shapes
    another computation will use, for numbers equal to its to the bit): sample.py's log π_ref,
    update.py's recomputed log π_old. [N, T] on the model's device."""
    return _in_passes(completion_logprobs, model, rollouts, micro_batch_size, passes, temperature,
                      share_prefix=share_prefix)


@torch.no_grad()
def rollout_values(critic, rollouts, micro_batch_size, share_prefix=False):
    """The critic's V_t for every completion token of a rollouts dict (sample.py --critic), as
    rollout_logprobs. [N, T] on the critic's device."""
    return _in_passes(completion_values, critic, rollouts, micro_batch_size, None, share_prefix=share_prefix)


def _in_passes(per_token, model, rollouts, micro_batch_size, passes, *args, **kwargs):
    device = next(model.parameters()).device
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    out = torch.zeros(rollouts["completion_ids"].shape, device=device)                       # [N, T]
    for rows in passes or row_slices(len(rollouts["prompt_ids"]), micro_batch_size):
        out[rows] = per_token(model, *(rollouts[k][rows].to(device) for k in keys), *args, **kwargs)
    return out


def _keep_last(model, n):
    """logits_to_keep=n for a model whose forward takes it (a causal LM: no [n, P, V] logits for the
    prompt), nothing for one that does not (a token-classification critic, whose outputs are small)."""
    bare = distributed.unwrap(model)
    forward = (bare.get_base_model() if hasattr(bare, "get_base_model") else bare).forward   # under LoRA
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(forward).parameters else {}


def pad_columns(x, width, value=0.0):
    """Right-pad x [n, t] with `value` to [n, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


# ----------------------------------------------------------------------------------------
# Prefix sharing: each distinct prompt computed once, its keys and values expanded to its rows

def distinct_prompts(prompt_ids, prompt_mask):
    """The rows' distinct prompts: the index of one row per prompt [U] and each row's prompt [n].
    Rows share a prompt when their ids under the mask are equal (group_ids are not trusted)."""
    key = prompt_ids.masked_fill(~prompt_mask, -1)                                # [n, P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)                   # [n] in 0..U−1
    first = torch.full((int(inverse.max()) + 1,), len(inverse), device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin")
    return first, inverse


_UNSHAREABLE = weakref.WeakSet()       # models that turned out not to take a KV cache this way


def prefill(model, prompt_ids, prompt_mask, share_prefix=True, room=0):
    """Run the prompts into a KV cache for their rows: each distinct prompt once, its keys and values
    then gathered to the rows that have it (so the backward pass sums the rows' gradients into it),
    or with share_prefix False every row's own. With `room` (the sampler's decode steps), the cache's
    layers keep their keys and values in buffers with that many positions to spare
    (fast_decode.preallocate), so a decode step writes its position instead of copying the cache.

    Returns the model's output at each row's last prompt token [n, 1, ...], the cache (n rows), and
    the attention mask [n, P'] and position ids [n, P'] of the prompt columns any row uses; or None
    when sharing was asked for but the model's forward does not fill a plain DynamicCache (one
    warning, then the caller's unshared path)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    bare = distributed.unwrap(model)
    if share_prefix and bare in _UNSHAREABLE:
        return None
    first_column = int(prompt_mask.any(0).long().argmax())
    prompt_ids, prompt_mask = prompt_ids[:, first_column:], prompt_mask[:, first_column:]       # [n, P']
    rows, inverse = distinct_prompts(prompt_ids, prompt_mask) if share_prefix else (slice(None), None)
    attention_mask = prompt_mask.long()                                                         # [n, P']
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                                 # [n, P']
    cache = DynamicCache(config=bare.config)
    inputs = {"input_ids": prompt_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    with autocast(prompt_ids.device):
        out = model(**{k: v[rows] for k, v in inputs.items()}, past_key_values=cache, use_cache=True,
                    **_keep_last(model, 1))
    last = out.logits[:, -1:]                                                        # [U, 1, ...]
    if not share_prefix:
        return last, _preallocated(cache, room), attention_mask, position_ids
    if cache.get_seq_length() != prompt_ids.shape[1] or any(type(layer) is not DynamicLayer
                                                            for layer in cache.layers):
        _UNSHAREABLE.add(bare)
        warn_once(f"prefix sharing: {type(bare).__name__} does not fill a plain KV cache that rows can "
                  f"share; computing each row's prompt itself (as --no-prefix-sharing)")
        return None
    cache.reorder_cache(inverse)                                      # index_select: rows ← their prompt
    return last[inverse], _preallocated(cache, room), attention_mask, position_ids


def _preallocated(cache, room):
    """The cache with room for `room` more positions in each layer (fast_decode.preallocate); as it is
    without room."""
    if not room:
        return cache
    from grpo.models import fast_decode                                 # imports transformers
    return fast_decode.preallocate(cache, room)


def shared_prefix_outputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The model's outputs at the positions whose logits give completion tokens 0..T−1 ([n, T, ...]),
    with each distinct prompt computed once (prefill) and the completions run on its cache; None
    where the model cannot share (completion_outputs then runs the full sequences)."""
    prefilled = prefill(model, prompt_ids, prompt_mask)
    if prefilled is None:
        return None
    last, cache, prompt_attention, _ = prefilled
    T = completion_ids.shape[1]
    if T == 1:                                         # the last prompt token alone predicts the token
        return last
    attention_mask = torch.cat([prompt_attention, completion_mask.long()], dim=1)         # [n, P'+T]
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, prompt_attention.shape[1]:]  # [n, T]
    with autocast(completion_ids.device):
        out = model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                    position_ids=positions[:, :-1], past_key_values=cache, use_cache=True)
    return torch.cat([last, out.logits], dim=1)                                     # [n, T, ...]
