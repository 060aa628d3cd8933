"""The GRPO loop: sample → score → advantage → update, K iterations in one process (or in each
process of torchrun).

    python train.py                  # SmolLM2-135M-Instruct on two-digit sums (about 15 min, 2 CPU cores)
    python train.py --config tiny    # a tiny Llama learning a toy task from scratch (about a minute)
    python train.py --check          # sample the first batch, report its reward spread, write nothing
    python train.py --algo ppo       # the baseline: PPO with a critic and GAE, on the same stages
    python train.py --config-file runs/tiny/config.json --seed 1 --run-dir runs/tiny_seed1
    python train.py --reward exact_answer my_rewards.py:format_reward --reward-weights 1 0.2
    python train.py --run-dir runs/default --resume --iterations 30     # continue a run
    torchrun --nproc_per_node 8 train.py --config gpu [--fsdp]          # one node, 8 GPUs

Models stay in memory between stages, but each stage's namespace is built by that stage's own
parser from the run's configuration (a field and a stage flag of one name are one setting), and
its files are written by its own functions, so any iteration can be re-run one stage at a time
(iter_XXXX/replay.sh). The run folder is described in FORMATS.md.

Every draw of iteration i comes from generators seeded from (seed, i): the records it sees (a
seeded shuffle per pass over them), the sampler, the minibatch shuffle. No RNG state crosses
iterations, so the policy and AdamW's state, saved every --save-every iterations, are all a resume
needs: --resume recomputes the iterations since the last save, bit for bit on a CPU. With
--dynamic-sampling, round r of iteration i uses the records and seed of slot i·R + r.
"""

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import advantage
import sample
import score
import update
from grpo import (builders, checkpoints, diagnostics, distributed, evaluation, files, modeling, reward_specs,
                  tasks)
from grpo.cli import ArgumentParser, StageError, run_cli, warn


def knob(default, help, item=str):
    """A configuration field and its --help text (`item`: the type of a list's elements)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, "item": item})
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    algo: str = knob("grpo", "grpo, or ppo: a critic V and GAE advantages (estimator gae) in the same stages")
    model: str = knob("", "the policy: a folder or Hub id org/name[@rev]; '' = SmolLM2-135M-Instruct, "
                          "'tiny' = built here")
    task: str = knob("arithmetic", f"built-in task: {', '.join(tasks.TASKS)}")
    prompts: str = knob("", "JSON-lines prompt file for training, in place of the task's records")
    eval_prompts_file: str = knob("", "JSON-lines held-out prompts, in place of the task's")
    iterations: int = knob(15, "K: iterations")
    num_prompts: int = knob(4, "B: prompts per iteration")
    group_size: int = knob(8, "G: completions per prompt")
    max_new_tokens: int = knob(24, "L_max: completion length limit")
    temperature: float = knob(0.7, "τ: sampling temperature")
    lr: float = knob(1e-5, "learning rate")
    lr_schedule: str = knob("constant", "constant, linear or cosine decay to 0 over the run's AdamW steps")
    warmup_steps: int = knob(0, "linear learning-rate warm-up, in AdamW steps")
    beta: float = knob(0.01, "β: KL weight")
    clip_eps: float = knob(0.2, "ε (ε_low): clip range")
    clip_eps_high: float = knob(None, "ε_high: upper clip (DAPO); unset = ε")
    dual_clip: float = knob(None, "C: dual-clip cap for A < 0; unset = off")
    ratio_level: str = knob("token", "token, or sequence (GSPO)")
    kl_estimator: str = knob("k3", "k1, k2, k3: the KL estimator in the loss")
    entropy_coef: float = knob(0.0, "c: entropy bonus −c·H_t in the loss")
    mask_truncated: bool = knob(False, "no loss on completions without EOS (DAPO)")
    old_logprobs: str = knob(None, "sampler or recompute; unset: sampler on a CPU, recompute on a GPU")
    loss_agg: str = knob("seq", "loss aggregation: seq, token, dr_grpo")
    epochs: int = knob(1, "μ: passes over each batch")
    minibatch_size: int = knob(0, "completions per optimizer step; 0 = all")
    micro_batch_size: int = knob(0, "rows per forward pass of every stage; 0 = all")
    gradient_checkpointing: bool = knob(False, "the update recomputes activations in the backward pass")
    prefix_sharing: bool = knob(True, "each distinct prompt computed once per micro-batch in sampling, the "
                                      "reference pass and the update (the same numbers)")
    max_bad_steps: int = knob(5, "non-finite steps the whole run may skip before it stops")
    max_grad_norm: float = knob(1.0, "gradient clipping (policy and critic)")
    weight_decay: float = knob(0.0, "AdamW weight decay")
    estimator: str = knob(None, "advantage estimator: grpo, dr_grpo, rloo, batch; gae with --algo ppo; "
                                "unset: grpo, or gae with --algo ppo")
    scale: str = knob("group", "grpo's std: group, batch or none (TRL's scale_rewards)")
    eps: float = knob(1e-4, "ε in std + ε")
    length_strata: int = knob(1, "S: length strata per group")
    critic_init: str = knob("", "PPO: the critic's transformer (folder or Hub id); '' = the initial policy's")
    gamma: float = knob(1.0, "γ: GAE discount (PPO)")
    lam: float = knob(0.95, "λ: GAE trade-off (PPO)")
    kl_in_reward: float = knob(0.0, "β_r: per-token −β_r·k1 in GAE's rewards (PPO)")
    whiten: bool = knob(None, "normalise GAE advantages over the batch (PPO); unset = on")
    critic_lr: float = knob(None, "the critic's learning rate (PPO); unset = 10 × lr")
    vf_coef: float = knob(1.0, "c_V: value-loss weight (PPO)")
    value_clip: float = knob(0.2, "ε_v: value clip (PPO)")
    reward: list = knob([], "score.py's --reward SPECs; default: the task's")
    reward_weights: list = knob([], "score.py's weight of each --reward; default: all 1", item=float)
    on_reward_error: str = knob("fail", "fail or skip (score.py)")
    overlong_buffer: int = knob(0, "L: DAPO's overlong buffer; 0 = off")
    length_penalty: float = knob(0.0, "α: length penalty; 0 = off")
    ignore_eos: bool = knob(False, "every completion has L_max tokens (benchmarks)")
    dynamic_sampling: bool = knob(False, "DAPO's dynamic sampling: refill the batch with informative groups")
    max_sample_rounds: int = knob(3, "R: sampling rounds of dynamic sampling")
    seed: int = knob(0, "seed of every draw of the run")
    eval_every: int = knob(5, "greedy held-out evaluation at 0, every this many iterations and at the end")
    eval_prompts: int = knob(48, "held-out prompts")
    save_every: int = knob(10, "save policy/ (the resume point) and keep checkpoints/iter_XXXX this often")
    device: str = knob("auto", "cuda, cpu or auto")
    trust_remote_code: bool = knob(False, "let model folders run their own Python code")
    fsdp: bool = knob(False, "under torchrun: update with FSDP2 instead of DDP")

CONFIGS = {
    "default": Config(),
    "tiny": Config(model="tiny", task="char_classes", iterations=30, num_prompts=8, group_size=8,
                   max_new_tokens=8, temperature=1.0, lr=3e-3, eval_every=10, eval_prompts=12),
    # For a GPU: more prompts, longer answers, more iterations; the same code path.
    "gpu": Config(iterations=200, num_prompts=32, group_size=16, max_new_tokens=128, eval_every=20,
                  eval_prompts=200, save_every=50),
    # GSM8K with Qwen2.5-0.5B-Instruct on a GPU (README: Your own model, data and reward): the files of
    # examples/math_data.py; DeepSeekMath's lr 1e-6 and β 0.04 with G = 8 and 256 completions a step.
    "gsm8k_qwen": Config(model="Qwen/Qwen2.5-0.5B-Instruct", prompts="data/gsm8k_train.jsonl",
                         eval_prompts_file="data/gsm8k_test.jsonl", reward=["math"], iterations=200,
                         num_prompts=32, group_size=8, max_new_tokens=512, temperature=1.0, lr=1e-6,
                         beta=0.04, minibatch_size=256, micro_batch_size=32, eval_every=20, eval_prompts=200,
                         save_every=50),
}
# What --resume may change: nothing that alters the iterations already done.
RESUMABLE = {"iterations", "device", "eval_every", "eval_prompts", "save_every", "max_bad_steps", "fsdp",
             "gradient_checkpointing", "prefix_sharing"}
STAGES = {"sample.py": sample, "score.py": score, "advantage.py": advantage, "update.py": update}


def parse_args(argv=None):
    """The run's configuration: a named config (or a JSON file) with flags on top or, with --resume,
    the saved one."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, choices=list(CONFIGS),
                   help="named configuration (default: default)")
    p.add_argument("--config-file", default=None,
                   help="start from a JSON file instead: an object of fields, or a run's config.json")
    p.add_argument("--run-dir", default=None, help="run folder (default: runs/CONFIG or runs/FILE's stem)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last save")
    p.add_argument("--check", action="store_true",
                   help="sample and score the first batch, report its reward spread, write nothing")
    for f in dataclasses.fields(Config):
        default = getattr(CONFIGS["default"], f.name)
        flag, text = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default config: {default!r})"
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, type=f.metadata["item"] if f.type is list else f.type, default=None,
                           help=text, nargs="+" if f.type is list else None)
    args = p.parse_args(argv)
    if args.config and args.config_file:
        raise StageError("--config and --config-file both name the starting configuration; give one")
    overrides = {k: v for k, v in vars(args).items() if k in Config.__dataclass_fields__ and v is not None}
    name = os.path.splitext(os.path.basename(args.config_file))[0] if args.config_file else args.config
    run_dir = args.run_dir or os.path.join("runs", name or "default")
    if args.resume:
        if not os.path.isfile(os.path.join(run_dir, "config.json")):
            raise StageError(f"{run_dir}: no config.json to resume from")
        cfg = read_config(os.path.join(run_dir, "config.json"))
        resumable = RESUMABLE - ({"iterations"} if cfg.lr_schedule != "constant" else set())
        changed = {k for k, v in overrides.items() if k not in resumable and v != getattr(cfg, k)}
        if changed:                            # a decaying learning rate spans the run's iterations
            raise StageError(f"--resume keeps the run's configuration; cannot change "
                             f"--{', --'.join(sorted(changed)).replace('_', '-')}")
    else:
        if not args.check and os.path.isdir(run_dir) and os.listdir(run_dir):
            raise StageError(f"{run_dir} already holds a run; pass --resume to continue it or choose "
                             f"--run-dir")
        cfg = read_config(args.config_file) if args.config_file else CONFIGS[args.config or "default"]
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.task not in tasks.TASKS:
        raise StageError(f"--task {cfg.task!r}: expected one of {', '.join(tasks.TASKS)}")
    cfg.reward = cfg.reward or tasks.TASKS[cfg.task][1]
    check_algo(cfg)
    paths = {"model": "model", "ref_model": "ref", "critic": "critic" if cfg.algo == "ppo" else None}
    for script in STAGES:                             # each stage checks its flags before anything is written
        stage_args(script, cfg, "it", 0, 0, paths, [])
    return args, cfg, run_dir


def read_prompt_file(path):
    """The records of --prompts or --eval-prompts-file, each with what sample.py reads."""
    records = files.read_jsonl(path)
    for i, record in enumerate(records):
        if not (isinstance(record.get("prompt"), (str, list)) or isinstance(record.get("messages"), list)):
            raise StageError(f"{path}, record {i}: needs 'prompt' (a string or a list of chat turns) or "
                             f"'messages' (a list of chat turns)")
    return records


def records_of(cfg):
    """The training and held-out records: the task's, or those of --prompts and --eval-prompts-file
    (read before the run folder exists, so a bad file stops the run with nothing written)."""
    train, held_out, _ = tasks.make_task(cfg.task, cfg.seed)
    return (read_prompt_file(cfg.prompts) if cfg.prompts else train,
            read_prompt_file(cfg.eval_prompts_file) if cfg.eval_prompts_file else held_out)


def read_config(path):
    """A Config from a JSON file: {"config": {...}} as a run's config.json holds it, or the fields alone.
    Fields it leaves out take the default configuration's values."""
    saved = files.read_json(path)
    fields = saved.get("config", saved) if isinstance(saved, dict) else None
    if not isinstance(fields, dict):
        raise StageError(f"{path}: expected a JSON object of configuration fields")
    if "rewards" in fields and "reward" not in fields:          # the field's name before --reward-weights
        fields = {**fields, "reward": fields["rewards"]}
        del fields["rewards"]
    unknown = sorted(set(fields) - set(Config.__dataclass_fields__))
    if unknown:
        raise StageError(f"{path}: unknown configuration fields {', '.join(unknown)}")
    return Config(**fields)


def check_algo(cfg):
    """PPO's advantages come from its critic (gae), GRPO's from the group; the estimator follows --algo."""
    if cfg.algo not in ("grpo", "ppo"):
        raise StageError(f"--algo must be grpo or ppo, got {cfg.algo!r}")
    ppo = cfg.algo == "ppo"
    if cfg.estimator is None:
        cfg.estimator = "gae" if ppo else "grpo"
    if (cfg.estimator == "gae") != ppo:
        raise StageError(f"--estimator {cfg.estimator} with --algo {cfg.algo}: gae needs the critic of "
                         f"--algo ppo, and ppo takes its advantages from gae")
    if ppo and cfg.dynamic_sampling:
        raise StageError("--dynamic-sampling drops groups with equal rewards, which only GRPO needs; "
                         "use it with --algo grpo")


def stage_args(script, cfg, it_dir, slot, i, paths, commands):
    """A stage's namespace for iteration i, built by the stage's own parser (its defaults and checks):
    every field of the configuration that is one of its flags, the files of `it_dir`, and the models
    of `paths` (model, ref_model, critic; None where unused); the records and the sampler's seed come
    from `slot`. The equivalent command is appended to `commands`."""
    path = {k: os.path.join(it_dir, f"{k}.safetensors") for k in ("rollouts", "rewards", "advantages")}
    minibatches = len(distributed.row_slices(cfg.num_prompts * cfg.group_size, cfg.minibatch_size))
    policy_out = os.path.join(os.path.dirname(it_dir), "policy")
    critic = paths["critic"]
    own = {"sample.py": dict(model=paths["model"], prompts=os.path.join(it_dir, "prompts.jsonl"), out=it_dir,
                             ref_model=paths["ref_model"], critic=critic, seed=cfg.seed * 1_000_003 + slot),
           "score.py": dict(rollouts=path["rollouts"], samples=os.path.join(it_dir, "samples.jsonl"),
                            reward=cfg.reward, out=path["rewards"]),
           "advantage.py": dict(rewards=path["rewards"], out=path["advantages"],
                                rollouts=path["rollouts"] if cfg.estimator == "gae" else None),
           "update.py": dict(model=paths["model"], rollouts=path["rollouts"], advantages=path["advantages"],
                             out=policy_out, critic=critic,
                             critic_out=os.path.join(policy_out, "critic") if critic else None,
                             seed=cfg.seed * 1_000_003 + i,
                             total_steps=cfg.iterations * cfg.epochs * minibatches)}
    parser = STAGES[script].build_parser()
    shared = {a.dest: getattr(cfg, a.dest) for a in parser._actions
              if hasattr(cfg, a.dest) and a.dest not in own[script]}
    argv = []
    for name, value in {**own[script], **shared}.items():
        if value is None or value == [] or (isinstance(value, bool) and value == parser.get_default(name)):
            continue                                                               # the stage's default
        argv.append(("--" if value is not False else "--no-") + name.replace("_", "-"))
        if isinstance(value, list):
            argv += map(str, value)
        elif not isinstance(value, bool):
            argv.append(str(value))
    commands.append(["python", script, *argv])
    return STAGES[script].parse_args(argv)


@dataclass
class Models:
    """What a run holds in memory."""
    base: str                       # the initial policy's folder; also π_ref's
    tokenizer: object
    policy: torch.nn.Module         # what AdamW steps: in DDP, or sharded by FSDP2, under torchrun
    sampler: torch.nn.Module        # the whole policy that samples: `policy`, or with FSDP a full copy
    ref: torch.nn.Module = None     # π_ref, frozen; None when β = 0 and no KL is in the reward
    critic: update.Critic = None    # PPO's value model and its AdamW (--algo ppo)
    critic_init: str = None         # the critic's folder before the first step (PPO)


def start(cfg, run_dir, done):
    """Rewards, models (the policy from the last save when resuming) and AdamW; config.json is
    written first, and a new run folder is removed again if anything fails to load."""
    main, new = distributed.is_main(), not os.path.exists(run_dir)
    device = distributed.pick_device(cfg.device)
    try:
        reward_fns = [reward_specs.load_reward(s, device, cfg.micro_batch_size, cfg.trust_remote_code)
                      for s in cfg.reward]
        if main:
            os.makedirs(run_dir, exist_ok=True)
            files.write_json(os.path.join(run_dir, "config.json"), {"config": vars(cfg)})
        base = builders.base_model_dir(cfg.model, run_dir, cfg.seed)
        path = os.path.join(run_dir, "policy") if done else base
        policy = modeling.load_model(path, device, cfg.trust_remote_code)
        sampler = policy
        if cfg.fsdp and distributed.rank_and_world()[1] > 1:
            sampler = modeling.load_model(path, device, cfg.trust_remote_code)
        needs_ref = cfg.beta != 0 or cfg.kl_in_reward != 0           # the k1 of --kl-in-reward (PPO)
        models = Models(base, modeling.load_tokenizer(path, cfg.trust_remote_code),
                        distributed.distribute(policy, cfg.fsdp), sampler,
                        modeling.load_model(base, device, cfg.trust_remote_code) if needs_ref else None)
        if cfg.algo == "ppo":
            models.critic_init, models.critic = start_critic(cfg, run_dir, base, done, device)
    except BaseException:
        if main and new:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    state = os.path.join(path, "optimizer.safetensors") if done else None
    # The learning rate of every step is set by update.train_policy (its schedule), for both optimizers.
    return models, checkpoints.adamw(models.policy, cfg.lr, state_file=state), reward_fns


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
    critic = distributed.distribute(modeling.load_critic(path, device, cfg.trust_remote_code), cfg.fsdp)
    state = os.path.join(path, "optimizer.safetensors") if done else None
    return init, update.Critic(critic, checkpoints.adamw(critic, cfg.lr, state_file=state))


def model_paths(models, policy_path, i):
    """The models that iteration i's stage commands name: the policy that samples it, π_ref, and PPO's
    critic, saved beside that policy (its critic/), or critic_init before the first step."""
    critic = None
    if models.critic is not None:
        critic = models.critic_init if i == 0 else os.path.join(policy_path, "critic")
    return {"model": policy_path, "ref_model": models.base if models.ref else None, "critic": critic}


@contextmanager
def timed(perf, key):
    t = time.perf_counter()
    yield
    perf[key] = perf.get(key, 0.0) + time.perf_counter() - t


def sample_and_score(slot, i, cfg, it_dir, models, policy_path, train, reward_fns, perf, commands):
    """Stages 1 and 2 in memory for the B records of `slot`: G completions each and their rewards."""
    paths = model_paths(models, policy_path, i)
    sample_args = stage_args("sample.py", cfg, it_dir, slot, i, paths, commands)
    score_args = stage_args("score.py", cfg, it_dir, slot, i, paths, commands)
    records = tasks.iteration_records(train, slot, cfg.num_prompts, cfg.seed)
    with timed(perf, "perf/sample_s"):
        critic = distributed.unwrap(models.critic.model) if models.critic else None
        rollouts, samples = sample.rollout_sharded(models.sampler, models.tokenizer, records, sample_args,
                                                   models.ref, prompts_path=sample_args.prompts,
                                                   critic=critic)
        rollouts = {k: v.cpu() for k, v in rollouts.items()}
    with timed(perf, "perf/score_s"):
        rewards, components, skipped = score.score_sharded(
            rollouts, samples, reward_fns, score_args.reward_weights, score_args.on_reward_error)
        rewards = score.length_shaping(rewards, components, rollouts["completion_mask"].sum(-1), score_args)
    batch = {"records": records, "rollouts": rollouts, "samples": samples, "rewards": rewards,
             "components": components, "skipped": skipped}
    return batch, sample_args, score_args


def main(argv=None):
    args, cfg, run_dir = parse_args(argv)
    distributed.init_distributed(cfg.device)                  # under torchrun; rank 0 writes and logs
    main = distributed.is_main()
    distributed.barrier()                                 # every rank has checked run_dir before it exists
    train, held_out = records_of(cfg)
    if args.check:                                            # the first batch, in a folder removed after
        with tempfile.TemporaryDirectory() as scratch:
            models, _, reward_fns = start(cfg, scratch, 0)
            batch, _, _ = sample_and_score(0, 0, cfg, os.path.join(scratch, "iter_0000"), models, models.base,
                                           train, reward_fns, {}, [])
        if main:
            completions = [s["completion"] for s in batch["samples"]]
            print("\n".join(diagnostics.batch_report(batch["rollouts"], batch["rewards"], completions,
                                                     cfg.group_size)))
        return
    restored = checkpoints.restore(run_dir) if args.resume and main else (0, 0)
    done, bad_steps = distributed.broadcast_ints(restored)            # rank 0 read the run folder
    if done > cfg.iterations:
        raise StageError(f"{run_dir} has saved {done} iterations, more than --iterations {cfg.iterations}")
    if cfg.beta == 0 and cfg.kl_in_reward == 0:                       # PPO's KL may sit in the reward
        warn(diagnostics.BETA_ZERO_WARNING)
    if cfg.kl_estimator == "k1" and cfg.beta != 0:
        warn(diagnostics.K1_WARNING)

    from torch.utils.tensorboard import SummaryWriter

    models, optimizer, reward_fns = start(cfg, run_dir, done)
    policy_dir = os.path.join(run_dir, "policy")
    weights = cfg.reward_weights or [1.0] * len(reward_fns)           # as score.py weighs them
    held_out_eval = evaluation.HeldOut(
        held_out[:cfg.eval_prompts], models.tokenizer, max_new_tokens=cfg.max_new_tokens, run_dir=run_dir,
        score=lambda rows, rollouts: score.score(rollouts, rows, reward_fns, weights)[0],
        trust_remote_code=cfg.trust_remote_code, micro_batch_size=cfg.micro_batch_size)
    writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=done) if main else None
    previous = os.path.join(run_dir, f"iter_{done - 1:04d}", "metrics.json")
    previous = files.read_json(previous) if done and os.path.isfile(previous) else None
    saved_at, saver = done, checkpoints.BackgroundSaver()

    bar = tqdm(range(done, cfg.iterations), desc=f"GRPO {run_dir}", unit="iter", initial=done,
               total=cfg.iterations, disable=None if main else True)
    for i in bar:
        t0, perf, commands = time.perf_counter(), {}, []
        held_out_metrics = {}
        if main and cfg.eval_every and i % cfg.eval_every == 0:
            held_out_metrics = held_out_eval(models.sampler, models.ref, models.base, i)
        link = main and i == done                           # resumed from a kept save: link it now
        policy_path = checkpoints.sampler_dir(run_dir, i, models.base, saved_at, cfg.save_every, link)
        it_dir = checkpoints.iteration_dir(run_dir, i, create=main)

        # Stages 1 and 2: G completions for each of B prompts, and their rewards.
        def sample_round(slot):
            commands.clear()
            return sample_and_score(slot, i, cfg, it_dir, models, policy_path, train, reward_fns, perf,
                                    commands)

        if cfg.dynamic_sampling:
            R = cfg.max_sample_rounds
            batch, sample_args, score_args = sample.dapo_dynamic_sampling(
                sample_round, i * R, R, cfg.num_prompts, cfg.group_size, models.tokenizer.pad_token_id, perf)
            sample_args.dapo_dynamic_sampling = True          # the file holds groups of several rounds
        else:
            batch, sample_args, score_args = sample_round(i)
        rollouts, rewards = batch["rollouts"], batch["rewards"]
        lengths = rollouts["completion_mask"].sum(-1)                                       # [N]
        # Stage 3: group-relative advantages.
        paths = model_paths(models, policy_path, i)
        advantage_args = stage_args("advantage.py", cfg, it_dir, i, i, paths, commands)
        adv = advantage.compute_advantages(rewards, rollouts["group_ids"], advantage_args, lengths, rollouts,
                                           batch["skipped"])
        with timed(perf, "perf/io_s"):
            if main:
                files.write_jsonl(os.path.join(it_dir, "prompts.jsonl"), batch["records"])
                sample.write_outputs(it_dir, rollouts, batch["samples"], sample_args)
                score.write_rewards(score_args.out, rewards, rollouts["group_ids"], batch["components"],
                                    score_args, lengths, batch["skipped"])
                files.save_tensors(advantage_args.out, adv, files.ADVANTAGES[0], vars(advantage_args))
        # Stage 4: the clipped policy update.
        update_args = stage_args("update.py", cfg, it_dir, i, i, paths, commands)
        with timed(perf, "perf/checkpoint_s"):
            saver.wait()                                      # a save in flight reads the weights it changes
        with timed(perf, "perf/update_s"):
            losses = update.train_policy(models.policy, optimizer, rollouts, adv["advantages"], update_args,
                                         models.critic, adv.get("returns"))
            if models.sampler is not models.policy:           # FSDP: the full copy that samples follows
                models.sampler.load_state_dict(checkpoints.checkpoint_tensors(models.policy), strict=False)

        completions = [s["completion"] for s in batch["samples"]]
        on_policy = ("logprob_diff_max", "logprob_diff_mean", "outside_clip_on_policy", "skipped_steps")
        charts = ("explained_variance",)
        metrics = {"iteration": i, **diagnostics.iteration_metrics(
            rollouts, rewards, batch["components"], batch["skipped"], completions, cfg.group_size),
            **{f"losses/{k}": v for k, v in losses.items() if k not in on_policy + charts},
            **{f"charts/{k}": losses[k] for k in charts if k in losses},
            **{f"diag/{k}": losses[k] for k in on_policy}, **perf,
            "perf/tokens_per_s": lengths.sum().item() / perf["perf/sample_s"]}
        if main and policy_path != policy_dir and not cfg.dynamic_sampling:   # the sampler is kept
            checkpoints.write_replay(it_dir, i, commands)
        if main and i == 0 and cfg.algo == "grpo":
            spread = diagnostics.reward_spread(rewards, cfg.group_size, batch["skipped"])
            tqdm.write("\n".join(diagnostics.spread_report(spread, cfg.group_size)))
        flags = diagnostics.collapse_flags(metrics, previous)
        metrics.update(flags, **held_out_metrics)
        if flags["diversity/collapse"]:
            jumped = ", ".join(k[10:] for k, v in flags.items() if v and k != "diversity/collapse")
            warn(f"WARNING: iteration {i}: diversity jumped ({jumped}): the policy may be collapsing onto "
                 f"one pattern; read iter_{i:04d}/samples.jsonl")
        bad_steps += losses["skipped_steps"]
        metrics["diag/bad_steps_total"] = bad_steps
        if bad_steps > cfg.max_bad_steps:
            saver.wait()
            raise StageError(f"{bad_steps} optimizer steps in this run had a non-finite loss or gradient, "
                             f"more than --max-bad-steps {cfg.max_bad_steps}; stopped, {policy_dir} holds "
                             f"the last good save ({saved_at} iterations)")
        t = time.perf_counter()
        if checkpoints.is_save_point(i + 1, cfg.save_every) or i + 1 == cfg.iterations:
            checkpoints.save_resume_point(
                models.policy, models.tokenizer, optimizer, losses, update_args, run_dir, i + 1, bad_steps,
                saver, keep=checkpoints.is_save_point(i + 1, cfg.save_every) and i + 1 < cfg.iterations,
                critic=models.critic)
            saved_at = i + 1
        metrics["perf/checkpoint_s"] += time.perf_counter() - t
        metrics["perf/iteration_s"] = time.perf_counter() - t0
        if main:
            checkpoints.log_iteration(writer, bar, it_dir, i, metrics, batch["samples"], rewards,
                                      cfg.group_size)
        previous = metrics

    saver.wait()
    if main and cfg.eval_every:
        final = held_out_eval(models.sampler, models.ref, models.base, cfg.iterations)
        checkpoints.log_scalars(writer, final, cfg.iterations)
        print(f"held-out reward after {cfg.iterations} iterations: {final['eval/reward_mean']:.3f}, "
              f"reference {final['eval/ref_reward_mean']:.3f} ({final['eval/num_prompts']} prompts, greedy)")
    if main:
        writer.close()


if __name__ == "__main__":
    run_cli(main)
