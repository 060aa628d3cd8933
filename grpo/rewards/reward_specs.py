"""Reward functions by --reward SPEC: a built-in, the user's function, or a reward model.

Every one has TRL's signature

    reward(prompts: list, completions: list, **fields) -> list[float | None]

where a row's prompt and completion are strings, or for a chat prompt its message list and
[{"role": "assistant", "content": text}] (TRL's conversational format); `fields` holds every
other column of samples.jsonl (for example `answer`) and `completion_ids`, one value per row;
None says that the reward does not apply to the row.

A SPEC is a built-in reward (the rule rewards of grpo/rewards/tasks.py, and `math` of grpo/rewards/math_reward.py),
`module:function` or `path/file.py:function` (the user's code, imported only when named), or a
folder or Hub id holding a Hugging Face sequence-classification reward model with one output.
"""

import importlib
import importlib.util
import inspect
import os
import sys

import torch

from grpo.cli import StageError
from grpo.models import distributed, loading
from grpo.rewards import math_reward, prompting, tasks

# Built-in rewards by the name --reward takes: the rule rewards of the built-in tasks, and `math`.
BUILT_IN = {**tasks.REWARDS, "math": math_reward.math}


# The stages' outputs among samples.jsonl's columns, which never reach a reward function as fields.
STAGE_OUTPUTS = ("reward", "rewards", "advantage")


def row_fields(records, episode=None):
    """The fields score.py passes a reward function for rows of these prompt records: each record's own
    (but the prompt and the stages' outputs), the row's group and completion ids, a chat prompt's
    turns as `messages`, and with an environment its turns and the `episode` fields it names."""
    chat = any(prompting.chat_of(r) is not None for r in records)
    own = {k for r in records for k in r} - {"prompt", "completion", *STAGE_OUTPUTS}
    episode = {"turns", *episode} if episode is not None else set()
    return own | {"group", "completion_ids"} | ({"messages"} if chat else set()) | episode


def check_fields(reward_fns, records, source, episode=None):
    """Stop before any sampling when a reward function takes a field (a parameter without a default,
    other than prompts and completions) that no record of `source` has, nor an episode's environment
    (`episode`: the names of its fields); no records: nothing to check."""
    if not records:
        return
    have = row_fields(records, episode)
    for name, fn in reward_fns:
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):             # a builtin or C function: nothing to read
            continue
        needed = [p.name for p in parameters if p.default is p.empty and p.kind in (
                  p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("prompts", "completions")]
        missing = [field for field in needed if field not in have]
        if missing:
            raise StageError(f"reward {name!r} takes the field {missing[0]!r}, which no record of {source} "
                             f"has (the rows' fields: {', '.join(sorted(have))}); add it to the records or "
                             f"choose another --reward")


def load_reward(spec, device, micro_batch_size, trust_remote_code=False):
    """Resolve a --reward SPEC to (name, function with the TRL reward signature)."""
    if spec in BUILT_IN:
        return spec, BUILT_IN[spec]
    if ":" in spec:
        return load_user_function(spec)
    if spec.endswith(".py") or os.path.isfile(spec):
        raise StageError(f"--reward {spec!r}: a Python file's reward is named with its function, "
                         f"{spec}:FUNCTION")
    if os.path.isdir(spec) or loading.HUB_ID.fullmatch(spec):
        name = os.path.basename(os.path.normpath(spec.partition("@")[0]))
        return name, reward_model_function(spec, device, micro_batch_size, trust_remote_code)
    raise StageError(f"--reward {spec!r}: unknown reward; expected a built-in name "
                     f"({', '.join(BUILT_IN)}), module:function, path/file.py:function, "
                     f"or a reward-model folder or Hub id (org/name[@revision])")


def load_user_function(spec, flag="--reward", kind="function"):
    """`module:NAME` or `path/file.py:NAME` to (NAME, the callable); `flag` names the option in errors."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise StageError(f"{flag} {spec!r}: no such file {target}")
            module_spec = importlib.util.spec_from_file_location(f"user_reward_{abs(hash(target))}", target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except StageError:
        raise
    except Exception as e:  # the user's module can raise anything on import; report it as one line
        raise StageError(f"{flag} {spec!r}: importing {target} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise StageError(f"{flag} {spec!r}: {target} has no {kind} {name!r}")
    return name, fn


def reward_model_function(path, device, micro_batch_size, trust_remote_code=False):
    """A reward function with TRL's signature, backed by a sequence-classification model."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = loading.load_tokenizer(path, trust_remote_code)
    model = loading.load_model(path, device, trust_remote_code, AutoModelForSequenceClassification)
    if model.config.num_labels != 1:
        raise StageError(f"{path}: a reward model must have one output (num_labels=1), "
                         f"this one has {model.config.num_labels}")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id

    @torch.inference_mode()
    def reward_model(prompts, completions, **fields):
        texts = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(completion, list) and tokenizer.chat_template is not None:   # TRL's chat rows
                texts.append(tokenizer.apply_chat_template(prompt + completion, tokenize=False))
            elif isinstance(completion, list):
                texts.append("\n\n".join(m["content"] for m in prompt + completion))
            else:
                texts.append(prompt + completion)
        scores = []
        for rows in distributed.row_slices(len(texts), micro_batch_size):
            batch = tokenizer(texts[rows], return_tensors="pt", padding=True, add_special_tokens=False)
            scores.append(model(**batch.to(device)).logits[:, 0].float().cpu())             # [n]
        return torch.cat(scores).tolist()

    return reward_model
