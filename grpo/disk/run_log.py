"""What a training run writes as it goes, beside its checkpoints: each iteration's metrics.json,
TensorBoard's scalars and sample text, the progress line, and replay.sh (the iteration's four stage
commands)."""

import os
import shlex

from tqdm import tqdm

from grpo.disk import files


def write_replay(it_dir, i, commands, note=None):
    """replay.sh: this iteration's four stages as commands whose outputs go to $OUT, for comparison."""
    out = f'"${{OUT:-replay/iter_{i:04d}}}"'              # the one part the shell expands
    lines = [f"# Re-run iteration {i} one stage at a time; compare $OUT with {shlex.quote(it_dir)}.",
             *([f"# {note}"] if note else []), "set -e"]
    file_flags = ("--out", "--rollouts", "--samples", "--rewards", "--advantages", "--critic-out")
    for argv in commands:
        redirect = [flag in file_flags for flag in [""] + argv[:-1]]         # the value follows its flag
        lines.append(" ".join((out if a == it_dir else out + shlex.quote("/" + os.path.basename(a))) if r
                              else shlex.quote(a) for a, r in zip(argv, redirect)))
    with files.atomic_path(os.path.join(it_dir, "replay.sh")) as tmp:
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")


def log_iteration(writer, bar, it_dir, i, metrics, samples, group_size):
    """iter_XXXX/metrics.json (written last: the iteration is complete), TensorBoard (every namespaced
    number, and up to four groups' completions with their rewards as text) and the progress line."""
    files.write_json(os.path.join(it_dir, "metrics.json"), metrics)
    log_scalars(writer, metrics, i)
    writer.add_text("samples", samples_text(samples, group_size), i)
    reward, kl = metrics["charts/reward_mean"], metrics.get("losses/kl") or 0.0    # none in a critic warm-up
    bar.set_postfix(reward=f"{reward:.3f}", kl=f"{kl:.3g}")          # a LoRA run's KL is ~1e-5
    held_out = f"  held-out {metrics['eval/reward_mean'] or 0:.3f}" if "eval/reward_mean" in metrics else ""
    tqdm.write(f"iter {i:4d}  reward {reward:.3f}  frac_zero_std {metrics['charts/frac_zero_std']:.2f}  "
               f"kl {kl:.3g}  len {metrics['charts/completion_len']:.1f}  "
               f"{metrics['perf/iteration_s']:.1f}s{held_out}")


def samples_text(samples, group_size, groups=4):
    """TensorBoard's text for the first `groups` groups of samples.jsonl's rows (with their rewards):
    what the user asked (the last user turn of a chat, not the template around it) and each
    completion with its reward."""
    blocks = []
    for row in samples[::group_size][:groups]:
        turns = [m["content"] for m in row.get("messages") or [] if m.get("role") == "user"]
        asked = turns[-1] if turns else row["prompt"][-300:]
        rewards = {id(s): "skipped" if s["reward"] is None else format(s["reward"], ".3f") for s in samples}
        lines = [f"**{asked!r}**"] + [f"- reward {rewards[id(s)]}: {s['completion']!r}"
                                      for s in samples if s["group"] == row["group"]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def log_scalars(writer, metrics, step):
    for k, v in metrics.items():
        if "/" in k and isinstance(v, (int, float)):
            writer.add_scalar(k, v, step)
