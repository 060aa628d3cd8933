"""Models and tokenizers from local folders or Hub ids, EOS ids, prompts to token ids, per-token log-probs.

`completion_logprobs` is the one definition of a completion token's log-prob: sample.py applies
it to the reference model, update.py to the policy it trains, and the sampler takes log π_old from
the same `logprobs_from_logits`, so π_old, π_ref and π_θ are computed the same way.
"""

import contextlib
import inspect
import os
import re
import weakref

import torch

from grpo import distributed, files
from grpo.cli import StageError, warn_once
from grpo.distributed import row_slices


# A Hugging Face Hub id, org/name, optionally @revision (a branch, tag or commit).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")
# What a Hub download fetches: configs, tokenizer files and safetensors weights, never pickles.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def model_dir(spec):
    """The local folder of a model argument: a folder as it is; a Hub id org/name[@revision] resolved
    through huggingface_hub's cache (HF_HOME), downloaded if need be, read from the cache alone with
    HF_HUB_OFFLINE=1 (or when the Hub cannot be reached)."""
    if os.path.isdir(spec) or not HUB_ID.fullmatch(spec):
        return spec
    from huggingface_hub import constants, snapshot_download, try_to_load_from_cache

    repo, _, revision = spec.partition("@")
    cached = try_to_load_from_cache(repo, "config.json", revision=revision or None)
    if isinstance(cached, str) and constants.HF_HUB_OFFLINE:
        return os.path.dirname(cached)
    try:
        return snapshot_download(repo, revision=revision or None, allow_patterns=MODEL_FILES)
    except Exception as e:  # no network, no such repo or revision, a gated repo: say which and why
        if isinstance(cached, str):
            return os.path.dirname(cached)
        offline = " (HF_HUB_OFFLINE=1: only the cache is read)" if constants.HF_HUB_OFFLINE else ""
        raise StageError(f"{spec}: no such folder, and not found as a Hub id in {constants.HF_HUB_CACHE}"
                         f"{offline}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def load_tokenizer(path, trust_remote_code=False):
    """Tokenizer from a local folder or Hub id, left-padding; a missing pad token falls back to EOS
    (or UNK)."""
    from transformers import AutoTokenizer

    path = _check_model_dir(path)
    quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        # Padding never decides the completion mask here, so any id will do.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.pad_token is None:
        raise StageError(f"{path}: the tokenizer has no pad, EOS or UNK token to pad with")
    return tok


def load_model(path, device, trust_remote_code=False, auto_class=None, **kwargs):
    """A causal LM from a local folder or Hub id, float32, in eval mode (no dropout: ratios must be 1
    on-policy).

    Only safetensors weights are read: a folder with nothing but pytorch_model.bin (a pickle, which
    can run code when loaded) is refused. A model's own Python code runs only with trust_remote_code.
    """
    from transformers import AutoModelForCausalLM

    path = _check_model_dir(path)
    quiet_transformers()
    try:
        model = (auto_class or AutoModelForCausalLM).from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True, **kwargs)
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: cannot load a model ({str(e).splitlines()[0]}); only safetensors weights "
                         f"are read, never pickle") from None
    return model.to(device).eval()


def load_critic(path, device, trust_remote_code=False):
    """The PPO critic V: a token-classification checkpoint with one output per token (for example
    LlamaForTokenClassification with num_labels = 1; builders.make_critic makes one from a policy)."""
    from transformers import AutoModelForTokenClassification

    path = _check_model_dir(path)
    config = files.read_json(os.path.join(path, "config.json"))
    architectures = config.get("architectures") or []
    if not (any(a.endswith("ForTokenClassification") for a in architectures)
            and len(config.get("id2label") or {}) == 1):
        raise StageError(f"{path}: not a critic (a *ForTokenClassification checkpoint with one label; "
                         f"found {', '.join(architectures) or 'no architecture'}); train.py --algo ppo makes "
                         f"one from the policy, as does grpo.builders.make_critic")
    return load_model(path, device, trust_remote_code, auto_class=AutoModelForTokenClassification)


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


def quiet_transformers():
    """Our own progress bars and messages say what is happening; keep transformers' loading bars out."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _check_model_dir(spec):
    """The model's folder (model_dir), checked to be a Hugging Face model folder."""
    files.recover_dir(spec)               # a checkpoint swap cut short by a kill
    path = model_dir(spec)
    if not os.path.isdir(path):
        raise StageError(f"{path}: no such model folder")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        raise StageError(f"{path}: not a Hugging Face model folder (no config.json, nor a LoRA adapter's "
                         f"adapter_config.json)")
    return path


def eos_token_ids(tokenizer, model):
    """Every id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    if not ids:
        raise StageError("the tokenizer and model define no EOS token, so completions could never end")
    return sorted(ids)


# ----------------------------------------------------------------------------------------
# Prompts to token ids

def chat_of(record):
    """A prompt record's chat turns ("messages", or "prompt" as a list), or None for a string prompt."""
    if "messages" in record:
        return record["messages"]
    return record["prompt"] if isinstance(record.get("prompt"), list) else None


# samples.jsonl's columns that the stages write (train.py adds the last three once an iteration is
# complete): a prompt record's field of one of these names does not travel.
ROW_COLUMNS = ("group", "prompt", "completion", "messages", "reward", "rewards", "advantage")


def sample_row(record, group, text, completion):
    """One row of samples.jsonl: the group, the text the model saw, the completion, every other field of
    the record, and a chat prompt's turns as "messages" in either style (score.py passes them to reward
    functions as TRL's conversational `prompts`)."""
    chat = chat_of(record)
    fields = {k: v for k, v in record.items() if k not in ROW_COLUMNS}
    return {"group": group, "prompt": text, "completion": completion, **fields,
            **({"messages": chat} if chat is not None else {})}


def check_prompt_record(record, where):
    """A prompt record has "prompt" (a string, or chat turns) or "messages" (chat turns), a chat being a
    non-empty list of {"role": str, "content": str}; `where` names it in the error."""
    chat = chat_of(record)
    key = "messages" if "messages" in record else "prompt"
    if chat is None and not isinstance(record.get("prompt"), str):
        raise StageError(f"{where}: needs 'prompt' (a string or a list of chat turns) or 'messages' "
                         f"(a list of chat turns)")
    if chat is not None and not (isinstance(chat, list) and chat and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in chat)):
        raise StageError(f"{where}: '{key}' must be a non-empty list of {{\"role\": str, \"content\": str}} "
                         f"objects")


def prompt_room(model, max_new_tokens):
    """The most tokens a prompt may have so that it and max_new_tokens fit the model's context (None for
    a model that states no context); a max_new_tokens that leaves no room is the user's error."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and max_new_tokens >= context:
        raise StageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                         f"of {context} tokens")
    return context - max_new_tokens if context else None


def render_prompts(records, tokenizer, path, max_len, lines=None):
    """The text the model sees and its token ids, one per prompt record (from `path`, where record i is
    on line lines[i], or i + 1 without `lines`).

    "messages", or "prompt" as a list of chat turns (TRL's conversational format), is rendered with
    the tokenizer's chat template and the generation prompt, and already holds the special tokens;
    a "prompt" string gets the tokenizer's own (BOS, if any).
    """
    texts, ids = [], []
    replaced = sorted({k for r in records for k in r} & set(ROW_COLUMNS) - {"prompt", "messages"})
    if replaced:
        warn_once(f"{path}: the records' {', '.join(map(repr, replaced))} do not travel to samples.jsonl, "
                  f"whose columns of that name the stages write (reward functions never see them)")
    both = [lines[i] if lines else i + 1 for i, r in enumerate(records) if "prompt" in r and "messages" in r]
    if both:
        warn_once(f"{path}: the records of lines {', '.join(map(str, both[:5]))}{', ...' if len(both) > 5 else ''} "
                  f"have both 'prompt' and 'messages'; the model sees 'messages'")
    for i, record in enumerate(records):
        where = f"{path}, line {lines[i] if lines else i + 1}"
        check_prompt_record(record, where)
        chat = chat_of(record)
        if chat is not None:
            if tokenizer.chat_template is None:
                raise StageError(f"{where}: has chat turns but the tokenizer has no chat template")
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = record["prompt"]
            tokens = tokenizer(text)["input_ids"]
        if not tokens:
            raise StageError(f"{where}: the prompt is empty")
        if max_len is not None and len(tokens) > max_len:
            raise StageError(f"{where}: the prompt has {len(tokens)} tokens; with --max-new-tokens "
                             f"it must fit the model's context, so at most {max_len}")
        texts.append(text)
        ids.append(tokens)
    return texts, ids


def left_pad(token_lists, pad_id):
    """Token lists as prompt_ids [B, P] and prompt_mask [B, P], padded on the left."""
    P = max(len(t) for t in token_lists)
    prompt_ids = torch.full((len(token_lists), P), pad_id, dtype=torch.long)         # [B, P]
    prompt_mask = torch.zeros((len(token_lists), P), dtype=torch.bool)               # [B, P]
    for i, t in enumerate(token_lists):
        prompt_ids[i, P - len(t):] = torch.tensor(t, dtype=torch.long)
        prompt_mask[i, P - len(t):] = True
    return prompt_ids, prompt_mask


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


# MKL's sgemm runs the decode step's products, a few dozen rows against each weight, well below the
# rate oneDNN reaches on a weight packed once into its own layout (benchmarks/levers.py
# decode-linears, on the 2-core AMD machine this project is measured on); False: every product
# through MKL.
ONEDNN_DECODE = True


@contextlib.contextmanager
def decode_linears(model, rows):
    """Within this block, on a CPU, every plain float32 nn.Linear of the model (the LM head included)
    computes through oneDNN on a copy of its weight packed once for products of about `rows` rows
    (torch.ops.mkldnn._reorder_linear_weight and _linear_pointwise: what torch.compile's CPU backend
    calls for a frozen linear), for the sampler's inference-mode passes. Only the rounding changes,
    by the order in which a decode step already differs from a full forward pass (the numbers in
    docs/performance.md); the packed copies (the model's size again) live for the block. Under LoRA
    the wrappers stay and the plain linears inside them (the base layer, lora_A, lora_B) are packed
    like any other. A call with gradients enabled computes as nn.Linear does (the packed product has
    no backward). On a GPU, for any other layer (bf16 weights, quantised ones), and for a linear whose
    forward is already replaced (an enclosing block, a hook's wrapper), nothing changes."""
    bare = distributed.unwrap(model)
    linears = [m for m in bare.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 and "forward" not in vars(m)]
    if not (ONEDNN_DECODE and linears and torch.backends.mkldnn.is_available()):
        yield
        return
    patched = []
    try:
        for linear in linears:
            linear.forward = _packed_forward(linear, rows)  # the instance's forward, ahead of nn.Linear's
            patched.append(linear)
        yield
    finally:
        for linear in patched:
            del linear.forward


def _packed_forward(linear, rows):
    weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)   # [d_out, d_in], packed
    bias = None if linear.bias is None else linear.bias.detach()

    def forward(x):                                                          # [..., d_in] -> [..., d_out]
        if torch.is_grad_enabled():
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], linear.out_features)
    return forward


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
    (kv_cache.preallocate), so a decode step writes its position instead of copying the cache.

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
    """The cache with room for `room` more positions in each layer (kv_cache.preallocate); as it is
    without room."""
    if not room:
        return cache
    from grpo import kv_cache                                           # imports transformers
    return kv_cache.preallocate(cache, room)


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
