"""The run's configurations: where a run's default differs from a stage's own (and why), the named
configurations of --config, and what --resume may change.
"""

# Where a run's default differs from the stage's own, and why.
RUN_DEFAULTS = {
    "num_prompts": (4, "B per iteration; sample.py alone takes every record of its file"),
    "max_new_tokens": (24, "the default task's answers fit; sample.py's 128 would make sampling ~5× longer"),
    "temperature": (0.7, "the default task was tuned at τ 0.7: about 10% of samples right, so a third of "
                         "the groups carry signal from the first iteration (grpo/rewards/tasks.py)"),
    "lr": (1e-5, "update.py's 1e-6 is DeepSeekMath's, for 7B weights and many steps; the default job, 15 "
                 "steps of a 135M model, was tuned at 1e-5"),
    "estimator": (None, "unset: grpo, or gae with --algo ppo (the estimator follows --algo)"),
    "reward": ([], "empty: the task's reward (score.py has no default)"),
    "rollout_is": (None, "unset: tis with --staleness ≥ 1 (the decoupled objective, docs/numerics.md), else none"),
}
# Named configurations: the default one with these settings changed.
CONFIGS = {
    "default": {},
    "tiny": dict(model="tiny", task="char_classes", iterations=30, num_prompts=8, group_size=8,
                 max_new_tokens=8, temperature=1.0, lr=3e-3, eval_every=10, eval_prompts=12),
    # For a GPU: more prompts, longer answers, more iterations; the same code path.
    "gpu": dict(iterations=200, num_prompts=32, group_size=16, max_new_tokens=128, eval_every=20,
                eval_prompts=200, save_every=50),
    # GSM8K with Qwen2.5-0.5B-Instruct on a GPU (docs/your-own-model-data-reward.md): the files of
    # examples/math_data.py; DeepSeekMath's lr 1e-6 and β 0.04 with G = 8 and 256 completions a step.
    "gsm8k_qwen": dict(model="Qwen/Qwen2.5-0.5B-Instruct", prompts="data/gsm8k_train.jsonl",
                       eval_prompts_file="data/gsm8k_test.jsonl", reward=["math"], iterations=200,
                       num_prompts=32, group_size=8, max_new_tokens=512, temperature=1.0, lr=1e-6,
                       beta=0.04, minibatch_size=256, micro_batch_size=32, eval_every=20, eval_prompts=200,
                       save_every=50),
}
# What --resume may change: nothing that alters the iterations already done.
RESUMABLE = {"iterations", "device", "sample_device", "eval_every", "eval_prompts", "eval_samples", "save_every",
             "max_bad_steps", "fsdp", "gradient_checkpointing", "prefix_sharing"}
