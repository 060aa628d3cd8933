"""A user reward function in TRL's convention, used by the CLI tests: the completion's length."""


def char_count(prompts, completions, **fields):
    # A chat prompt's completion comes as TRL's [{"role": "assistant", "content": text}].
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
