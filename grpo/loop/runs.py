"""A training run as it runs: its records (the task's or its prompt files', which are held out, which
each iteration takes), what it holds in memory (the policy, with FSDP a full copy that samples, π_ref,
PPO's critic, AdamW and the reward functions), loaded from the base model or from the last save, and
the models each iteration's stage commands name. Its settings are grpo/loop/configs.py's.
"""

import json
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grpo import lora
from grpo.cli import StageError, warn
from grpo.disk import files, outputs, provenance
from grpo.models import builders, distributed, loading, vllm_engine
from grpo.rewards import environments, prompting, reward_specs, tasks
from grpo.training import optim, ppo_critic


@contextmanager
def timed(perf, key):
    """Add the block's seconds to perf[key]."""
    t = time.perf_counter()
    yield
    perf[key] = perf.get(key, 0.0) + time.perf_counter() - t


@dataclass
class Models:
    """What a run holds in memory."""
    base: str                       # the initial policy's folder; also π_ref's
    tokenizer: object
    policy: torch.nn.Module         # what AdamW steps: in DDP, or sharded by FSDP2, under torchrun
    sampler: torch.nn.Module        # the whole policy that samples: `policy`, or with FSDP a full copy
    ref: torch.nn.Module = None     # π_ref, frozen (LoRA: the policy, adapters off); None when no KL is used
    critic: ppo_critic.Critic = None  # PPO's value model and its AdamW (--algo ppo)
    critic_init: str = None         # the critic's folder before the first step (PPO)
    engine: object = None           # --engine vllm: the run's one vLLM engine (grpo/models/vllm_engine.py)
    tokenizer_fingerprint: str = None   # what the rollouts record of the tokenizer (grpo/disk/provenance.py)


def load_rewards(cfg, device):
    """The run's reward functions, by its --reward SPECs (a reward model on `device`)."""
    return [reward_specs.load_reward(s, device, cfg.micro_batch_size, cfg.trust_remote_code) for s in cfg.reward]


def start(cfg, run_dir, done, records, held_out_lines=None):
    """Rewards (checked against the fields of the `records`: [(rows, file, lines)]), config.json (with the
    lines of --prompts held out for evaluation, if any), the models (the policy from the last save
    when resuming) with every record checked to fit the model's context, and AdamW (update.train_policy
    sets its learning rate and weight decay from the update's arguments at every step)."""
    device = distributed.pick_device(cfg.device)
    reward_fns = load_rewards(cfg, device)
    env = cfg.env and environments.load_env(cfg.env)[1]
    for rows, source, _ in records:
        reward_specs.check_fields(reward_fns, rows, source, env and environments.field_names(env, rows))
    held_out = {"held_out": {"prompts": cfg.prompts, "lines": held_out_lines}} if held_out_lines else {}
    config = os.path.join(run_dir, "config.json")
    resuming = os.path.isfile(config)
    if distributed.is_main() and not resuming:                   # a new run: its folder is marked first
        files.make_dir(run_dir)
        outputs.mark_dir(run_dir, "train.py")                    # the whole folder is the run's
        files.write_json(config, {"config": vars(cfg), **held_out})
    base = builders.base_model_dir(cfg.model, run_dir, cfg.seed)
    path = os.path.join(run_dir, "policy") if done else base
    policy = lora.load_policy(path, device, cfg)    # with --lora-r, the base and adapters
    sampler = policy
    if cfg.fsdp and distributed.rank_and_world()[1] > 1:
        sampler = loading.load_model(path, device, cfg.trust_remote_code)
    ref = None
    if cfg.beta != 0 or cfg.kl_in_reward != 0:                   # the k1 of --kl-in-reward (PPO)
        ref = lora.load_reference(base, policy, device, cfg.trust_remote_code)
    models = Models(base, loading.load_tokenizer(path, cfg.trust_remote_code),
                    distributed.distribute(policy, cfg.fsdp), sampler, ref)
    models.tokenizer_fingerprint = provenance.tokenizer_fingerprint(models.tokenizer)
    max_len = prompting.prompt_room(policy, cfg.max_new_tokens)
    for rows, source, lines in records:                         # every prompt renders and fits
        prompting.render_prompts(rows, models.tokenizer, source, max_len, lines)
    if cfg.algo == "ppo":
        models.critic_init, models.critic = start_critic(cfg, run_dir, base, done, device)
    if cfg.engine == "vllm" and (not cfg.staleness or cfg.eval_samples):   # --staleness: the producer's
        models.engine = vllm_engine.start(sampler, loading.model_dir(base), cfg.max_new_tokens,
                                          cfg.num_prompts * cfg.group_size)
    state = os.path.join(path, "optimizer.safetensors") if done else None
    optimizer = optim.adamw(models.policy, cfg.lr, cfg.weight_decay, state)
    if distributed.is_main() and resuming:   # once all is loaded: a resume that fails changes nothing
        files.write_json(config, {"config": vars(cfg), **held_out})
    return models, optimizer, reward_fns


def start_critic(cfg, run_dir, base, done, device):
    """PPO's critic: made once in RUN/critic_init from --critic-init (default: the initial policy),
    then taken from policy/critic/ of the last save, with its AdamW state."""
    if cfg.fsdp and distributed.rank_and_world()[1] > 1:
        raise StageError("--algo ppo does not run with --fsdp yet (the critic samples unsharded); use DDP")
    init = os.path.join(run_dir, "critic_init")
    if distributed.is_main() and not os.path.isfile(os.path.join(init, "config.json")):
        builders.make_critic(cfg.critic_init or base, init, cfg.trust_remote_code)
    distributed.barrier()
    path = os.path.join(run_dir, "policy", "critic") if done else init
    critic = distributed.distribute(loading.load_critic(path, device, cfg.trust_remote_code), cfg.fsdp)
    state = os.path.join(path, "optimizer.safetensors") if done else None
    return init, ppo_critic.Critic(critic, optim.adamw(critic, cfg.lr, cfg.weight_decay, state))


def model_paths(models, policy_path, i):
    """The models that iteration i's stage commands name: the policy that samples it, π_ref, and PPO's
    critic, saved beside that policy (its critic/), or critic_init before the first step."""
    critic = None
    if models.critic is not None:
        critic = models.critic_init if i == 0 else os.path.join(policy_path, "critic")
    return {"model": policy_path, "ref_model": models.base if models.ref else None, "critic": critic}


def with_outputs(samples, rewards, components, skipped, advantages, policy_tokens):
    """samples.jsonl's rows with the stages' outputs: "reward" (the weighted total, null for a skipped
    row), "rewards" (each function's, null where it does not apply) and "advantage" (A_i, or for PPO's
    per-token advantages their mean over the policy's tokens `policy_tokens` [N, T])."""
    if advantages.dim() == 2:                                               # [N, T] -> [N]
        advantages = (advantages * policy_tokens).sum(-1) / policy_tokens.sum(-1).clamp(min=1)
    rows = []
    for n, row in enumerate(samples):
        per_function = {k: None if v[n].isnan() else v[n].item() for k, v in components.items()}
        rows.append({**row, "reward": None if skipped[n] else rewards[n].item(), "rewards": per_function,
                     "advantage": advantages[n].item()})
    return rows


def iteration_records(train, i, B, seed):
    """The B training records of iteration i: consecutive slots of a seeded shuffle per pass."""
    records = []
    for k in range(i * B, (i + 1) * B):
        epoch, j = divmod(k, len(train))
        order = list(range(len(train)))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        records.append(train[order[j]])
    return records


def read_prompt_file(path):
    """The records of a prompt file (train.py's --prompts or --eval-prompts-file), each checked for what
    sample.py reads, and the line of each."""
    records, lines = files.read_jsonl(path, with_lines=True)
    for record, line in zip(records, lines):
        prompting.check_prompt_record(record, f"{path}, line {line}")
    return records, lines


def run_records(task, seed, prompts="", eval_prompts_file="", eval_prompts=0):
    """A run's training and held-out records, and where each comes from: the task's, or those of the
    prompt files given in their place. With --prompts and no --eval-prompts-file, `eval_prompts`
    records of --prompts, a seeded choice, are held out and not trained on (none with 0).

    Returns (train, held_out, where): where["train"] and where["held_out"] are (file, line of each
    record) for messages (the task's name and None for a task's records), and where["held_out_lines"]
    the lines of --prompts held out. Read before the run folder exists: a bad file stops the run with
    nothing written."""
    train, held_out, _ = tasks.make_task(task, seed)
    where = {"train": (f"task {task}", None), "held_out": (f"task {task}", None), "held_out_lines": None}
    if prompts:
        train, lines = read_prompt_file(prompts)
        where["train"] = (prompts, lines)
        if not eval_prompts_file and eval_prompts:
            if eval_prompts >= len(train):
                raise StageError(f"--prompts {prompts}: holding out --eval-prompts {eval_prompts} of its "
                                 f"{len(train)} records for evaluation would leave none to train on; pass "
                                 f"--eval-prompts-file FILE, a smaller --eval-prompts, or --eval-every 0")
            chosen = set(random.Random(f"{seed}/held-out").sample(range(len(train)), eval_prompts))
            held_out = [r for i, r in enumerate(train) if i in chosen]
            where["held_out"] = (prompts, [line for i, line in enumerate(lines) if i in chosen])
            where["held_out_lines"] = where["held_out"][1]
            train = [r for i, r in enumerate(train) if i not in chosen]
            where["train"] = (prompts, [line for i, line in enumerate(lines) if i not in chosen])
    if eval_prompts_file:
        held_out, lines = read_prompt_file(eval_prompts_file)
        where["held_out"] = (eval_prompts_file, lines)
        seen = {json.dumps(r, sort_keys=True) for r in train}
        shared = sum(json.dumps(r, sort_keys=True) in seen for r in held_out)
        if shared:
            warn(f"--eval-prompts-file {eval_prompts_file}: {shared} of its {len(held_out)} records are also "
                 f"training records, so the held-out score measures prompts the policy trains on")
    return train, held_out, where
