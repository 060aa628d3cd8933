"""A run's configuration: train.py's own flags, the named configurations of --config, where a run's
default differs from a stage's own (and why), what --resume may change, the checks of the run's
settings together, and each stage's flags for an iteration of the run (the stages' own parse_args
build their arguments from them).
"""

import argparse
import os

from grpo import settings
from grpo.cli import ArgumentParser, StageError, device_name
from grpo.disk import files, outputs
from grpo.models import distributed
from grpo.rewards import tasks
from grpo.settings import at_least

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
# train.py's flags that say what to run, which are not settings of the run.
COMMAND = {"help", "config", "config_file", "run_dir", "resume", "check"}

# What each of the run's own settings may be (the stages' are checked by their own RULES).
RULES = {"iterations": at_least(1), "eval_every": at_least(0), "eval_prompts": at_least(0),
         "save_every": at_least(0), "max_sample_rounds": at_least(1), "critic_warmup": at_least(0),
         "staleness": at_least(0), "sample_threads": at_least(0), "eval_samples": at_least(0)}


def parse(argv, description, flags):
    """train.py's command line to (its arguments, the run's configuration: a namespace of every setting,
    the run folder): a named configuration or a JSON file with the flags given on top or, with --resume,
    the run's saved one; the run's own settings checked. `flags`: the stages' settings a run takes
    (settings.stage_flags), whose own checks are the stages' parse_args."""
    p = parser(description, list(CONFIGS))
    settings.add_flags(p.add_argument_group("the stages' settings"), flags, RUN_DEFAULTS)
    args = p.parse_args(argv)
    if args.config and args.config_file:
        raise StageError("--config and --config-file both name the starting configuration; give one")
    defaults = settings.defaults(p, flags, RUN_DEFAULTS, COMMAND)
    kinds = settings.kinds(p, flags, COMMAND)
    for action in p._actions:
        action.default = None                   # parsed again: the settings given on the command line
    given = absolute_paths({k: v for k, v in vars(p.parse_args(argv)).items()
                            if k not in COMMAND and v is not None})
    name = os.path.splitext(os.path.basename(args.config_file))[0] if args.config_file else args.config
    run_dir = args.run_dir or os.path.join("runs", name or "default")
    cfg = argparse.Namespace(**{**configuration(args, run_dir, given, defaults, kinds), **given})
    cfg.reward = cfg.reward or tasks.TASKS[cfg.task][1]
    settings.check(cfg, RULES)
    check_combinations(cfg)
    return args, cfg, run_dir


def configuration(args, run_dir, given, defaults, kinds):
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
        resumable = RESUMABLE - ({"iterations"} if cfg["lr_schedule"] != "constant" else set())
        changed = {k for k, v in given.items() if k not in resumable and v != cfg[k]}
        if changed:                            # a decaying learning rate spans the run's iterations
            raise StageError(f"--resume keeps the run's configuration; cannot change "
                             f"--{', --'.join(sorted(changed)).replace('_', '-')}")
        return cfg
    if not args.check:
        outputs.check_new_run_dir(run_dir)
    return absolute_paths(settings.read_config(args.config_file, defaults, kinds) if args.config_file
                          else {**defaults, **CONFIGS[args.config or "default"]})


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
    if cfg.rollout_is != "none" and cfg.engine == "sampler" and not cfg.staleness and not (
            cfg.top_k > 0 or cfg.top_p < 1.0 or cfg.min_p > 0.0):
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
    publish, no torchrun ranks."""
    if distributed.under_torchrun():
        raise StageError(f"--staleness {cfg.staleness} runs one producer beside one update process, not under "
                         f"torchrun's ranks yet; use --staleness 0 there")
    refused = {"--algo ppo (the critic's values are sampled with the policy)": cfg.algo == "ppo",
               "--fsdp": cfg.fsdp}
    for what, given in refused.items():
        if given:
            raise StageError(f"--staleness {cfg.staleness} does not run with {what} yet; use --staleness 0")


PATHS = ("model", "prompts", "eval_prompts_file", "critic_init")      # settings that name files or folders


def absolute_paths(values):
    """A run's settings with the files and folders it names (PATHS, --reward's files and reward-model
    folders, --env's file.py:NAME) made absolute where they exist, so that config.json means the same
    from any folder and --resume works from anywhere."""
    def absolute(value):
        path, colon, function = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        return os.path.abspath(path) + colon + function if path and os.path.exists(path) else value
    out = dict(values)
    for key in PATHS:
        if out.get(key):
            out[key] = absolute(out[key])
    if out.get("reward"):
        out["reward"] = [absolute(spec) for spec in out["reward"]]
    if out.get("env") and ":" in out["env"]:                  # not a built-in name, which is no file
        out["env"] = absolute(out["env"])
    return out


def parser(description, config_names):
    """train.py's own flags: the command (which configuration, which folder) and the run's settings,
    which no stage takes (train.py adds the stages' flags)."""
    p = ArgumentParser(description=description)
    p.add_argument("--config", default=None, choices=config_names, help="named configuration (default: default)")
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


# The stage flags a run sets itself at every iteration (files, models, seeds), not settings.
OWNED = {"sample.py": {"model", "prompts", "out", "start", "seed", "ref_model", "critic"},
         "score.py": {"rollouts", "samples", "out"},
         "advantage.py": {"rewards", "out", "rollouts"},
         "update.py": {"model", "rollouts", "advantages", "out", "ref_model", "critic", "critic_out", "seed",
                       "total_steps", "fresh_optimizer", "critic_only"}}


def stage_settings(script, cfg, it_dir, slot, i, paths):
    """The flags of stage `script` at iteration i of the run `cfg`: every setting of the run that is one
    of its flags and not OWNED, then what the run sets itself: the files of `it_dir`, the models of
    `paths` (model, ref_model, critic; None where unused), the sampler's seed from `slot` (whose records
    it samples) and the update's from i."""
    path = {k: os.path.join(it_dir, f"{k}.safetensors") for k in ("rollouts", "rewards", "advantages")}
    minibatches = len(distributed.row_slices(cfg.num_prompts * cfg.group_size, cfg.minibatch_size))
    policy_out = os.path.join(os.path.dirname(it_dir), "policy")
    critic = paths["critic"]
    # log π_ref is the update's (computed beside log π_θ); the rollouts hold it only where it is read
    # before the update (PPO's --kl-in-reward) or instead of it (--ref-logprobs rollouts).
    ref_in_rollouts = cfg.kl_in_reward != 0 or cfg.ref_logprobs == "rollouts"
    own = {"sample.py": dict(model=paths["model"], prompts=os.path.join(it_dir, "prompts.jsonl"), out=it_dir,
                             ref_model=paths["ref_model"] if ref_in_rollouts else None, critic=critic,
                             seed=cfg.seed * 1_000_003 + slot),
           "score.py": dict(rollouts=path["rollouts"], samples=os.path.join(it_dir, "samples.jsonl"),
                            out=path["rewards"]),
           "advantage.py": dict(rewards=path["rewards"], out=path["advantages"],
                                rollouts=path["rollouts"] if cfg.estimator == "gae" else None),
           "update.py": dict(model=paths["model"], rollouts=path["rollouts"], advantages=path["advantages"],
                             out=policy_out, critic=critic,
                             ref_model=None if cfg.ref_logprobs == "rollouts" else paths["ref_model"],
                             critic_out=os.path.join(policy_out, "critic") if critic else None,
                             seed=cfg.seed * 1_000_003 + i, critic_only=i < cfg.critic_warmup,
                             total_steps=(cfg.iterations - cfg.critic_warmup) * cfg.epochs * minibatches)}
    assert own[script].keys() <= OWNED[script]
    return {**{k: v for k, v in vars(cfg).items() if k not in OWNED[script]}, **own[script]}
