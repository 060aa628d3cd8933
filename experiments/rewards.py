"""A reward that correlates with length, for claim C6 (TRL's reward signature).

class_chars: the number of the completion's characters that belong to the record's character class,
over 24 (C6's --max-new-tokens): unlike the tiny task's char_class (the share of such characters),
a longer answer of the right class earns more.
"""

from grpo.tasks import CHAR_CLASSES, completion_text


def class_chars(prompts, completions, char_class, **fields):
    texts = [completion_text(c) for c in completions]
    return [sum(ch in CHAR_CLASSES[k] for ch in t) / 24 for t, k in zip(texts, char_class)]
