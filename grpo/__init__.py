"""What the five stage scripts share, one module per concern; it imports no stage.

    cli           one-line errors for a user's mistakes, the argument parser, warnings
    files         schemas of the stage files, checked loading, atomic writes, JSON and JSON lines
    modeling      models and tokenizers from folders, EOS ids, prompts to ids, per-token log-probs
    distributed   torchrun: ranks, shards, gathers, gradient sync, DDP/FSDP2 wrapping
    checkpoints   checkpoints, optimizer state, and train.py's run folder (save, restore, replay)
    optim         AdamW for update.py and train.py: construction, lr schedule, clipping, skipped steps
    update_metrics  update.py's metrics.json: sums over micro-batches and ranks, means over steps
    settings      range rules of every stage's flags; train.py's configuration from the stage parsers
    runs          a training run: its own flags and checks, the models it holds, what iterations name
    rollouts      whole groups of rollouts stacked and re-padded; DAPO's dynamic sampling
    lora          LoRA through peft: adapters on the frozen policy, π_ref its base, merging
    tasks         built-in prompt sets and the rule rewards that score them
    reward_specs  reward functions by --reward SPEC: built-in, the user's function, a reward model
    diagnostics   how a GRPO run goes wrong, as numbers logged every iteration
    evaluation    greedy held-out answers of the policy beside the reference's
    builders      models that need no download: the default SmolLM2 and tiny Llamas for tests

Shape alphabet used throughout: B prompts, G completions per prompt, N = B·G rows,
P prompt length, T completion length, V vocabulary size.
"""
