"""What the five stage scripts share, one module per concern; it imports no stage.

    cli           one-line errors for a user's mistakes, the argument parser, warnings
    files         schemas of the stage files, checked loading, atomic writes, JSON and JSON lines
    stage_inputs  a stage's input files read together and checked against each other
    loading       models and tokenizers from folders or Hub ids, their EOS ids, whether a model is LoRA
    prompting     prompt records to token ids, the room a prompt has, samples.jsonl rows
    modeling      forward passes over completions: per-token log-probs, the critic's values, prefix sharing
    fast_decode   the sampler's decode step: products on packed weights, a KV cache written in place
    distributed   torchrun: ranks, shards, gathers, gradient sync, DDP/FSDP2 wrapping
    checkpoints   checkpoints, optimizer state, and train.py's resume points (save, restore, keep)
    run_log       what a run writes as it goes: metrics.json, TensorBoard, the progress line, replay.sh
    optim         AdamW for update.py and train.py: construction, lr schedule, clipping, skipped steps
    update_metrics  update.py's metrics.json: sums over micro-batches and ranks, means over steps
    settings      range rules of every stage's flags; train.py's configuration from the stage parsers
    runs          a training run: its flags and checks, its records (held out, per iteration), its models
    rollouts      whole groups of rollouts stacked and re-padded; DAPO's dynamic sampling
    lora          LoRA through peft: adapters on the frozen policy, π_ref its base, merging
    tasks         built-in prompt sets and the rule rewards that score them
    reward_specs  reward functions by --reward SPEC: built-in, the user's function, a reward model
    groups        statistics within each prompt's group: mean, std, the groups with no signal
    diagnostics   how a GRPO run goes wrong, as numbers logged every iteration
    evaluation    greedy held-out answers of the policy beside the reference's
    builders      models that need no download: the default SmolLM2 and tiny Llamas for tests

Shape alphabet used throughout: B prompts, G completions per prompt, N = B·G rows,
P prompt length, T completion length, V vocabulary size.
"""
