"""Prompt records to token ids: a record's chat, its check, the room the model leaves a prompt, the
rendered and left-padded prompts, and a completion's samples.jsonl row."""

import torch

from grpo.cli import StageError, warn_once


def chat_of(record):
    """A prompt record's chat turns ("messages", or "prompt" as a list), or None for a string prompt."""
    if "messages" in record:
        return record["messages"]
    return record["prompt"] if isinstance(record.get("prompt"), list) else None


# samples.jsonl's columns that the stages write (train.py adds the last three once an iteration is
# complete): a prompt record's field of one of these names does not travel.
ROW_COLUMNS = ("group", "prompt", "completion", "messages", "turns", "reward", "rewards", "advantage")


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
