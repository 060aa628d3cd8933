"""The run folder of train.py: its saves, the checkpoints kept for replay, and resuming.

    policy/                  what update.py writes, plus train_state.json (the resume point)
    checkpoints/iter_XXXX/   the policy that sampled iteration XXXX, as hard links into a save
    iter_XXXX/replay.sh      the iteration's four stages as commands, for re-running one alone

Under torchrun only rank 0 calls these, except save_policy, whose gathering of FSDP shards
every rank takes part in.
"""

import glob
import os
import shlex
import shutil

from tqdm import tqdm

import common
import update


def save_policy(models, optimizer, losses, uargs, run_dir, iterations_done, bad_steps, saver, buffers, keep=False):
    """policy/: what update.py would write, and train_state.json, the resume point. Written by
    `saver` in the background: the next iterations run while the 1.6 GB of the default model go to
    disk, and policy/ is replaced only once they are all there. With `keep`, the same background
    job then links it into checkpoints/ (the policy that samples the next iteration, for replay)."""
    update.save_update(models["policy"], models["tokenizer"], optimizer, losses, uargs, os.path.join(run_dir, "policy"),
                       extra_files={"train_state.json": lambda p: common.write_json(
                           p, {"iteration": iterations_done, "bad_steps": bad_steps})}, writer=saver, buffers=buffers,
                       then=(lambda: keep_checkpoint(run_dir, iterations_done)) if keep else None)


def restore(run_dir):
    """(iterations in the last save, bad steps so far) of run_dir, repairing what a kill may have left
    and removing the iterations after the save, which the resumed run recomputes."""
    policy_dir = os.path.join(run_dir, "policy")
    common.recover_dir(policy_dir)                            # killed inside common.replace_dir
    for stale in glob.glob(os.path.join(run_dir, "*.tmp*")) + glob.glob(os.path.join(run_dir, "checkpoints", "*.tmp*")):
        shutil.rmtree(stale, ignore_errors=True)              # half-written copies of a killed run
    state_file = os.path.join(policy_dir, "train_state.json")
    state = common.read_json(state_file) if os.path.isfile(state_file) else {"iteration": 0, "bad_steps": 0}
    for it_dir in glob.glob(os.path.join(run_dir, "iter_[0-9][0-9][0-9][0-9]")):
        if int(it_dir[-4:]) >= state["iteration"]:
            shutil.rmtree(it_dir)
    return state["iteration"], state["bad_steps"]


def is_save_point(n, save_every):
    """Whether policy/ is saved after n iterations by the --save-every rhythm (the last iteration
    saves as well); such a save, but for the last, is also kept as checkpoint_dir(run_dir, n)."""
    return bool(save_every) and n % save_every == 0


def checkpoint_dir(run_dir, i):
    return os.path.join(run_dir, "checkpoints", f"iter_{i:04d}")


def keep_checkpoint(run_dir, i):
    """checkpoint_dir(run_dir, i): policy/ (the policy about to sample iteration i) as hard links, which
    cost no space or time and survive policy/ being replaced; a copy where links are not possible."""
    keep = checkpoint_dir(run_dir, i)
    shutil.rmtree(keep + ".tmp", ignore_errors=True)

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(os.path.join(run_dir, "policy"), keep + ".tmp", copy_function=link)
    common.replace_dir(keep + ".tmp", keep)


def report(writer, bar, it_dir, i, metrics, batch, evaluation, G):
    """metrics.json (written last: the iteration is complete), TensorBoard, and the progress line."""
    common.write_json(os.path.join(it_dir, "metrics.json"), metrics)
    log(writer, metrics, i)
    shown = [f"**reward {r:.3f}** · {s['prompt'][-60:]!r} → {s['completion']!r}"
             for s, r in list(zip(batch["samples"], batch["rewards"].tolist()))[::G][:4]]
    writer.add_text("samples", "\n\n".join(shown), i)
    kl = metrics["losses/kl"] or 0.0
    bar.set_postfix(reward=f"{metrics['charts/reward_mean']:.3f}", kl=f"{kl:.4f}")
    tqdm.write(f"iter {i:4d}  reward {metrics['charts/reward_mean']:.3f}  frac_zero_std "
               f"{metrics['charts/frac_zero_std']:.2f}  kl {kl:.4f}  len {metrics['charts/completion_len']:.1f}  "
               f"{metrics['perf/iteration_s']:.1f}s" +
               (f"  held-out {evaluation['eval/reward_mean']:.3f}" if evaluation else ""))


def log(writer, metrics, step):
    for k, v in metrics.items():
        if "/" in k and isinstance(v, (int, float)):
            writer.add_scalar(k, v, step)


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
