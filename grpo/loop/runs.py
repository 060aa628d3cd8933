"""A training run: its own settings (the flags train.py adds to the stages'), its records (the task's or
its prompt files', which are held out, which each iteration takes), what it holds in memory (the
policy, with FSDP a full copy that samples, π_ref, PPO's critic, AdamW and the reward functions),
loaded from the base model or from the last save, and the models each iteration's stage commands name.
"""

import argparse
import json
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grpo import lora, settings
from grpo.cli import ArgumentParser, StageError, device_name, warn
from grpo.disk import files, outputs, provenance
from grpo.models import builders, distributed, loading, vllm_engine
from grpo.rewards import environments, prompting, reward_specs, tasks
from grpo.settings import at_least
from grpo.training import optim, ppo_critic


# What each of the run's own settings may be (the stages' are checked by their own RULES).
RULES = {"iterations": at_least(1), "eval_every": at_least(0), "eval_prompts": at_least(0),
         "save_every": at_least(0), "max_sample_rounds": at_least(1), "critic_warmup": at_least(0),
         "staleness": at_least(0), "sample_threads": at_least(0), "eval_samples": at_least(0)}


# The estimators that compare a completion with the others of its group (advantage.py refuses G = 1
# for them): docs/forking.md.
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo")


def check_combinations(cfg):
    """Settings of different stages that must agree. PPO's advantages come from its critic (gae), GRPO's
    from the group (the estimator follows --algo), and a group needs two completions to compare."""
    ppo = cfg.algo == "ppo"
    if cfg.eval_every and not cfg.eval_prompts:
        raise StageError(f"--eval-prompts 0 with --eval-every {cfg.eval_every}: there would be nothing to "
                         f"evaluate; pass --eval-every 0 for no held-out evaluation")
    if cfg.estimator is None:
        cfg.estimator = "gae" if ppo else "grpo"
    if cfg.rollout_is is None:          # stale rollouts: clip against π_prox, weigh by π_prox/π_behav
        cfg.rollout_is = "tis" if cfg.staleness else "none"
    if cfg.staleness and cfg.old_logprobs is None:
        cfg.old_logprobs = "recompute"
    if (cfg.estimator == "gae") != ppo:
        raise StageError(f"--estimator {cfg.estimator} with --algo {cfg.algo}: gae needs the critic of "
                         f"--algo ppo, and ppo takes its advantages from gae")
    if cfg.critic_warmup and not ppo:
        raise StageError(f"--critic-warmup {cfg.critic_warmup} trains PPO's critic, and --algo is {cfg.algo}")
    if cfg.critic_warmup and cfg.critic_warmup >= cfg.iterations:
        raise StageError(f"--critic-warmup {cfg.critic_warmup}: the policy would never move in --iterations "
                         f"{cfg.iterations}; give 0 ≤ K < --iterations")
    if cfg.rollout_is != "none" and cfg.engine == "sampler" and not cfg.staleness and not (cfg.top_k > 0 or cfg.top_p < 1.0
                                                                      or cfg.min_p > 0.0):
        raise StageError(f"--rollout-is {cfg.rollout_is} reweighs tokens drawn by another engine or from a truncated "
                         f"distribution, and neither --engine vllm nor --top-k, --top-p or --min-p is given: π_old "
                         f"is the sampling distribution itself")
    if ppo and cfg.dynamic_sampling:
        raise StageError("--dynamic-sampling drops groups with equal rewards, which only GRPO needs; "
                         "use it with --algo grpo")
    needs_group = {"--estimator " + cfg.estimator: cfg.estimator in GROUP_RELATIVE,
                   "--dynamic-sampling": cfg.dynamic_sampling, "--length-strata": cfg.length_strata > 1}
    needing = [flag for flag, needs in needs_group.items() if needs]
    if cfg.group_size < 2 and needing:
        raise StageError(f"--group-size {cfg.group_size}: {needing[0]} compares each completion with the "
                         f"others of its group, so G must be at least 2 (PPO's critic needs none: --algo ppo)")
    if cfg.staleness:
        check_staleness(cfg)
    G, S = cfg.group_size, cfg.length_strata
    if S > 1 and (G % S or G // S < 2):
        raise StageError(f"--length-strata {S}: the G = {G} completions of a group must split into strata of "
                         f"equal size of at least 2 (S divides G, S ≤ G/2)")


def check_staleness(cfg):
    """--staleness K runs what the producer process can run alone: one process's models, no critic to
    publish (torchrun's ranks are refused where they are known, train.py:main)."""
    refused = {"--algo ppo (the critic's values are sampled with the policy)": cfg.algo == "ppo",
               "--fsdp": cfg.fsdp}
    for what, given in refused.items():
        if given:
            raise StageError(f"--staleness {cfg.staleness} does not run with {what} yet; use --staleness 0")


PATHS = ("model", "prompts", "eval_prompts_file", "critic_init")      # settings that name files or folders


def absolute_paths(settings):
    """A run's settings with the files and folders it names (PATHS, and --reward's files and reward-model
    folders) made absolute where they exist, so that config.json means the same from any folder and
    --resume works from anywhere."""
    def absolute(value):
        path, colon, function = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        return os.path.abspath(path) + colon + function if path and os.path.exists(path) else value
    out = dict(settings)
    for key in PATHS:
        if out.get(key):
            out[key] = absolute(out[key])
    if out.get("reward"):
        out["reward"] = [absolute(spec) for spec in out["reward"]]
    return out


def parser(description, configs):
    """train.py's own flags: the command (which configuration, which folder) and the run's settings,
    which no stage takes (train.py adds the stages' flags)."""
    p = ArgumentParser(description=description)
    p.add_argument("--config", default=None, choices=configs, help="named configuration (default: default)")
    p.add_argument("--config-file", default=None,
                   help="start from a JSON file instead: an object of settings, or a run's config.json")
    p.add_argument("--run-dir", default=None, help="run folder (default: runs/CONFIG or runs/FILE's stem)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last save")
    p.add_argument("--check", action="store_true",
                   help="sample and score the first batch, report its reward spread, write nothing")
    run = p.add_argument_group("the run's settings")
    run.add_argument("--algo", default="grpo", choices=["grpo", "ppo"],
                     help="grpo, or ppo: a critic V and GAE advantages (estimator gae) on the same stages")
    run.add_argument("--model", default="", help="the policy: a folder or Hub id org/name[@rev]; '' = "
                                                 "SmolLM2-135M-Instruct, 'tiny' = a tiny Llama built here")
    run.add_argument("--task", default="arithmetic", choices=list(tasks.TASKS),
                     help="built-in prompts and reward")
    run.add_argument("--prompts", default="",
                     help="JSON-lines prompt file for training, in place of the task's; without\n"
                          "--eval-prompts-file, --eval-prompts of its records (a seeded choice) are held out")
    run.add_argument("--eval-prompts-file", default="",
                     help="JSON-lines held-out prompts, in place of the task's")
    run.add_argument("--iterations", type=int, default=15, help="K: iterations")
    run.add_argument("--seed", type=int, default=0, help="seed of every draw of the run")
    run.add_argument("--eval-every", type=int, default=5,
                     help="greedy held-out evaluation at 0, every this many iterations and at the end\n"
                          "(0: none)")
    run.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts evaluated")
    run.add_argument("--eval-samples", type=int, default=0, metavar="n",
                     help="n: also sample n answers a held-out prompt at τ; pass@1, pass@k, maj@n (0: greedy only)")
    run.add_argument("--save-every", type=int, default=10,
                     help="save policy/ (the resume point) and keep checkpoints/iter_XXXX this often")
    run.add_argument("--critic-warmup", type=int, default=0, metavar="K",
                     help="PPO: the first K iterations train the critic alone (update.py --critic-only), the\n"
                          "policy frozen, so its first steps have a baseline that learned (verl's critic_warmup)")
    run.add_argument("--critic-init", default="",
                     help="PPO: the critic's transformer (folder or Hub id); '' = the initial policy's")
    run.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
                     help="DAPO's dynamic sampling: refill the batch with groups whose rewards differ")
    run.add_argument("--max-sample-rounds", type=int, default=3,
                     help="R: sampling rounds of dynamic sampling")
    run.add_argument("--staleness", type=int, default=0, metavar="K",
                     help="K: iteration k sampled by policy version max(0, k − K) in a producer process\n"
                          "beside the update (0: one process, stage after stage)")
    run.add_argument("--sample-device", default=None, type=device_name,
                     help="--staleness: the producer's device (default: --device)")
    run.add_argument("--sample-threads", type=int, default=0,
                     help="--staleness on a CPU: the producer's threads, the update keeps the rest (0: half)")
    return p


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


def configuration(args, run_dir, given, defaults, kinds, configs, resumable):
    """The run's settings before the command line's `given` ones go on top: with --resume, the run's
    saved config.json (which `given` may change only where `resumable`, less --iterations under a
    decaying lr); else --config-file's or the named configuration's, in a run folder that holds no
    other run. Paths are absolute."""
    if args.resume:
        if not outputs.is_run_dir(run_dir):
            if os.path.isfile(os.path.join(run_dir, "config.json")) and outputs.read_marker(run_dir) is None:
                files.read_json(os.path.join(run_dir, "config.json"))         # a damaged one says so
            raise StageError(f"{run_dir}: not a run folder (no config.json of train.py) to resume")
        cfg = absolute_paths(settings.read_config(os.path.join(run_dir, "config.json"), defaults, kinds))
        resumable = resumable - ({"iterations"} if cfg["lr_schedule"] != "constant" else set())
        changed = {k for k, v in given.items() if k not in resumable and v != cfg[k]}
        if changed:                            # a decaying learning rate spans the run's iterations
            raise StageError(f"--resume keeps the run's configuration; cannot change "
                             f"--{', --'.join(sorted(changed)).replace('_', '-')}")
        return cfg
    if not args.check:
        outputs.check_new_run_dir(run_dir)
    return absolute_paths(settings.read_config(args.config_file, defaults, kinds) if args.config_file
                          else {**defaults, **configs[args.config or "default"]})
