"""Built-in tasks: prompt sets and the rule rewards that score them.

A rule reward has the signature of TRL's reward functions, so that score.py calls built-in and
user rewards the same way:

    reward(prompts: list, completions: list, **fields) -> list[float | None]

where `fields` holds every other column of samples.jsonl (for example `answer`), one value per row,
and a completion is a string or, for a chat prompt, TRL's [{"role": "assistant", "content": text}].

Rewards read text a model wrote, so they never evaluate it: numbers are found with a linear-time
regular expression and compared as canonical strings, never parsed as code or converted to a
Python int (whose size would be up to the model).

Tasks (`make_task(name, seed)` returns train and held-out records and the rewards to use;
grpo/loop/runs.py picks the records each iteration of train.py sees):
- arithmetic: "What is a plus b? Answer in one short sentence." as a chat, a and b two-digit
  numbers; reward exact_answer (1 when the last number of the reply is the sum). The default
  job's task. The base SmolLM2-135M-Instruct gets about 10% of samples right at τ = 0.7 within
  24 tokens, so a third of the groups carry signal from the first iteration; without the
  format request it rambles past the token limit and gets about 3%.
- char_classes: for the tiny model trained from scratch. The prompt names a character class
  ("digits:", "lower:", "upper:"); reward char_class, the share of the completion's characters
  in that class (dense, in [0, 1]; a random model starts near 0.1 to 0.25).
"""

import random
import re
import string

# A number, with thousands separators ("1,234") or without; linear time on any text.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def canonical_number(text):
    """'007' -> '7', '-3.50' -> '-3.5', '+2.0' -> '2', '-0' -> '0', '1,234' -> '1234'; None if `text`
    is not one number ('1,2' is a list: commas count only between groups of three digits)."""
    text = str(text).strip()
    if not _NUMBER.fullmatch(text):
        return None
    text = text.replace(",", "")
    sign = "-" if text.startswith("-") else ""
    whole, _, frac = text.lstrip("+-").partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    if whole == "0" and not frac:
        sign = ""
    return sign + whole + ("." + frac if frac else "")


def last_number(text):
    """The last number written in `text`, canonical, or None."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return canonical_number(last.group()) if last else None


def completion_text(completion):
    """The text of a completion: the string itself, or the content of TRL's conversational form."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(prompts, completions, answer, **fields):
    """1.0 when the last number in the completion equals the record's `answer`, else 0.0; None (the
    reward does not apply, as `math` says it) for a record without an answer."""
    return [None if a is None or a == "" else float(last_number(completion_text(c)) == canonical_number(a))
            for c, a in zip(completions, answer)]


CHAR_CLASSES = {"digits": string.digits, "lower": string.ascii_lowercase, "upper": string.ascii_uppercase}


def char_class(prompts, completions, char_class, **fields):
    """Share of the completion's characters that belong to the record's `char_class` (0 if empty)."""
    texts = [completion_text(c) for c in completions]
    return [sum(ch in CHAR_CLASSES[k] for ch in t) / max(len(t), 1) for t, k in zip(texts, char_class)]


# Built-in rewards by the name score.py's --reward takes.
REWARDS = {
    "exact_answer": exact_answer,
    "char_class": char_class,
}


def arithmetic(seed, num_train=2000, num_eval=48, low=10, high=99):
    """Two-digit sums as chat prompts. The held-out pairs are the same for every seed (drawn with seed
    0), so that runs of different seeds are scored on the same questions; the seed draws the training
    pairs from the others, which are never held out."""
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(0).shuffle(pairs)
    held_out, rest = pairs[:num_eval], pairs[num_eval:]
    if seed != 0:                                # seed 0 keeps the order above: the default job's records
        random.Random(seed).shuffle(rest)

    def record(a, b):
        question = f"What is {a} plus {b}? Answer in one short sentence."
        return {"messages": [{"role": "user", "content": question}], "answer": str(a + b)}

    return [record(a, b) for a, b in rest[:num_train]], [record(a, b) for a, b in held_out]


def char_classes(seed, num_train=256, num_eval=12):
    """Prompts "digits:", "lower:" or "upper:"; the reply should use only characters of that class."""
    rng = random.Random(seed)
    names = sorted(CHAR_CLASSES)

    def record(name):
        return {"prompt": f"{name}:", "char_class": name}

    train = [record(rng.choice(names)) for _ in range(num_train)]
    return train, [record(names[i % 3]) for i in range(num_eval)]


def products(seed, num_train=2000, num_eval=48):
    """Three-digit by two-digit products as chat prompts, which a 135M model gets right about 1 time in
    100 alone: the task of docs/environments.md, where `--env inline_calculator` writes the product after
    the model's "a * b =". The held-out ones are the same for every seed, as arithmetic's."""
    rng = random.Random(0)
    pairs = [(rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(num_train + num_eval)]
    held_out, rest = pairs[:num_eval], pairs[num_eval:]
    if seed != 0:
        random.Random(seed).shuffle(rest)

    def record(a, b):
        question = f"What is {a} times {b}? Answer in one short sentence."
        return {"messages": [{"role": "user", "content": question}], "answer": str(a * b)}

    return [record(a, b) for a, b in rest], [record(a, b) for a, b in held_out]


TASKS = {
    "arithmetic": (arithmetic, ["exact_answer"]),
    "products": (products, ["exact_answer"]),
    "char_classes": (char_classes, ["char_class"]),
}


def make_task(name, seed):
    """(train records, held-out records, reward names) of a built-in task."""
    build, rewards = TASKS[name]
    train, held_out = build(seed)
    return train, held_out, rewards
