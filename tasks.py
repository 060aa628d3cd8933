"""Built-in tasks: prompt sets and the rule rewards that score them.

A rule reward has the signature of TRL's reward functions, so that score.py calls built-in and
user rewards the same way:

    reward(prompts: list[str], completions: list[str], **fields) -> list[float]

where `fields` holds every other column of samples.jsonl (for example `answer`), one value per row.

Rewards read text a model wrote, so they never evaluate it: numbers are found with a linear-time
regular expression and compared as canonical strings, never parsed as code or converted to a
Python int (whose size would be up to the model).
"""

import re

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def canonical_number(text):
    """'007' -> '7', '-3.50' -> '-3.5', '+2.0' -> '2', '-0' -> '0'; None if `text` is not a number."""
    text = str(text).strip().replace(",", "")
    if not _NUMBER.fullmatch(text):
        return None
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


def exact_answer(prompts, completions, answer, **fields):
    """1.0 when the last number in the completion equals the record's `answer`, else 0.0."""
    return [float(a is not None and last_number(c) == canonical_number(a)) for c, a in zip(completions, answer)]


# Built-in rewards by the name score.py's --reward takes.
REWARDS = {
    "exact_answer": exact_answer,
}
