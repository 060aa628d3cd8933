"""A user reward function in TRL's convention, used by the CLI tests: the completion's length."""


def char_count(prompts, completions, **fields):
    return [float(len(c)) for c in completions]
