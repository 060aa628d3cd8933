"""What the five stage scripts share, a folder per concern and a module per concern in it; it
imports no stage. tests/test_formats.py checks this map against the files.

    cli               one-line errors for a user's mistakes, the argument parser, warnings
    settings          range rules of every stage's flags; train.py's configuration from the stage parsers
    groups            statistics within each prompt's group: mean, std, the groups with no signal
    lora              LoRA through peft: adapters on the frozen policy, π_ref its base, merging (a command)

    disk/             what a run keeps on disk
      files           schemas of the stage files, checked loading, atomic writes, JSON and JSON lines
      outputs         output paths: what a command may write over; the run folder's one writer
      checkpoints     checkpoints, optimizer state, and train.py's resume points (save, restore, keep)
      provenance      what each stage file was made from, so files of different runs are never combined
      stage_inputs    a stage's input files read together and checked against each other
      run_log         what a run writes as it goes: metrics.json, TensorBoard, the progress line, replay.sh
    models/           models in memory
      loading         models and tokenizers from folders or Hub ids, their EOS ids, whether a model is LoRA
      modeling        forward passes over completions: per-token log-probs, the critic's values, prefix sharing
      fast_decode     the sampler's decode step: packed weights, a KV cache written in place, the draw
      vllm_engine     vLLM as sample.py's engine (--engine vllm), new weights in place
      builders        models that need no download: the default SmolLM2 and tiny Llamas for tests
      distributed     torchrun: ranks, shards, gathers, gradient sync, DDP/FSDP2 wrapping
    rewards/          prompts and rewards
      prompting       prompt records to token ids, the room a prompt has, samples.jsonl rows
      tasks           built-in prompt sets and the rule rewards that score them
      reward_specs    reward functions by --reward SPEC: built-in, the user's function, a reward model
      math_reward     the built-in `math` reward: math-verify in a worker process
      environments    --env SPEC: the contract of multi-turn episodes, the tool helper, the calculator
    training/         the update's machinery and PPO's critic
      optim           AdamW: construction, lr schedule, clipping, skipped steps
      minibatches     the update's minibatches, the loss mask, --loss-agg, gradient accumulation's bookkeeping
      ppo_critic      PPO's critic: its flags, clipped value loss and AdamW steps (update.py --critic)
      update_metrics  update.py's metrics.json: sums over micro-batches and ranks, means over steps
    loop/             train.py's run
      runs            a training run as it runs: its records (held out, per iteration), its models in memory
      configs         a run's settings: its flags and checks, --config's configurations, each stage's flags
      rollouts        whole groups of rollouts stacked and re-padded, shared among ranks; DAPO's dynamic sampling
      evaluation      greedy held-out answers of the policy beside the reference's
      diagnostics     how a GRPO run goes wrong, as numbers logged every iteration
      staleness       --staleness K: the producer process beside the update, on a fixed schedule of versions

Shape alphabet used throughout: B prompts, G completions per prompt, N = B·G rows,
P prompt length, T completion length, V vocabulary size.
"""
