"""User reward functions (TRL's convention) used by the tests."""


def digits_in_even_groups(prompts, completions, group, **fields):
    """The number of digits in the completion for even groups; 0 for every row of odd groups, which
    therefore carry no signal (for DAPO's dynamic sampling)."""
    return [float(sum(ch.isdigit() for ch in c)) if g % 2 == 0 else 0.0 for c, g in zip(completions, group)]


def constant(prompts, completions, **fields):
    """The same reward for every completion: no group has any spread."""
    return [1.0] * len(completions)


def token_count(prompts, completions, completion_ids, **fields):
    """The completion's length in tokens, first EOS included: exactly the `lengths` score.py records."""
    return [float(len(ids)) for ids in completion_ids]
