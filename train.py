"""The GRPO loop: sample → score → advantage → update, K iterations in one process.

    python train.py                          # SmolLM2-135M-Instruct on two-digit sums (about 15 min, 2 CPU cores)
    python train.py --config tiny            # a small Llama learning a toy task from scratch (about a minute)
    python train.py --run-dir runs/default --resume --iterations 30     # continue a run

Models stay in memory between stages, but every stage's file is written by that stage's own
functions, with the argument namespace that stage's parser builds, so any iteration can be
re-run one stage at a time from the files (README: "Replaying an iteration"). The run folder:

    runs/NAME/config.json              the resolved configuration
    runs/NAME/iter_XXXX/               prompts.jsonl (the B records used), rollouts.safetensors,
                                       samples.jsonl, rewards.safetensors, advantages.safetensors,
                                       metrics.json (written last: the iteration is complete)
    runs/NAME/policy/                  the latest policy, optimizer.safetensors, train_state.json
    runs/NAME/checkpoints/iter_XXXX/   the policy that sampled iteration XXXX, every --save-every
    runs/NAME/eval/iter_XXXX.jsonl     greedy held-out completions of the policy after XXXX iterations
    runs/NAME/tb/                      TensorBoard events (charts/, losses/, eval/, perf/, sampled texts)

Variants: every flag of the stages' variants is also a field here (--estimator, --loss-agg,
--clip-eps-high, --dual-clip, --ratio-level, --kl-estimator, --overlong-buffer), and
--dynamic-sampling adds DAPO's dynamic sampling, which lives here because it needs rewards to
decide what to sample: with it the files hold the informative groups of up to --max-sample-rounds
rounds (round r of iteration i uses the records and seed of slot i·R + r), and no replay.sh.

Randomness: every draw of iteration i comes from generators seeded from (seed, i): the order of
the training records (a seeded shuffle per pass over them), the sampler, the minibatch shuffle.
No RNG state crosses iterations, so --resume needs only the policy and its optimizer state and
gives the same weights as a run that was never interrupted. The policy is saved after every
iteration; train_state.json inside it says how many iterations it has seen, and is the truth
--resume starts from.
"""

import dataclasses
import glob
import json
import os
import random
import shlex
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import advantage
import common
import sample
import score
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
    estimator: str = "grpo"
    eps: float = 1e-4
    rewards: list = field(default_factory=list)    # default: the task's
    overlong_buffer: int = 0         # DAPO's overlong reward shaping, L tokens; 0 = off
    dynamic_sampling: bool = False   # DAPO's dynamic sampling: refill the batch with informative groups
    max_sample_rounds: int = 3
    seed: int = 0
    eval_every: int = 5              # greedy held-out evaluation at 0, every this many iterations, and at the end
    eval_prompts: int = 48
    save_every: int = 10             # keep checkpoints/iter_XXXX every this many iterations
    device: str = "auto"


CONFIGS = {
    "default": Config(),
    "tiny": Config(model="tiny", task="char_classes", iterations=30, num_prompts=8, group_size=8, max_new_tokens=8,
                   temperature=1.0, lr=3e-3, eval_every=10, eval_prompts=12, save_every=10),
    # For a GPU: more prompts, longer answers, more iterations; the same code path.
    "gpu": Config(iterations=200, num_prompts=32, group_size=16, max_new_tokens=128, lr=1e-5, eval_every=20,
                  eval_prompts=200, save_every=50),
}


def parse_args(argv=None):
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="default", choices=list(CONFIGS), help="named configuration (default: default)")
    p.add_argument("--run-dir", default=None, help="run folder (default: runs/CONFIG)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last complete iteration")
    help_of = {"iterations": "K: iterations", "num_prompts": "B: prompts per iteration", "group_size": "G",
               "max_new_tokens": "L_max", "temperature": "τ", "beta": "β", "clip_eps": "ε", "epochs": "μ"}
    for f in dataclasses.fields(Config):
        flag, text = "--" + f.name.replace("_", "-"), f"{help_of.get(f.name, f.name)} (default: from --config)"
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
        cfg = Config(**json.load(open(saved))["config"])
        changed = set(overrides) - {"iterations", "device", "eval_every", "save_every"}
        if changed:
            raise common.StageError(f"--resume keeps the run's configuration; cannot change --{', --'.join(sorted(changed))}")
    else:
        if os.path.isdir(run_dir) and os.listdir(run_dir):
            raise common.StageError(f"{run_dir} already holds a run; pass --resume to continue it or choose --run-dir")
        cfg = dataclasses.replace(CONFIGS[args.config])
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.task not in tasks.TASKS:
        raise common.StageError(f"--task {cfg.task!r}: expected one of {', '.join(tasks.TASKS)}")
    cfg.rewards = cfg.rewards or tasks.TASKS[cfg.task][1]
    return cfg, run_dir


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


def stage_args(script, parser, commands, **flags):
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


@contextmanager
def timed(perf, key):
    t = time.perf_counter()
    yield
    perf[key] = perf.get(key, 0.0) + time.perf_counter() - t


def sample_and_score(slot, cfg, it_dir, policy, tokenizer, ref_model, train, reward_fns, model_path, ref_path,
                     perf, commands):
    """Stages 1 and 2 in memory for the B records of `slot`: G completions each and their rewards."""
    records = iteration_records(train, slot, cfg.num_prompts, cfg.seed)
    prompts_path = os.path.join(it_dir, "prompts.jsonl")
    sargs = stage_args("sample.py", sample.parse_args, commands, model=model_path, prompts=prompts_path, out=it_dir,
                       group_size=cfg.group_size, num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + slot, ref_model=ref_path,
                       device=cfg.device)
    with timed(perf, "perf/sample_s"):
        rollouts, samples = sample.rollout(policy, tokenizer, records, sargs, ref_model, prompts_path=prompts_path)
        rollouts = {k: v.cpu() for k, v in rollouts.items()}
    rargs = stage_args("score.py", score.parse_args, commands, rollouts=os.path.join(it_dir, "rollouts.safetensors"),
                       samples=os.path.join(it_dir, "samples.jsonl"), reward=cfg.rewards,
                       overlong_buffer=cfg.overlong_buffer or None, max_new_tokens=cfg.max_new_tokens,
                       out=os.path.join(it_dir, "rewards.safetensors"), device=cfg.device)
    with timed(perf, "perf/score_s"):
        rewards, components = score.score(rollouts, samples, reward_fns, rargs.reward_weights)
        if cfg.overlong_buffer:
            rewards = score.add_overlong(rewards, components, rollouts["completion_mask"], cfg.max_new_tokens,
                                         cfg.overlong_buffer)
    return [records, rollouts, samples, rewards, components], sargs, rargs


def dapo_dynamic_sampling(i, cfg, perf, sample_round, pad_id):
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal give no gradient, so
    they are dropped and more prompts sampled, until B informative groups or --max-sample-rounds."""
    B, G = cfg.num_prompts, cfg.group_size
    kept, last = [], None
    for r in range(cfg.max_sample_rounds):
        last, sargs, rargs = sample_round(i * cfg.max_sample_rounds + r)
        informative = ~advantage.zero_spread(last[3].double().reshape(B, G))                  # [B]
        kept += [(last, b) for b in range(B) if informative[b]]
        perf["charts/sample_rounds"] = r + 1
        if len(kept) >= B:
            break
    perf["charts/informative_groups"] = min(len(kept), B)
    if not kept:                                              # nothing informative: train on the last round as is
        kept = [(last, b) for b in range(B)]
    kept = kept[:B]
    rows = [slice(b * G, (b + 1) * G) for _, b in kept]
    rollouts = sample.concat_rollouts([{k: v[idx] for k, v in part[1].items()} for (part, _), idx in zip(kept, rows)],
                                      pad_id)
    records = [part[0][b] for part, b in kept]
    samples = [dict(s, group=g) for g, ((part, _), idx) in enumerate(zip(kept, rows)) for s in part[2][idx]]
    rewards = torch.cat([part[3][idx] for (part, _), idx in zip(kept, rows)])
    components = {k: torch.cat([part[4][k][idx] for (part, _), idx in zip(kept, rows)]) for k in last[4]}
    return [records, rollouts, samples, rewards, components], sargs, rargs


def run_iteration(i, cfg, run_dir, policy, tokenizer, ref_model, optimizer, train, reward_fns, model_path, ref_path):
    """Stages 1→4 on the in-memory models, each stage's file written as its script would write it."""
    it_dir = os.path.join(run_dir, f"iter_{i:04d}")
    shutil.rmtree(it_dir, ignore_errors=True)                 # a partial iteration is redone from scratch
    os.makedirs(it_dir)
    perf, commands = {}, []

    def sample_round(slot):
        commands.clear()
        return sample_and_score(slot, cfg, it_dir, policy, tokenizer, ref_model, train, reward_fns, model_path,
                                ref_path, perf, commands)

    if cfg.dynamic_sampling:
        batch, sargs, rargs = dapo_dynamic_sampling(i, cfg, perf, sample_round, tokenizer.pad_token_id)
        sargs.dapo_dynamic_sampling = True                    # the file holds the informative groups of several rounds
    else:
        batch, sargs, rargs = sample_round(i)
    records, rollouts, samples, rewards, components = batch
    with timed(perf, "perf/io_s"):
        common.write_jsonl(os.path.join(it_dir, "prompts.jsonl"), records)
        sample.write_outputs(it_dir, rollouts, samples, sargs)
        score.write_rewards(rargs.out, rewards, rollouts["group_ids"], components, rargs)

    aargs = stage_args("advantage.py", advantage.parse_args, commands, rewards=rargs.out,
                       out=os.path.join(it_dir, "advantages.safetensors"), estimator=cfg.estimator, eps=cfg.eps)
    adv = advantage.compute(rewards, rollouts["group_ids"], aargs)
    with timed(perf, "perf/io_s"):
        common.save_tensors(aargs.out, adv, common.ADVANTAGES[0], vars(aargs))

    uargs = stage_args("update.py", update.parse_args, commands, model=model_path, rollouts=rargs.rollouts,
                       advantages=aargs.out, out=os.path.join(run_dir, "policy"), lr=cfg.lr, beta=cfg.beta,
                       clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip,
                       ratio_level=cfg.ratio_level, kl_estimator=cfg.kl_estimator, loss_agg=cfg.loss_agg,
                       epochs=cfg.epochs, minibatch_size=cfg.minibatch_size, micro_batch_size=cfg.micro_batch_size,
                       temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                       seed=cfg.seed * 1_000_003 + i, device=cfg.device)
    with timed(perf, "perf/update_s"):
        losses = update.update(policy, optimizer, rollouts, adv["advantages"], uargs, cfg.temperature,
                               cfg.max_new_tokens)

    lengths = rollouts["completion_mask"].sum(-1).float()
    metrics = {
        "iteration": i,
        "charts/reward_mean": rewards.mean().item(), "charts/reward_std": rewards.std().item(),
        **{f"charts/reward/{k}": v.mean().item() for k, v in components.items()},
        "charts/frac_zero_std": advantage.zero_spread(rewards.double().reshape(-1, cfg.group_size)).float().mean().item(),
        "charts/completion_len": lengths.mean().item(),
        "charts/truncated_frac": rollouts["truncated"].float().mean().item(),
        **{f"losses/{k}": v for k, v in losses.items()},
        **perf, "perf/tokens_per_s": lengths.sum().item() / perf["perf/sample_s"],
    }
    return it_dir, metrics, samples, rewards, uargs, commands


def write_replay(it_dir, i, commands):
    """replay.sh: this iteration's four stages as commands whose outputs go to $OUT, for comparison."""
    out = f"${{OUT:-replay/iter_{i:04d}}}"
    lines = [f"# Re-run iteration {i} one stage at a time; compare $OUT with {it_dir}.", "set -e"]
    for argv in commands:
        redirect = [a in ("--out", "--rollouts", "--samples", "--rewards", "--advantages") for a in [""] + argv[:-1]]
        argv = [(out if a == it_dir else f"{out}/{os.path.basename(a)}") if r else a for a, r in zip(argv, redirect)]
        lines.append(" ".join(f'"{a}"' if "$" in a else shlex.quote(a) for a in argv))
    with common.atomic_path(os.path.join(it_dir, "replay.sh")) as tmp:
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")


def save_policy(policy, tokenizer, optimizer, metrics, uargs, run_dir, iterations_done):
    update.save_update(policy, tokenizer, optimizer, metrics, uargs, os.path.join(run_dir, "policy"), extra_files={
        "train_state.json": lambda p: common.write_json(p, {"iteration": iterations_done, "metrics": metrics})})


@torch.inference_mode()
def evaluate(policy, tokenizer, held_out, reward_fns, cfg, run_dir, step):
    """Greedy completions of the held-out prompts; writes eval/iter_XXXX.jsonl, returns eval/ metrics."""
    device = next(policy.parameters()).device
    texts, token_lists = sample.render_prompts(held_out, tokenizer, "held-out prompts", None)
    prompt_ids, prompt_mask = sample.left_pad(token_lists, tokenizer.pad_token_id)
    ids, mask, _, _ = sample.sample_completions(
        policy, prompt_ids.to(device), prompt_mask.to(device), cfg.max_new_tokens, 0.0,
        common.eos_token_ids(tokenizer, policy), tokenizer.pad_token_id, generator=None)
    ids, mask = ids.cpu(), mask.cpu()
    rows = [{**record, "group": b, "prompt": texts[b],
             "completion": tokenizer.decode(ids[b][mask[b]], skip_special_tokens=True)} for b, record in enumerate(held_out)]
    batch = {"group_ids": torch.arange(len(rows)), "completion_ids": ids, "completion_mask": mask}
    rewards, _ = score.score(batch, rows, reward_fns, [1.0] * len(reward_fns))
    for row, r in zip(rows, rewards.tolist()):
        row["reward"] = r
    os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
    common.write_jsonl(os.path.join(run_dir, "eval", f"iter_{step:04d}.jsonl"), rows)
    return {"eval/reward_mean": rewards.mean().item(), "eval/completion_len": mask.sum(-1).float().mean().item(),
            "eval/num_prompts": len(rows)}


def restore(run_dir):
    """Iterations already done in run_dir (0 for a new run), repairing what a kill may have left."""
    policy_dir = os.path.join(run_dir, "policy")
    if not os.path.isdir(policy_dir) and os.path.isdir(policy_dir + ".old"):
        os.rename(policy_dir + ".old", policy_dir)            # killed inside common.replace_dir
    for stale in glob.glob(os.path.join(run_dir, "*.tmp*")) + glob.glob(os.path.join(run_dir, "checkpoints", "*.tmp*")):
        shutil.rmtree(stale, ignore_errors=True)              # half-written copies of a killed run
    state_file = os.path.join(policy_dir, "train_state.json")
    if not os.path.isfile(state_file):
        return 0
    state = json.load(open(state_file))
    done = state["iteration"]
    last = os.path.join(run_dir, f"iter_{done - 1:04d}", "metrics.json")
    if not os.path.isfile(last):                              # killed between saving the policy and metrics.json
        common.write_json(last, state["metrics"])
    return done


def log(writer, metrics, step):
    for k, v in metrics.items():
        if "/" in k and isinstance(v, (int, float)):
            writer.add_scalar(k, v, step)


def keep_checkpoint(run_dir, i):
    """Copy policy/ (the policy about to sample iteration i) to checkpoints/iter_XXXX; return its path."""
    keep = os.path.join(run_dir, "checkpoints", f"iter_{i:04d}")
    shutil.rmtree(keep + ".tmp", ignore_errors=True)
    shutil.copytree(os.path.join(run_dir, "policy"), keep + ".tmp")
    common.replace_dir(keep + ".tmp", keep)
    return keep


def main(argv=None):
    args, overrides = parse_args(argv)
    cfg, run_dir = resolve_config(args, overrides)
    os.makedirs(run_dir, exist_ok=True)
    common.write_json(os.path.join(run_dir, "config.json"), {"config": vars(cfg)})   # first: the run is resumable
    done = restore(run_dir) if args.resume else 0
    model_dir = base_model_dir(cfg, run_dir)
    ref_path = model_dir if cfg.beta != 0 else None
    policy_dir = os.path.join(run_dir, "policy")

    from torch.utils.tensorboard import SummaryWriter

    device = common.pick_device(cfg.device)
    tokenizer = common.load_tokenizer(policy_dir if done else model_dir)
    policy = common.load_model(policy_dir if done else model_dir, device)
    ref_model = common.load_model(model_dir, device) if cfg.beta != 0 else None
    optimizer = update.make_optimizer(policy, cfg.lr)
    if done:
        update.load_optimizer_state(policy, optimizer, os.path.join(policy_dir, "optimizer.safetensors"))
    train, held_out, _ = tasks.make_task(cfg.task, cfg.seed)
    held_out = held_out[:cfg.eval_prompts]
    reward_fns = [score.load_reward(spec, device, 0) for spec in cfg.rewards]
    writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=done)

    bar = tqdm(range(done, cfg.iterations), desc=f"GRPO {run_dir}", unit="iter", initial=done, total=cfg.iterations,
               disable=None)
    for i in bar:
        t0 = time.perf_counter()
        evaluation = {}
        if i == 0 or (cfg.eval_every and i % cfg.eval_every == 0):
            evaluation = evaluate(policy, tokenizer, held_out, reward_fns, cfg, run_dir, i)
        # The path the stage files record as --model: where the policy that samples iteration i lives.
        model_path = model_dir if i == 0 else policy_dir
        if i > 0 and cfg.save_every and i % cfg.save_every == 0:
            model_path = keep_checkpoint(run_dir, i)
        it_dir, metrics, samples, rewards, uargs, commands = run_iteration(
            i, cfg, run_dir, policy, tokenizer, ref_model, optimizer, train, reward_fns, model_path, ref_path)
        if model_path != policy_dir and not cfg.dynamic_sampling:   # the sampling policy is kept: replayable
            write_replay(it_dir, i, commands)
        metrics.update(evaluation)
        t = time.perf_counter()
        save_policy(policy, tokenizer, optimizer, metrics, uargs, run_dir, i + 1)
        metrics["perf/checkpoint_s"] = time.perf_counter() - t
        metrics["perf/iteration_s"] = time.perf_counter() - t0
        common.write_json(os.path.join(it_dir, "metrics.json"), metrics)

        log(writer, metrics, i)
        shown = [f"**reward {r:.3f}** · {s['prompt'][-60:]!r} → {s['completion']!r}"
                 for s, r in list(zip(samples, rewards.tolist()))[::cfg.group_size][:4]]
        writer.add_text("samples", "\n\n".join(shown), i)
        kl = metrics["losses/kl"] or 0.0
        bar.set_postfix(reward=f"{metrics['charts/reward_mean']:.3f}", kl=f"{kl:.4f}")
        tqdm.write(f"iter {i:4d}  reward {metrics['charts/reward_mean']:.3f}  frac_zero_std "
                   f"{metrics['charts/frac_zero_std']:.2f}  kl {kl:.4f}  len {metrics['charts/completion_len']:.1f}  "
                   f"{metrics['perf/iteration_s']:.1f}s" +
                   (f"  held-out {evaluation['eval/reward_mean']:.3f}" if evaluation else ""))

    final = evaluate(policy, tokenizer, held_out, reward_fns, cfg, run_dir, cfg.iterations)
    log(writer, final, cfg.iterations)
    writer.close()
    before = [json.loads(line)["reward"] for line in open(os.path.join(run_dir, "eval", "iter_0000.jsonl"))]
    print(f"held-out reward after {cfg.iterations} iterations: {final['eval/reward_mean']:.3f}, "
          f"before training {sum(before) / len(before):.3f} ({len(before)} prompts, greedy)")


if __name__ == "__main__":
    common.run_cli(main)
