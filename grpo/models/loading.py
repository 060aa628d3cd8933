"""Models and tokenizers from local folders or Hub ids: the policy, the reference, PPO's critic, their
EOS ids, and what kind of model a loaded one is."""

import os
import re

import torch

from grpo.cli import StageError
from grpo.disk import files


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
    for name, p in model.named_parameters():        # a damaged or diverged checkpoint, said before any draw
        if not torch.isfinite(p).all():
            raise StageError(f"{path}: weight {name} holds NaN or infinite values; the checkpoint is damaged "
                             f"or its training diverged")
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
                         f"one from the policy, as does grpo.models.builders.make_critic")
    return load_model(path, device, trust_remote_code, auto_class=AutoModelForTokenClassification)


def quiet_transformers():
    """Our own progress bars and messages say what is happening; keep transformers' loading bars out."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _check_model_dir(spec):
    """The model's folder (model_dir), checked to be a Hugging Face model folder."""
    files.check_no_cut_swap(spec)         # an input is never renamed: a cut swap is said
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


def is_lora(model):
    """Whether a model is a peft model (told by its class's module: peft need not be imported)."""
    return type(model).__module__.startswith("peft.")
