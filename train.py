"""The GRPO loop: sample → score → advantage → update, K iterations in one process (or in each
process of torchrun).

    python train.py                          # SmolLM2-135M-Instruct on two-digit sums (about 15 min, 2 CPU cores)
    python train.py --config tiny            # a small Llama learning a toy task from scratch (about a minute)
    python train.py --check                  # sample the first batch, report its reward spread, write nothing
    python train.py --run-dir runs/default --resume --iterations 30     # continue a run
    torchrun --nproc_per_node 8 train.py --config gpu [--fsdp]          # one node, 8 GPUs

Models stay in memory between stages, but every stage's file is written by that stage's own
functions, with the argument namespace that stage's parser builds, so any iteration can be
re-run one stage at a time from the files (README: "Replaying an iteration"). The run folder:

    runs/NAME/config.json              the resolved configuration
    runs/NAME/iter_XXXX/               prompts.jsonl (the B records used), rollouts.safetensors,
                                       samples.jsonl, rewards.safetensors, advantages.safetensors,
                                       metrics.json (written last: the iteration is complete)
    runs/NAME/policy/                  the policy, optimizer.safetensors and train_state.json, saved
                                       every --save-every iterations and at the end
    runs/NAME/checkpoints/iter_XXXX/   the policy that sampled iteration XXXX (hard links into a save)
    runs/NAME/eval/iter_XXXX.jsonl     greedy held-out completions of the policy after XXXX iterations,
                                       beside the reference model's
    runs/NAME/tb/                      TensorBoard events (charts/, losses/, diag/, diversity/, eval/, perf/)

runfolder.py saves, keeps and restores the run folder; evaluation.py is the held-out comparison.

Under torchrun every rank samples and scores its share of the groups and gets all rows back,
every rank computes the same advantages, update.py's function splits each minibatch across
the ranks (DDP, or FSDP2 with --fsdp, where a full copy of the policy samples), and rank 0
alone writes files, logs and evaluates.

Variants: every flag of the stages' variants is also a field here (--estimator, --loss-agg,
--clip-eps-high, --dual-clip, --ratio-level, --kl-estimator, --overlong-buffer, --length-penalty,
--length-strata), and --dynamic-sampling adds DAPO's dynamic sampling, which lives here because it
needs rewards to decide what to sample: with it the files hold the informative groups of up to
--max-sample-rounds rounds (round r of iteration i uses the records and seed of slot i·R + r),
and no replay.sh.

Randomness and resume: every draw of iteration i comes from generators seeded from (seed, i): the
order of the training records (a seeded shuffle per pass over them), the sampler, the minibatch
shuffle. No RNG state crosses iterations, so the policy and AdamW's state are all a resume needs.
Saving them costs seconds (1.6 GB for the default model), so it happens every --save-every
iterations, not every iteration; --resume restarts after the last save and recomputes the
iterations since, which gives the same files and weights as a run that was never stopped (bit
for bit on a CPU).
"""

import dataclasses
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import advantage
import common
import diagnostics
import evaluation
import sample
import score
import runfolder
import tasks
import update


@dataclass
class Config:
    model: str = ""                  # HF folder; "" = SmolLM2-135M-Instruct (converted once), "tiny" = built here
    task: str = "arithmetic"         # tasks.TASKS
    iterations: int = 15             # K
    num_prompts: int = 4             # B prompts per iteration
    group_size: int = 8              # G
    max_new_tokens: int = 24         # L_max
    temperature: float = 0.7         # τ
    lr: float = 1e-5
    beta: float = 0.01               # β
    clip_eps: float = 0.2            # ε
    clip_eps_high: float = None      # ε_high (DAPO's clip-higher: 0.28); None = ε
    dual_clip: float = None          # C of dual-clip PPO; None = off
    ratio_level: str = "token"       # "sequence" = GSPO
    kl_estimator: str = "k3"
    loss_agg: str = "seq"
    epochs: int = 1                  # μ
    minibatch_size: int = 0          # 0: one optimizer step per epoch
    micro_batch_size: int = 0        # 0: no gradient accumulation
    max_bad_steps: int = 5           # skipped non-finite steps the whole run may have before it stops
    estimator: str = "grpo"
    eps: float = 1e-4
    length_strata: int = 1           # advantage.py --length-strata
    rewards: list = field(default_factory=list)    # default: the task's
    on_reward_error: str = "fail"    # score.py --on-reward-error
    overlong_buffer: int = 0         # DAPO's overlong reward shaping, L tokens; 0 = off
    length_penalty: float = 0.0      # α of score.py --length-penalty; 0 = off
    ignore_eos: bool = False         # sample.py --ignore-eos (benchmarks: every completion has L_max tokens)
    dynamic_sampling: bool = False   # DAPO's dynamic sampling: refill the batch with informative groups
    max_sample_rounds: int = 3
    seed: int = 0
    eval_every: int = 5              # greedy held-out evaluation at 0, every this many iterations, and at the end; 0 = off
    eval_prompts: int = 48
    save_every: int = 10             # save policy/ (the resume point) and keep checkpoints/iter_XXXX this often
    device: str = "auto"
    trust_remote_code: bool = False  # let model folders run their own Python code
    fsdp: bool = False               # under torchrun: update.py --fsdp (FSDP2) instead of DDP


CONFIGS = {
    "default": Config(),
    "tiny": Config(model="tiny", task="char_classes", iterations=30, num_prompts=8, group_size=8, max_new_tokens=8,
                   temperature=1.0, lr=3e-3, eval_every=10, eval_prompts=12, save_every=10),
    # For a GPU: more prompts, longer answers, more iterations; the same code path.
    "gpu": Config(iterations=200, num_prompts=32, group_size=16, max_new_tokens=128, lr=1e-5, eval_every=20,
                  eval_prompts=200, save_every=50),
}
# What --resume may change: nothing that alters the iterations already done.
RESUMABLE = {"iterations", "device", "eval_every", "eval_prompts", "save_every", "max_bad_steps", "fsdp"}
SYMBOLS = {"iterations": "K: iterations", "num_prompts": "B: prompts per iteration", "group_size": "G: completions "
           "per prompt", "max_new_tokens": "L_max: completion length limit", "temperature": "τ: sampling temperature",
           "beta": "β: KL weight", "clip_eps": "ε (ε_low): clip range", "clip_eps_high": "ε_high: upper clip (DAPO)",
           "dual_clip": "C: dual-clip cap for A < 0", "epochs": "μ: passes over each batch", "eps": "ε in std + ε",
           "estimator": "advantage estimator: grpo, dr_grpo, rloo, batch", "loss_agg": "loss aggregation: seq, "
           "token, dr_grpo", "ratio_level": "token, or sequence (GSPO)", "kl_estimator": "k1, k2, k3",
           "length_penalty": "α: length penalty", "length_strata": "S: length strata per group",
           "overlong_buffer": "L: DAPO overlong buffer", "lr": "learning rate"}


def parse_args(argv=None):
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="default", choices=list(CONFIGS), help="named configuration (default: default)")
    p.add_argument("--run-dir", default=None, help="run folder (default: runs/CONFIG)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last save")
    p.add_argument("--check", action="store_true",
                   help="sample and score the first batch, report the reward spread and diversity, write nothing")
    for f in dataclasses.fields(Config):
        flag, text = "--" + f.name.replace("_", "-"), f"{SYMBOLS.get(f.name, f.name)} (default: from --config)"
        if f.type is bool:
            p.add_argument(flag, action="store_true", default=None, help=text)
        else:
            kind = str if f.name == "rewards" else f.type
            p.add_argument(flag, type=kind, default=None, nargs="+" if f.name == "rewards" else None, help=text)
    args = p.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if getattr(args, f.name) is not None}
    return args, overrides


def resolve_config(args, overrides):
    """The run's configuration: a named config with flags on top, or, with --resume, the saved one."""
    run_dir = args.run_dir or os.path.join("runs", args.config)
    saved = os.path.join(run_dir, "config.json")
    if args.resume:
        if not os.path.isfile(saved):
            raise common.StageError(f"{run_dir}: no config.json to resume from")
        cfg = Config(**common.read_json(saved)["config"])
        changed = set(overrides) - RESUMABLE
        if changed:
            raise common.StageError(f"--resume keeps the run's configuration; cannot change --{', --'.join(sorted(changed))}")
    else:
        if not args.check and os.path.isdir(run_dir) and os.listdir(run_dir):
            raise common.StageError(f"{run_dir} already holds a run; pass --resume to continue it or choose --run-dir")
        cfg = dataclasses.replace(CONFIGS[args.config])
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.task not in tasks.TASKS:
        raise common.StageError(f"--task {cfg.task!r}: expected one of {', '.join(tasks.TASKS)}")
    cfg.rewards = cfg.rewards or tasks.TASKS[cfg.task][1]
    # Every stage's parser checks its flags now, before anything is written.
    for script, (parser, flags) in stage_flags(cfg, "it", 0, 0, "model", "ref").items():
        stage_args(script, parser, flags, [])
    return cfg, run_dir


def stage_flags(cfg, it_dir, slot, i, model_path, ref_path):
    """Each stage's command-line flags for iteration i (records and sampler seed from `slot`)."""
    files = {k: os.path.join(it_dir, f"{k}.safetensors") for k in ("rollouts", "rewards", "advantages")}
    return {
        "sample.py": (sample.parse_args, dict(
            model=model_path, prompts=os.path.join(it_dir, "prompts.jsonl"), out=it_dir, group_size=cfg.group_size,
            num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            seed=cfg.seed * 1_000_003 + slot, ref_model=ref_path, ignore_eos=cfg.ignore_eos, device=cfg.device,
            trust_remote_code=cfg.trust_remote_code)),
        "score.py": (score.parse_args, dict(
            rollouts=files["rollouts"], samples=os.path.join(it_dir, "samples.jsonl"), reward=cfg.rewards,
            overlong_buffer=cfg.overlong_buffer or None, length_penalty=cfg.length_penalty or None,
            max_new_tokens=cfg.max_new_tokens, on_reward_error=cfg.on_reward_error, out=files["rewards"],
            device=cfg.device, trust_remote_code=cfg.trust_remote_code)),
        "advantage.py": (advantage.parse_args, dict(
            rewards=files["rewards"], out=files["advantages"], estimator=cfg.estimator, eps=cfg.eps,
            length_strata=cfg.length_strata if cfg.length_strata != 1 else None)),
        "update.py": (update.parse_args, dict(
            model=model_path, rollouts=files["rollouts"], advantages=files["advantages"],
            out=os.path.join(os.path.dirname(it_dir), "policy"), lr=cfg.lr, beta=cfg.beta, clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip, ratio_level=cfg.ratio_level,
            kl_estimator=cfg.kl_estimator, loss_agg=cfg.loss_agg, epochs=cfg.epochs,
            minibatch_size=cfg.minibatch_size, micro_batch_size=cfg.micro_batch_size,
            max_bad_steps=cfg.max_bad_steps, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed * 1_000_003 + i, fsdp=cfg.fsdp, device=cfg.device, trust_remote_code=cfg.trust_remote_code)),
    }


def stage_args(script, parser, flags, commands):
    """Build a stage's namespace through its own parser (same defaults and checks as the command
    line) and append the equivalent command to `commands`."""
    argv = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.extend(map(str, value) if isinstance(value, list) else [str(value)])
    commands.append(["python", script, *argv])
    return parser(argv)


def base_model_dir(cfg, run_dir):
    if cfg.model == "":
        return common.default_model_dir()
    if cfg.model == "tiny":
        path = os.path.join(run_dir, "base_model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            common.make_tiny_llama(path, seed=cfg.seed)
        return path
    return cfg.model


def iteration_records(train, i, B, seed):
    """The B training records of iteration i: consecutive slots of a seeded shuffle per pass."""
    records = []
    for k in range(i * B, (i + 1) * B):
        epoch, j = divmod(k, len(train))
        order = list(range(len(train)))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        records.append(train[order[j]])
    return records


@contextmanager
def timed(perf, key):
    t = time.perf_counter()
    yield
    perf[key] = perf.get(key, 0.0) + time.perf_counter() - t


def sample_and_score(slot, i, cfg, it_dir, models, train, reward_fns, perf, commands):
    """Stages 1 and 2 in memory for the B records of `slot`: G completions each and their rewards."""
    flags = stage_flags(cfg, it_dir, slot, i, models["path"], models["ref_path"])
    sargs = stage_args("sample.py", *flags["sample.py"], commands)
    rargs = stage_args("score.py", *flags["score.py"], commands)
    records = iteration_records(train, slot, cfg.num_prompts, cfg.seed)
    with timed(perf, "perf/sample_s"):
        rollouts, samples = sample.rollout_sharded(models["sampler"], models["tokenizer"], records, sargs,
                                                   models["ref"], prompts_path=sargs.prompts)
        rollouts = {k: v.cpu() for k, v in rollouts.items()}
    with timed(perf, "perf/score_s"):
        rewards, components, skipped = score.score_sharded(rollouts, samples, reward_fns, rargs.reward_weights,
                                                           rargs.on_reward_error)
        rewards = score.length_shaping(rewards, components, rollouts["completion_mask"].sum(-1), rargs)
    batch = {"records": records, "rollouts": rollouts, "samples": samples, "rewards": rewards,
             "components": components, "skipped": skipped}
    return batch, sargs, rargs


def dapo_dynamic_sampling(i, cfg, perf, sample_round, pad_id):
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal give no gradient, so
    they are dropped and more prompts sampled, until B informative groups or --max-sample-rounds."""
    B, G = cfg.num_prompts, cfg.group_size
    kept, last = [], None
    for r in range(cfg.max_sample_rounds):
        last, sargs, rargs = sample_round(i * cfg.max_sample_rounds + r)
        informative = ~advantage.zero_spread(last["rewards"].double().reshape(B, G))          # [B]
        kept += [(last, b) for b in range(B) if informative[b]]
        perf["charts/sample_rounds"] = r + 1
        if len(kept) >= B:
            break
    perf["charts/informative_groups"] = min(len(kept), B)
    if not kept:                                              # nothing informative: train on the last round as is
        kept = [(last, b) for b in range(B)]
    kept = kept[:B]
    rows = [slice(b * G, (b + 1) * G) for _, b in kept]

    def merged(key):
        return torch.cat([part[key][idx] for (part, _), idx in zip(kept, rows)])

    batch = {
        "rollouts": sample.concat_rollouts([{k: v[idx] for k, v in part["rollouts"].items()}
                                            for (part, _), idx in zip(kept, rows)], pad_id),
        "records": [part["records"][b] for part, b in kept],
        "samples": [dict(s, group=g) for g, ((part, _), idx) in enumerate(zip(kept, rows)) for s in part["samples"][idx]],
        "rewards": merged("rewards"), "skipped": merged("skipped"),
        "components": {k: torch.cat([part["components"][k][idx] for (part, _), idx in zip(kept, rows)])
                       for k in last["components"]},
    }
    return batch, sargs, rargs


def run_iteration(i, cfg, run_dir, models, optimizer, train, reward_fns):
    """Stages 1→4 on the in-memory models, each stage's file written as its script would write it."""
    it_dir = os.path.join(run_dir, f"iter_{i:04d}")
    main = common.is_main()                                   # under torchrun, rank 0 writes the files
    if main:
        shutil.rmtree(it_dir, ignore_errors=True)             # a partial iteration is redone from scratch
        os.makedirs(it_dir)
    perf, commands = {}, []

    def sample_round(slot):
        commands.clear()
        return sample_and_score(slot, i, cfg, it_dir, models, train, reward_fns, perf, commands)

    if cfg.dynamic_sampling:
        batch, sargs, rargs = dapo_dynamic_sampling(i, cfg, perf, sample_round, models["tokenizer"].pad_token_id)
        sargs.dapo_dynamic_sampling = True                    # the file holds the informative groups of several rounds
    else:
        batch, sargs, rargs = sample_round(i)
    rollouts, rewards = batch["rollouts"], batch["rewards"]
    lengths = rollouts["completion_mask"].sum(-1)                                           # [N]
    with timed(perf, "perf/io_s"):
        if main:
            common.write_jsonl(os.path.join(it_dir, "prompts.jsonl"), batch["records"])
            sample.write_outputs(it_dir, rollouts, batch["samples"], sargs)
            score.write_rewards(rargs.out, rewards, rollouts["group_ids"], batch["components"], rargs, lengths,
                                batch["skipped"])

    flags = stage_flags(cfg, it_dir, i, i, models["path"], models["ref_path"])
    aargs = stage_args("advantage.py", *flags["advantage.py"], commands)
    adv = advantage.compute(rewards, rollouts["group_ids"], aargs, lengths)
    with timed(perf, "perf/io_s"):
        if main:
            common.save_tensors(aargs.out, adv, common.ADVANTAGES[0], vars(aargs))

    uargs = stage_args("update.py", *flags["update.py"], commands)
    with timed(perf, "perf/update_s"):
        losses = update.update(models["policy"], optimizer, rollouts, adv["advantages"], uargs, cfg.temperature,
                               cfg.max_new_tokens)
        if models["sampler"] is not models["policy"]:         # FSDP: the full copy that samples takes the step
            models["sampler"].load_state_dict(common.checkpoint_tensors(models["policy"]), strict=False)

    spread = diagnostics.reward_spread(rewards, cfg.group_size)
    diag_keys = ("logprob_diff_max", "logprob_diff_mean", "skipped_steps")
    metrics = {
        "iteration": i,
        "charts/reward_mean": rewards.mean().item(), "charts/reward_std": rewards.std().item(),
        **{f"charts/reward/{k}": v.mean().item() for k, v in batch["components"].items()},
        "charts/frac_zero_std": spread["frac_zero_std"],
        "charts/completion_len": lengths.float().mean().item(),
        "charts/truncated_frac": rollouts["truncated"].float().mean().item(),
        "charts/skipped_rewards": int(batch["skipped"].sum()),
        **{f"losses/{k}": v for k, v in losses.items() if k not in diag_keys},
        **{f"diag/{k}": losses[k] for k in diag_keys},
        "diag/reward_std_mean": spread["std_mean"], "diag/reward_std_median": spread["std_median"],
        **{f"diag/{k}": v for k, v in diagnostics.length_stats(lengths, rewards, cfg.group_size).items()},
        **{f"diversity/{k}": v for k, v in diagnostics.diversity(
            rollouts["completion_ids"], rollouts["completion_mask"], [s["completion"] for s in batch["samples"]]).items()},
        **perf, "perf/tokens_per_s": lengths.sum().item() / perf["perf/sample_s"],
    }
    return it_dir, metrics, batch, losses, uargs, commands, spread


def load_models(cfg, run_dir, done):
    """Policy (from the last save when resuming), tokenizer and, when β ≠ 0, the frozen reference.

    Under torchrun the policy is in DDP, or sharded by FSDP2 with --fsdp; "sampler" is the whole
    model that samples: the policy itself (DDP's module), or with FSDP a full copy that takes each
    step's weights."""
    base = base_model_dir(cfg, run_dir)
    start = os.path.join(run_dir, "policy") if done else base
    device = common.pick_device(cfg.device)
    policy = common.load_model(start, device, cfg.trust_remote_code)
    sharded = cfg.fsdp and common.rank_and_world()[1] > 1
    sampler = common.load_model(start, device, cfg.trust_remote_code) if sharded else policy
    return {"base": base, "ref_path": base if cfg.beta != 0 else None, "path": base,
            "tokenizer": common.load_tokenizer(start, cfg.trust_remote_code),
            "policy": common.distribute(policy, cfg.fsdp), "sampler": sampler,
            "ref": common.load_model(base, device, cfg.trust_remote_code) if cfg.beta != 0 else None}


def check(cfg):
    """--check: sample and score the first batch, print its reward spread and diversity, write nothing."""
    with tempfile.TemporaryDirectory() as scratch:
        models = load_models(cfg, scratch, 0)
        train, _, _ = tasks.make_task(cfg.task, cfg.seed)
        reward_fns = [score.load_reward(spec, common.pick_device(cfg.device), 0, cfg.trust_remote_code)
                      for spec in cfg.rewards]
        batch, _, _ = sample_and_score(0, 0, cfg, os.path.join(scratch, "iter_0000"), models, train, reward_fns, {}, [])
    if not common.is_main():
        return
    rollouts, rewards = batch["rollouts"], batch["rewards"]
    for line in diagnostics.spread_report(diagnostics.reward_spread(rewards, cfg.group_size), cfg.group_size):
        print(line)
    lengths = diagnostics.length_stats(rollouts["completion_mask"].sum(-1), rewards, cfg.group_size)
    div = diagnostics.diversity(rollouts["completion_ids"], rollouts["completion_mask"],
                                [s["completion"] for s in batch["samples"]])
    print(f"reward mean {rewards.mean().item():.3f}; length mean {lengths['len_mean']:.1f} std {lengths['len_std']:.1f}, "
          f"within-group length-reward correlation {lengths['length_reward_corr']:+.2f}; " +
          ", ".join(f"{k} {v:.2f}" for k, v in div.items()))


def start(cfg, run_dir, done):
    """Models, optimizer and rewards for a run; a new run folder is removed again if any of them fails to load."""
    main, new = common.is_main(), not os.path.exists(run_dir)
    try:
        reward_fns = [score.load_reward(spec, common.pick_device(cfg.device), 0, cfg.trust_remote_code)
                      for spec in cfg.rewards]
        if main:
            os.makedirs(run_dir, exist_ok=True)
            common.write_json(os.path.join(run_dir, "config.json"), {"config": vars(cfg)})   # first: resumable
            base_model_dir(cfg, run_dir)                      # the tiny config's base model is built once
        common.barrier()
        models = load_models(cfg, run_dir, done)
    except BaseException:
        if main and new:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    optimizer = update.make_optimizer(models["policy"], cfg.lr)
    if done:
        update.load_optimizer_state(models["policy"], optimizer, os.path.join(run_dir, "policy", "optimizer.safetensors"))
    return models, optimizer, reward_fns


def main(argv=None):
    args, overrides = parse_args(argv)
    cfg, run_dir = resolve_config(args, overrides)
    common.init_distributed(cfg.device)                       # under torchrun; rank 0 writes and logs
    main = common.is_main()
    common.barrier()                                          # every rank has checked run_dir before it is created
    if args.check:
        return check(cfg)
    done, bad_steps = common.from_main(runfolder.restore(run_dir) if args.resume and main else (0, 0))
    if done > cfg.iterations:
        raise common.StageError(f"{run_dir} has saved {done} iterations, more than --iterations {cfg.iterations}")
    if cfg.beta == 0:
        common.warn(diagnostics.BETA_ZERO_WARNING)

    from torch.utils.tensorboard import SummaryWriter

    models, optimizer, reward_fns = start(cfg, run_dir, done)
    policy_dir = os.path.join(run_dir, "policy")
    train, held_out, _ = tasks.make_task(cfg.task, cfg.seed)
    held_out = held_out[:cfg.eval_prompts]
    writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=done) if main else None
    previous = os.path.join(run_dir, f"iter_{done - 1:04d}", "metrics.json")
    previous = common.read_json(previous) if done and os.path.isfile(previous) else None
    reference, saved_at = {}, done
    saver, buffers = common.BackgroundWriter(), {}

    bar = tqdm(range(done, cfg.iterations), desc=f"GRPO {run_dir}", unit="iter", initial=done, total=cfg.iterations,
               disable=None if main else True)
    for i in bar:
        t0 = time.perf_counter()
        held_out_metrics = {}
        if main and cfg.eval_every and i % cfg.eval_every == 0:
            held_out_metrics = evaluation.evaluate(models, held_out, reward_fns, cfg, run_dir, i, reference)
        # The path the stage files record as --model: where the policy that samples iteration i lives.
        models["path"] = models["base"] if i == 0 else policy_dir
        if i > 0 and saved_at == i and runfolder.is_save_point(i, cfg.save_every):
            models["path"] = runfolder.checkpoint_dir(run_dir, i)
            if main and i == done:                            # resumed from this save: link it now (else the
                runfolder.keep_checkpoint(run_dir, i)         # background save does, once policy/ is written)
        it_dir, metrics, batch, losses, uargs, commands, spread = run_iteration(
            i, cfg, run_dir, models, optimizer, train, reward_fns)
        if main and models["path"] != policy_dir and not cfg.dynamic_sampling:   # the sampler is kept: replayable
            runfolder.write_replay(it_dir, i, commands)
        if main and i == 0:
            for line in diagnostics.spread_report(spread, cfg.group_size):
                tqdm.write(line)
        flags = diagnostics.collapse_flags(
            {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("diversity/")},
            previous and {k.split("/")[1]: v for k, v in previous.items() if k.startswith("diversity/")})
        metrics.update({f"diversity/{k}": v for k, v in flags.items()}, **held_out_metrics)
        if flags["collapse"]:
            common.warn(f"WARNING: iteration {i}: diversity jumped ({', '.join(k for k, v in flags.items() if v and k != 'collapse')}): "
                        f"the policy may be collapsing onto one pattern; read iter_{i:04d}/samples.jsonl")
        bad_steps += losses["skipped_steps"]
        metrics["diag/bad_steps_total"] = bad_steps
        if bad_steps > cfg.max_bad_steps:
            saver.wait()
            raise common.StageError(f"{bad_steps} optimizer steps in this run had a non-finite loss or gradient, more "
                                    f"than --max-bad-steps {cfg.max_bad_steps}; stopped, {policy_dir} holds the last "
                                    f"good save ({saved_at} iterations)")
        t = time.perf_counter()
        if runfolder.is_save_point(i + 1, cfg.save_every) or i + 1 == cfg.iterations:
            runfolder.save_policy(models, optimizer, losses, uargs, run_dir, i + 1, bad_steps, saver, buffers,
                                  keep=runfolder.is_save_point(i + 1, cfg.save_every) and i + 1 < cfg.iterations)
            saved_at = i + 1
        metrics["perf/checkpoint_s"] = time.perf_counter() - t
        metrics["perf/iteration_s"] = time.perf_counter() - t0
        if main:
            runfolder.report(writer, bar, it_dir, i, metrics, batch, held_out_metrics, cfg.group_size)
        previous = metrics

    saver.wait()
    if main and cfg.eval_every:
        final = evaluation.evaluate(models, held_out, reward_fns, cfg, run_dir, cfg.iterations, reference)
        runfolder.log(writer, final, cfg.iterations)
        print(f"held-out reward after {cfg.iterations} iterations: {final['eval/reward_mean']:.3f}, "
              f"reference {final['eval/ref_reward_mean']:.3f} ({final['eval/num_prompts']} prompts, greedy)")
    if main:
        writer.close()


if __name__ == "__main__":
    common.run_cli(main)
