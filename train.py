"""The GRPO loop: sample → score → advantage → update, K iterations in one process (or in each
process of torchrun).

    python train.py                  # SmolLM2-135M-Instruct on two-digit sums (about 4 min, 2 CPU cores)
    python train.py --config tiny    # a tiny Llama learning a toy task from scratch (seconds)
    python train.py --check          # sample the first batch, report its reward spread, write nothing
    python train.py --algo ppo       # the baseline: PPO with a critic and GAE, on the same stages
    python train.py --engine vllm    # vLLM draws the completions (after ./setup.sh --engine vllm)
    python train.py --config-file runs/tiny/config.json --seed 1 --run-dir runs/tiny_seed1
    python train.py --reward exact_answer --reward my_rewards.py:format_reward --reward-weights 1 0.2
    python train.py --run-dir runs/default --resume --iterations 30     # continue a run
    torchrun --nproc_per_node 8 train.py --config gpu [--fsdp]          # one node, 8 GPUs

A run's settings are the stages' own flags (names, types, help: `train.py --help` lists each with
the stages that take it) and the run's own (model, data, iterations, evaluation, saves), all in
grpo/loop/configs.py, with where a run's default differs from a stage's and why, and the named
configurations (--config). Models stay in memory between stages, but each stage's arguments are
built by its own parse_args from the flags configs.stage_settings gives it (so its checks apply
before the run folder exists), and its files are written by its own functions: any iteration can be
re-run one stage at a time (iter_XXXX/replay.sh; docs/runs-and-metrics.md).

Every draw of iteration i comes from generators seeded from (seed, i): the records it sees (a
seeded shuffle per pass over them), the sampler, the minibatch shuffle (configs.stage_settings). No RNG state crosses
iterations, so the policy and AdamW's state, saved every --save-every iterations, are all a resume
needs: --resume recomputes the iterations since the last save, bit for bit on a CPU. With
--dynamic-sampling, round r of iteration i uses the records and seed of slot i·R + r.
"""

import argparse
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass

from tqdm import tqdm

import advantage
import sample
import score
import update
from grpo import settings
from grpo.cli import StageError, run_cli, warn
from grpo.disk import checkpoints, files, outputs, provenance, run_log
from grpo.loop import configs, diagnostics, evaluation, runs, staleness
from grpo.loop.rollouts import dapo_dynamic_sampling
from grpo.models import distributed
from grpo.training import ppo_critic

EVAL_SLOT = 10 ** 9          # the sampler's seed of --eval-samples: a slot no iteration takes
STAGES = {"sample.py": sample, "score.py": score, "advantage.py": advantage, "update.py": update}
FLAGS = settings.stage_flags({script: stage.build_parser() for script, stage in STAGES.items()}, configs.OWNED)


# ----------------------------------------------------------------------------------------
# The loop: stages 1 → 4 on the models in memory, every stage's files written

@dataclass
class Run:
    """What the loop carries from one iteration to the next."""
    cfg: argparse.Namespace
    dir: str
    models: runs.Models
    optimizer: object                  # AdamW, continued across iterations (and resumes)
    reward_fns: list
    records: list                      # the training records
    held_out: evaluation.HeldOut
    writer: object                     # TensorBoard's, on the main process
    saver: checkpoints.BackgroundSaver
    saved_at: int                      # iterations of the last save (the resume point)
    bad_steps: int                     # skipped optimizer steps in the run so far
    previous: dict | None              # the last iteration's metrics
    producer: staleness.Producer = None   # --staleness K: the process that runs stages 1 to 3
    publisher: checkpoints.BackgroundSaver = None   # ... and what writes the versions it samples with


def train(cfg, run_dir, resume, records):
    """Iterations done .. cfg.iterations of the run in run_dir on the `records` of runs.run_records,
    with a held-out evaluation every --eval-every iterations and at the end, and a save (the resume
    point) every --save-every."""
    main = distributed.is_main()
    run = start_run(cfg, run_dir, resume, records)
    models, done = run.models, run.saved_at
    bar = tqdm(range(done, cfg.iterations), desc=f"GRPO {run_dir}", unit="iter", initial=done,
               total=cfg.iterations, disable=None if main else True)
    try:
        if cfg.staleness:     # the versions a resume samples with, and the producer from iteration `done`
            run.producer = staleness.start(run.dir, done, cfg.sample_threads, models.policy, models.tokenizer,
                                           run.publisher, staleness.run_producer,
                                           (produce, cfg, run_dir, done, run.records))
        for i in bar:
            it_dir, metrics, samples = iteration(run, i, resumed_here=i == done)
            if main:
                run_log.log_iteration(run.writer, bar, it_dir, i, metrics, samples, cfg.group_size)
            run.previous = metrics
    finally:
        if run.producer is not None:
            run.producer.stop()
        try:
            run.saver.wait()                  # no save is left half-written, whatever ended the loop
        finally:
            if run.publisher is not None:
                run.publisher.wait()
            if models.engine is not None:
                models.engine.close()
    if main and cfg.eval_every:
        final = run.held_out(models.sampler, models.ref, models.base, cfg.iterations)
        run_log.log_scalars(run.writer, final, cfg.iterations)
        print(f"held-out reward after {cfg.iterations} iterations: {final['eval/reward_mean'] or 0:.3f}, "
              f"reference {final['eval/ref_reward_mean'] or 0:.3f} ({final['eval/num_prompts']} prompts, "
              f"greedy, {final['eval/skipped_rewards']} without a reward)")
    if main:
        run.writer.close()


def start_run(cfg, run_dir, resume, records):
    """The run as it starts: the iterations done (0, or the last save's with --resume), config.json, the
    models and AdamW (runs.start), the held-out evaluation and TensorBoard's writer."""
    from torch.utils.tensorboard import SummaryWriter

    main = distributed.is_main()
    done, bad_steps = distributed.broadcast_ints(checkpoints.restore(run_dir, cfg.save_every or cfg.iterations)
                                                 if resume and main else (0, 0))
    if done > cfg.iterations:
        raise StageError(f"{run_dir} has saved {done} iterations, more than --iterations {cfg.iterations}")
    if resume and main:
        print(f"resuming {run_dir} from its last save, after {done} iterations; iterations {done}.."
              f"{cfg.iterations - 1} follow", flush=True)
    train_records, held_out, where = records
    held_out = held_out[:cfg.eval_prompts] if cfg.eval_every else []
    models, optimizer, reward_fns = runs.start(cfg, run_dir, done, [(train_records, *where["train"]), (
        held_out, *where["held_out"])], where["held_out_lines"])
    if resume and main:                         # only now: a resume that fails to start changes nothing
        checkpoints.drop_iterations(run_dir, done)
    weights = cfg.reward_weights or [1.0] * len(reward_fns)                 # as score.py weighs them
    held_out_eval = evaluation.HeldOut(
        held_out, models.tokenizer, max_new_tokens=cfg.max_new_tokens, run_dir=run_dir,
        score=lambda rows, rollouts: score.score(rollouts, rows, reward_fns, weights, cfg.on_reward_error),
        trust_remote_code=cfg.trust_remote_code, micro_batch_size=cfg.micro_batch_size,
        sample=eval_sampler(cfg, held_out, models) if cfg.eval_samples and held_out else None,
        episodes=eval_sampler(cfg, held_out, models, greedy=True) if cfg.env and held_out else None)
    previous = os.path.join(run_dir, f"iter_{done - 1:04d}", "metrics.json")
    return Run(cfg, run_dir, models, optimizer, reward_fns, train_records, held_out_eval,
               SummaryWriter(os.path.join(run_dir, "tb"), purge_step=done) if main else None,
               checkpoints.BackgroundSaver(), done, bad_steps,
               files.read_json(previous) if done and os.path.isfile(previous) else None,
               publisher=checkpoints.BackgroundSaver() if cfg.staleness else None)


def eval_sampler(cfg, held_out, models, greedy=False):
    """--eval-samples n: a function drawing n answers for each held-out record from a policy, by sample.py
    with the run's settings (τ, truncation, the engine in this process) and one seed for every evaluation;
    greedy: one answer each, the likeliest token at each step (top-k 1, τ 1: --env's episodes)."""
    eval_cfg = argparse.Namespace(**{**vars(cfg), "group_size": cfg.eval_samples, "num_prompts": len(held_out)})
    if greedy:
        eval_cfg.__dict__.update(group_size=1, top_k=1, top_p=1.0, min_p=0.0, temperature=1.0)
    args = stage_args("sample.py", eval_cfg, "eval", EVAL_SLOT, 0, {"model": "-", "ref_model": None, "critic": None},
                      [])
    return lambda policy, records: sample.rollout(policy, models.tokenizer, records, args,
                                                  where=("held-out prompts", None), engine=models.engine)


def iteration(run, i, resumed_here):
    """Iteration i: the held-out evaluation when due, stages 1 → 4 with every stage's files written in
    iter_XXXX/ (stages 1 to 3 by the producer process with --staleness), and the save when due;
    returns that folder, its metrics and samples."""
    cfg, models, main = run.cfg, run.models, distributed.is_main()
    t0, perf, commands, held_out_metrics = time.perf_counter(), {}, [], {}
    if main and cfg.eval_every and i % cfg.eval_every == 0:
        held_out_metrics = run.held_out(models.sampler, models.ref, models.base, i)
    policy_path = checkpoints.sampler_dir(run.dir, i, models.base, run.saved_at, cfg.save_every,
                                          link=main and resumed_here)      # resumed from a kept save
    kept = policy_path != os.path.join(run.dir, "policy")               # replay.sh can name it
    if cfg.staleness:                   # stages 1 to 3 ran in the producer, on version max(0, i − K)
        it_dir, batch, adv, perf, commands = staleness.receive(run.dir, i, cfg.staleness, models.base, run.producer)
        if kept:                        # the save's own link to the version that sampled
            commands = staleness.kept_commands(commands, run.dir, policy_path)
        else:
            policy_path = staleness.sampler_path(run.dir, i, models.base)
    else:
        it_dir = checkpoints.iteration_dir(run.dir, i, create=main)
        batch, adv = produce(cfg, i, it_dir, models, runs.model_paths(models, policy_path, i), run.records,
                             run.reward_fns, perf, commands)
    rollouts = batch["rollouts"]
    lengths = rollouts["completion_mask"].sum(-1)                                       # [N]
    # Stage 4: the clipped policy update.
    update_args = stage_args("update.py", cfg, it_dir, i, i, runs.model_paths(models, policy_path, i), commands)
    losses = update_policy(run, rollouts, adv, update_args, perf)
    if cfg.staleness:                   # the version the producer samples iteration i + 1 + K with
        staleness.publish(models.policy, models.tokenizer, run.dir, i + 1, run.publisher)
        staleness.prune(run.dir, i + 1 - cfg.staleness)
    if main and kept and not cfg.dynamic_sampling:
        run_log.write_replay(it_dir, i, commands, cfg.staleness and staleness.threads_note(run.producer))
    metrics = iteration_metrics(run, i, batch, lengths, losses, perf, held_out_metrics)
    with runs.timed(metrics, "perf/checkpoint_s"):
        if checkpoints.is_save_point(i + 1, cfg.save_every) or i + 1 == cfg.iterations:
            keep = checkpoints.is_save_point(i + 1, cfg.save_every) and i + 1 < cfg.iterations
            links = staleness.kept_for_resume(run.dir, i + 1, cfg.staleness) if cfg.staleness else {}
            checkpoints.save_resume_point(models.policy, models.tokenizer, run.optimizer, losses, update_args,
                                          run.dir, i + 1, run.bad_steps, run.saver, keep, models.critic, links)
            run.saved_at = i + 1
    metrics["perf/iteration_s"] = time.perf_counter() - t0
    return it_dir, metrics, batch["samples"]


def produce(cfg, i, it_dir, models, paths, records, reward_fns, perf, commands):
    """Stages 1 to 3 of iteration i and their files: G completions for each of B prompts, their rewards,
    their group-relative advantages. Returns the batch and the advantages."""
    def sample_round(slot):
        commands.clear()
        return sample_and_score(slot, i, cfg, it_dir, models, paths, records, reward_fns, perf, commands)

    if cfg.dynamic_sampling:
        R = cfg.max_sample_rounds
        batch, sample_args, score_args = dapo_dynamic_sampling(
            sample_round, i * R, R, cfg.num_prompts, cfg.group_size, models.tokenizer.pad_token_id, perf)
        sample_args.dapo_dynamic_sampling = True      # the file holds groups of several rounds
    else:
        batch, sample_args, score_args = sample_round(i)
    rollouts, rewards, skipped = batch["rollouts"], batch["rewards"], batch["skipped"]
    lengths = rollouts["completion_mask"].sum(-1)                                       # [N]
    # Stage 3: group-relative advantages.
    advantage_args = stage_args("advantage.py", cfg, it_dir, i, i, paths, commands)
    adv = advantage.compute_advantages(rewards, rollouts["group_ids"], advantage_args, lengths, rollouts, skipped)
    batch["samples"] = runs.with_outputs(batch["samples"], rewards, batch["components"], skipped, adv["advantages"],
                                         rollouts.get("loss_mask", rollouts["completion_mask"]))
    if cfg.staleness:                   # the behaviour policy's log-probs, which the update weighs against
        rollouts.setdefault("sampler_logprobs", rollouts["old_logprobs"].clone())
    with runs.timed(perf, "perf/io_s"):
        if distributed.is_main():
            write_stage_files(it_dir, batch, lengths, adv, sample_args, score_args, advantage_args, models,
                              staleness.sampled_by(i, cfg.staleness))
    return batch, adv


def update_policy(run, rollouts, adv, update_args, perf):
    """Stage 4 on the models in memory: the policy's steps (unless --critic-warmup holds it), the
    critic's, and the sampling copies (FSDP's full copy, vLLM's engine) given the new weights."""
    models = run.models
    with runs.timed(perf, "perf/checkpoint_s"):
        for saver in (run.saver, run.publisher):
            if saver is not None:
                saver.wait()                          # a save in flight reads the weights it changes
    with runs.timed(perf, "perf/update_s"):
        losses = {} if update_args.critic_only else update.train_policy(
            models.policy, run.optimizer, rollouts, adv["advantages"], update_args,
            models.ref if update_args.ref_logprobs != "rollouts" else None)
        if models.critic:
            losses.update(ppo_critic.train_critic(models.critic, rollouts, adv["returns"], update_args))
        if models.sampler is not models.policy:   # FSDP: the full copy that samples follows
            models.sampler.load_state_dict(checkpoints.checkpoint_tensors(models.policy), strict=False)
    if models.engine is not None and not update_args.critic_only:   # vLLM: the new weights, in place
        with runs.timed(perf, "perf/engine_sync_s"):
            models.engine.load_weights(models.sampler)
    return losses


def write_stage_files(it_dir, batch, lengths, adv, sample_args, score_args, advantage_args, models, version):
    """Each stage's files of the iteration, by the stage's own writer; each file's made_from names the
    one before it (grpo/disk/provenance.py), the rollouts the policy version that sampled them."""
    rollouts, samples = batch["rollouts"], batch["samples"]
    files.write_jsonl(os.path.join(it_dir, "prompts.jsonl"), batch["records"])
    sample.write_outputs(it_dir, rollouts, samples, sample_args, provenance.fingerprint(models.sampler),
                         models.tokenizer_fingerprint, policy_version=version)
    made_from = provenance.rewards_made_from(score_args.rollouts, samples)
    score.write_rewards(score_args.out, batch["rewards"], rollouts["group_ids"], batch["components"], score_args,
                        lengths, batch["skipped"], made_from)
    made_from = provenance.advantages_made_from(score_args.out, made_from["rollouts"])
    files.save_tensors(advantage_args.out, adv, files.ADVANTAGES[0], vars(advantage_args), made_from=made_from)


def iteration_metrics(run, i, batch, lengths, losses, perf, held_out_metrics):
    """metrics.json of iteration i (docs/runs-and-metrics.md), with the warnings they call for; a run
    past --max-bad-steps skipped steps stops here, before its save."""
    cfg, rollouts, rewards, skipped = run.cfg, batch["rollouts"], batch["rewards"], batch["skipped"]
    completions = [s["completion"] for s in batch["samples"]]
    metrics = {"iteration": i, **diagnostics.iteration_metrics(
        rollouts, rewards, batch["components"], skipped, completions, cfg.group_size),
        **diagnostics.update_metrics(losses), **diagnostics.episode_metrics(batch["samples"], batch["records"]), **perf,
        "perf/tokens_per_s": lengths.sum().item() / perf["perf/sample_s"]}
    if distributed.is_main() and i == 0 and cfg.algo == "grpo":
        spread = diagnostics.reward_spread(rewards, cfg.group_size, skipped)
        tqdm.write("\n".join(diagnostics.spread_report(spread, cfg.group_size, cfg.estimator)))
    flags = diagnostics.collapse_flags(metrics, run.previous)
    metrics.update(flags, **held_out_metrics)
    if flags["diversity/collapse"]:
        warn(diagnostics.collapse_warning(flags, i))
    run.bad_steps += losses.get("skipped_steps", 0) + losses.get("critic_skipped_steps", 0)
    metrics["diag/bad_steps_total"] = run.bad_steps
    if run.bad_steps > cfg.max_bad_steps:
        raise StageError(f"{run.bad_steps} optimizer steps in this run had a non-finite loss or gradient, more "
                         f"than --max-bad-steps {cfg.max_bad_steps}; stopped, {os.path.join(run.dir, 'policy')} "
                         f"holds the last good save ({run.saved_at} iterations)")
    return metrics


def sample_and_score(slot, i, cfg, it_dir, models, paths, records, reward_fns, perf, commands):
    """Stages 1 and 2 in memory for the B records of `slot`: G completions each and their rewards."""
    sample_args = stage_args("sample.py", cfg, it_dir, slot, i, paths, commands)
    score_args = stage_args("score.py", cfg, it_dir, slot, i, paths, commands)
    records = runs.iteration_records(records, slot, cfg.num_prompts, cfg.seed)
    with runs.timed(perf, "perf/sample_s"):
        critic = distributed.unwrap(models.critic.model) if models.critic else None
        ref = models.ref if sample_args.ref_model else None
        rollouts, samples = sample.rollout_sharded(models.sampler, models.tokenizer, records, sample_args,
                                                   ref, (sample_args.prompts, None), critic, models.engine)
        rollouts = {k: v.cpu() for k, v in rollouts.items()}
    with runs.timed(perf, "perf/score_s"):
        rewards, components, skipped = score.score_sharded(
            rollouts, samples, reward_fns, score_args.reward_weights, score_args.on_reward_error)
        rewards = score.length_shaping(rewards, components, rollouts["completion_mask"].sum(-1), score_args)
    batch = {"records": records, "rollouts": rollouts, "samples": samples, "rewards": rewards,
             "components": components, "skipped": skipped}
    return batch, sample_args, score_args


# ----------------------------------------------------------------------------------------
# Each stage's arguments, by its own parser

def stage_args(script, cfg, it_dir, slot, i, paths, commands):
    """A stage's namespace for iteration i, built by the stage's own parse_args (its defaults and
    checks) from the flags grpo/loop/configs.py:stage_settings gives it: the run's settings, the files
    of `it_dir` and the models of `paths`; the equivalent command is appended to `commands`."""
    argv = settings.argv(STAGES[script].build_parser(), configs.stage_settings(script, cfg, it_dir, slot, i, paths))
    commands.append(["python", script, *argv])
    return STAGES[script].parse_args(argv)


# ----------------------------------------------------------------------------------------
# The command line

def parse_args(argv=None):
    """The run's configuration (grpo/loop/configs.py:parse), checked by every stage's own parse_args
    before anything is written."""
    args, cfg, run_dir = configs.parse(argv, __doc__.split("\n\n")[0], FLAGS)
    paths = {"model": "model", "ref_model": "ref", "critic": "critic" if cfg.algo == "ppo" else None}
    for script in STAGES:                             # each stage checks its flags before anything is written
        stage_args(script, cfg, "it", 0, 0, paths, [])
    return args, cfg, run_dir


def check_batch(cfg, records):
    """--check: sample and score the first batch in a folder removed afterwards; print its spread."""
    train_records, _, where = records
    with tempfile.TemporaryDirectory() as scratch:
        models, _, reward_fns = runs.start(cfg, scratch, 0, [(train_records, *where["train"])])
        paths = runs.model_paths(models, models.base, 0)
        batch, _, _ = sample_and_score(0, 0, cfg, os.path.join(scratch, "iter_0000"), models, paths,
                                       train_records, reward_fns, {}, [])
        if models.engine is not None:
            models.engine.close()
    if distributed.is_main():
        completions = [s["completion"] for s in batch["samples"]]
        print("\n".join(diagnostics.batch_report(batch["rollouts"], batch["rewards"], completions,
                                                 cfg.group_size)))


def main(argv=None):
    args, cfg, run_dir = parse_args(argv)
    distributed.init_distributed(cfg.device)                  # under torchrun; rank 0 writes and logs
    distributed.barrier()                                 # every rank has checked run_dir before it exists
    records = runs.run_records(cfg.task, cfg.seed, cfg.prompts, cfg.eval_prompts_file,
                                cfg.eval_prompts if cfg.eval_every else 0)
    if args.check:
        return check_batch(cfg, records)
    for warning in diagnostics.penalty_warnings(cfg.beta, cfg.kl_estimator, cfg.kl_in_reward):
        warn(warning)
    if records[2]["held_out_lines"] and not args.resume:
        warn(f"held out {len(records[1])} records of {cfg.prompts} for evaluation, chosen with --seed "
             f"{cfg.seed} (their lines are in config.json); training on the other {len(records[0])}")
    made = not os.path.exists(run_dir)
    with outputs.run_lock(run_dir, args.resume) if distributed.is_main() else contextlib.nullcontext():
        try:
            train(cfg, run_dir, args.resume, records)
        except Exception:
            if not args.resume and distributed.is_main() and not checkpoints.has_save(run_dir):
                outputs.remove_written(run_dir, made)       # nothing to resume: the corrected command runs
            raise


if __name__ == "__main__":
    run_cli(main)
