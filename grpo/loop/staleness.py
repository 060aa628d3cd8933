"""train.py --staleness K: the producer process (sample → score → advantage) beside the consumer (the
update), over the run folder, on a fixed schedule.

Iteration k is sampled by the policy of version max(0, k − K), the policy after that many updates.
The consumer publishes version v after its v-th update, and the producer waits for it; the producer
marks iteration k complete, and the consumer waits for that. Nothing else crosses between the two: the
stage files are the channel, so the schedule, and with it every number, does not depend on timing.

    published/policy_XXXX/   version XXXX (a checkpoint; LoRA: its adapters), written whole
    iter_XXXX/produced.json  the producer's mark, written last: the version that sampled, its timings
    policy/published/        a save's own links to the K versions before it, which a resume samples from

A resume point after s updates needs versions s − K .. s − 1 to sample iterations s .. s + K − 1
again; each save holds hard links to them (no copy), so published/ keeps only what the producer can
still ask for, K + 1 versions (plus version 0, the base model, which is never written).
"""

import glob
import json
import multiprocessing
import os
import shutil
import sys
import time

import torch
from safetensors import safe_open

from grpo import lora
from grpo.cli import StageError
from grpo.disk import checkpoints, files, provenance
from grpo.loop import runs
from grpo.models import builders, distributed, loading, vllm_engine

POLL_S = 0.02          # how often a waiting process looks for the file it waits for


def run_producer(produce, cfg, run_dir, done, records, parent_pid, threads):
    """The producer process: `produce` (train.py's stages 1 to 3 of an iteration and their files) for
    iterations done .., iteration i sampled by the policy of version max(0, i − K) once the consumer has
    published it; each iteration marked produced when its files are whole."""
    set_threads(threads)
    alive = parent_alive(parent_pid)
    models, reward_fns, loaded, engine = None, None, None, None
    try:
        for i in range(done, cfg.iterations):
            alive()                     # a producer whose update process is gone writes nothing more
            version, perf, commands = sampled_by(i, cfg.staleness), {}, []
            if version != loaded:
                base = builders.base_model_dir(cfg.model, run_dir, cfg.seed)
                path = sampler_path(run_dir, version, base)
                wait_for(path, alive)
                with runs.timed(perf, "perf/load_s"):
                    models, reward_fns, engine = producer_models(cfg, base, path, reward_fns, engine)
                loaded = version
            it_dir = checkpoints.iteration_dir(run_dir, i, create=True)
            produce(cfg, i, it_dir, models, runs.model_paths(models, path, i), records, reward_fns, perf, commands)
            mark_produced(it_dir, version, perf, commands)
    finally:
        if engine is not None:
            engine.close()


def producer_models(cfg, base, path, reward_fns=None, engine=None):
    """What the producer holds to sample with version `path`: the policy (LoRA: base and adapters),
    π_ref where the rollouts carry its log-probs, the tokenizer, the reward functions (loaded once)
    and with --engine vllm the one engine, given this version's weights. Returns (models, reward
    functions, engine)."""
    device = distributed.pick_device(cfg.sample_device or cfg.device)
    reward_fns = runs.load_rewards(cfg, device) if reward_fns is None else reward_fns
    policy = lora.load_policy(path, device, cfg)
    ref = None
    if cfg.ref_logprobs == "rollouts" and cfg.beta != 0:
        ref = lora.load_reference(base, policy, device, cfg.trust_remote_code)
    models = runs.Models(base, loading.load_tokenizer(path, cfg.trust_remote_code), policy, policy, ref)
    models.tokenizer_fingerprint = provenance.tokenizer_fingerprint(models.tokenizer)
    if cfg.engine == "vllm" and engine is None:
        engine = vllm_engine.start(policy, loading.model_dir(base), cfg.max_new_tokens, cfg.num_prompts * cfg.group_size)
    elif cfg.engine == "vllm":
        engine.load_weights(policy)
    models.engine = engine
    return models, reward_fns, engine


def sampled_by(i, staleness):
    """The version of the policy that samples iteration i: max(0, i − K)."""
    return max(0, i - staleness)


def version_dir(run_dir, version):
    return os.path.join(run_dir, "published", f"policy_{version:04d}")


def sampler_path(run_dir, version, base):
    """The folder of version `version`: the base model for 0."""
    return base if version == 0 else version_dir(run_dir, version)


def publish(model, tokenizer, run_dir, version, saver):
    """Write version `version` of the policy, in `saver`'s thread (the caller waits before the next
    step changes the weights); a folder appears whole or not at all."""
    model = distributed.unwrap(model)
    weights = None if loading.is_lora(model) else checkpoints.checkpoint_tensors(model)
    saver.submit(lambda: checkpoints.save_checkpoint(model, tokenizer, version_dir(run_dir, version),
                                                     weights=weights))


def prune(run_dir, oldest):
    """Remove the published versions before `oldest` (a save keeps its own links to the ones it needs)."""
    for path in glob.glob(os.path.join(run_dir, "published", "policy_[0-9][0-9][0-9][0-9]")):
        if int(path[-4:]) < oldest:         # renamed first: a kill mid-way leaves no half version
            old = files.scratch_name(path, "old")
            os.rename(path, old)
            shutil.rmtree(old)


def kept_for_resume(run_dir, done, staleness):
    """The extra files of the save after `done` updates: links to versions done − K .. done − 1."""
    def link_versions(path):
        os.makedirs(path)
        for v in range(max(1, done - staleness), done):
            checkpoints.link_tree(version_dir(run_dir, v), os.path.join(path, f"policy_{v:04d}"))
    return {"published": link_versions}


def restore(run_dir, done):
    """The published versions a run resumed after `done` updates samples from: those the save links
    put back, those made after the save removed (they are made again, the same), scratch folders of a
    killed writer removed."""
    published = os.path.join(run_dir, "published")
    os.makedirs(published, exist_ok=True)
    for path in glob.glob(os.path.join(published, ".*.grpo-*")):
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(os.path.join(published, "policy_[0-9][0-9][0-9][0-9]")):
        files.recover_dir(path)
        if int(path[-4:]) >= done:
            shutil.rmtree(path)
    for path in sorted(glob.glob(os.path.join(run_dir, "policy", "published", "policy_[0-9][0-9][0-9][0-9]"))):
        checkpoints.link_tree(path, os.path.join(published, os.path.basename(path)))    # whole, from the save


def start(run_dir, done, sample_threads, policy, tokenizer, publisher, target, args):
    """The update's side at the start of a run: the versions a resumed run samples from put back, version
    `done` published, and the producer `target(*args, parent PID, threads)` started with its threads."""
    restore(run_dir, done)
    if done:
        publish(policy, tokenizer, run_dir, done, publisher)
    before = torch.get_num_threads()          # what the producer's stop() gives this process back
    threads = split_threads(sample_threads)
    return Producer(target, (*args, os.getpid(), threads), threads, before)


def receive(run_dir, i, staleness, base, producer):
    """Iteration i as the producer wrote it, once its mark is there, checked to be this run's version
    max(0, i − K): its folder, batch, advantages, timings (with the wait and the staleness) and stage
    commands."""
    it_dir = checkpoints.iteration_dir(run_dir, i, create=False)
    wait_s = wait_for(os.path.join(it_dir, "produced.json"), producer.check)
    batch, adv, meta = read_iteration(it_dir)
    version = sampled_by(i, staleness)
    check_version(os.path.join(it_dir, "rollouts.safetensors"), meta, i, staleness,
                  sampler_path(run_dir, version, base))
    produced = files.read_json(os.path.join(it_dir, "produced.json"))
    perf = {**produced["perf"], "perf/wait_s": wait_s, "charts/staleness": i - version}
    return it_dir, batch, adv, perf, produced["commands"]


def mark_produced(it_dir, version, perf, commands):
    """The producer's last write of an iteration: the version that sampled it, its timings, its commands."""
    files.write_json(os.path.join(it_dir, "produced.json"),
                     {"policy_version": version, "perf": perf, "commands": commands})


def read_iteration(it_dir):
    """What the producer wrote of an iteration, as the synchronous loop holds it in memory: the batch
    (records, rollouts, samples, rewards, each reward function's, the skipped rows), the advantages
    file's tensors, and the rollouts' metadata."""
    rollouts, _, _ = files.load_tensors(os.path.join(it_dir, "rollouts.safetensors"), files.ROLLOUTS)
    with safe_open(os.path.join(it_dir, "rollouts.safetensors"), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items() if k != "schema"}
    path = os.path.join(it_dir, "rewards.safetensors")
    rewards, _, _ = files.load_tensors(path, files.REWARDS)
    components = files.reward_components(path)
    adv, _, _ = files.load_tensors(os.path.join(it_dir, "advantages.safetensors"), files.ADVANTAGES)
    batch = {"records": files.read_jsonl(os.path.join(it_dir, "prompts.jsonl")), "rollouts": rollouts,
             "samples": files.read_jsonl(os.path.join(it_dir, "samples.jsonl")), "rewards": rewards["rewards"],
             "components": components,
             "skipped": rewards.get("skipped", torch.zeros_like(rewards["rewards"], dtype=torch.bool))}
    return batch, adv, meta


def wait_for(path, alive):
    """Block until `path` exists; `alive()` is called between looks and raises if the other side has
    ended (unless it wrote `path` first). Returns the seconds waited."""
    t0 = time.perf_counter()
    while not os.path.exists(path):
        try:
            alive()
        except (StageError, SystemExit):
            if not os.path.exists(path):
                raise
        time.sleep(POLL_S)
    return time.perf_counter() - t0


def kept_commands(commands, run_dir, kept_dir):
    """The stage commands of an iteration whose policy is kept (checkpoints/iter_XXXX), the version that
    sampled it named by the save's own link (kept_for_resume), which outlives published/."""
    published = os.path.join(run_dir, "published")
    return [[os.path.join(kept_dir, "published", os.path.basename(a)) if os.path.dirname(a) == published else a
             for a in argv] for argv in commands]


def check_version(path, rollouts_meta, i, staleness, expected_model):
    """Iteration i's rollouts were sampled by this run's version max(0, i − K): else one line, and nothing
    is trained on them."""
    version, model = rollouts_meta.get("policy_version"), rollouts_meta.get("args", {}).get("model")
    want = sampled_by(i, staleness)
    if version != want or os.path.realpath(str(model)) != os.path.realpath(expected_model):
        raise StageError(f"{path}: sampled by policy version {version} ({model}); iteration {i} with --staleness "
                         f"{staleness} trains only on rollouts of this run's version {want} ({expected_model})")


def split_threads(sample_threads):
    """The CPU threads of the two processes: the producer's (`sample_threads`, 0: half), and this
    process keeps the rest (at least one each). Returns the producer's."""
    total = torch.get_num_threads()
    sample_threads = sample_threads or max(1, total // 2)
    torch.set_num_threads(max(1, total - sample_threads))
    return sample_threads


def set_threads(threads):
    torch.set_num_threads(threads)


def threads_note(producer):
    """replay.sh's note of the CPU threads each side ran on, which a CPU's rounding depends on."""
    def threads(n):
        return f"{n} thread{'s' if n != 1 else ''}"
    return (f"on a CPU, sample/score/advantage ran on {threads(producer.threads)} and the update on "
            f"{threads(torch.get_num_threads())}: the same counts (torch.set_num_threads) give the same bits")


class Producer:
    """The producer process: `target(*args)` in a fresh interpreter (spawn: no torch state forked),
    which dies with this process (Linux's parent-death signal) so that a killed run leaves no writer."""

    def __init__(self, target, args, threads, threads_before):
        self.threads, self.threads_before = threads, threads_before
        self.process = multiprocessing.get_context("spawn").Process(
            target=_with_parent_death, args=(target, args), name="grpo-producer", daemon=True)
        self.process.start()

    def check(self):
        """Raise, in one line, if the producer has ended (its own error is on stderr above)."""
        if not self.process.is_alive():
            raise StageError(f"the producer process (sample → score → advantage) ended with exit code "
                             f"{self.process.exitcode}; the run stops at its last save (--resume continues both)")

    def stop(self):
        """End the producer (if it still runs) and give this process its threads back: a caller that
        runs train.py's main in-process (the tests, experiments/claims.py) keeps its own count."""
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        torch.set_num_threads(self.threads_before)


def _with_parent_death(target, args):
    """The producer's process: killed with its parent (Linux), a user's error said in one line as
    run_cli says it (exit code 2), Ctrl-C left to the update's process to report."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    if os.getppid() != multiprocessing.parent_process().pid:            # orphaned before the line above
        sys.exit(1)
    try:
        target(*args)
    except (StageError, OSError) as e:
        if isinstance(e, OSError):
            e = f"{e.filename}: {e.strerror or e}" if e.filename else (e.strerror or str(e))
        print(f"train.py: error (the producer process): {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def parent_alive(parent_pid):
    """A check for the producer's waits: raise SystemExit once the consumer that started it is gone
    (where the parent-death signal does not exist)."""
    def alive():
        if os.getppid() != parent_pid:
            raise SystemExit(1)
    return alive

