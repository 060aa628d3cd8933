"""Prompts and rewards: chat prompts to ids, built-in tasks, reward specs, the math reward."""
