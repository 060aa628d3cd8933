"""Checkpoints, AdamW's state as safetensors, and train.py's resume points (save, restore, keep).

    policy/                  update.py's output, plus train_state.json (the resume point)
    policy/critic/           PPO's critic and its AdamW state (--algo ppo), saved with the policy
    critic_init/             PPO's critic before the first step
    checkpoints/iter_XXXX/   the policy that sampled iteration XXXX, as hard links into a save

(iter_XXXX/metrics.json, replay.sh and tb/ are grpo/disk/run_log.py's.)

A checkpoint folder is written beside its place and swapped in whole (files.replace_dir), so a
kill leaves the old checkpoint or the new one. Under torchrun every rank calls save_policy (FSDP
shards are gathered collectively) and rank 0 writes; the run-folder functions are rank 0's.
"""

import glob
import os
import shutil
import threading

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from grpo.cli import StageError
from grpo.disk import files, outputs
from grpo.models import distributed, loading
from grpo.models.loading import quiet_transformers


def checkpoint_tensors(model):
    """The model's state dict for model.safetensors, without the tied copies (lm_head.weight when the
    embeddings are tied), which from_pretrained restores from the config, as save_pretrained does."""
    model = distributed.unwrap(model)
    unique = {name for name, _ in model.named_parameters()}                      # tied copies left out
    shared = {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique
    # FSDP2 shards are gathered here, in the same order on every rank (each gather is a collective).
    return {name: distributed.full_tensor(t) for name, t in model.state_dict().items() if name not in shared}


def save_checkpoint(model, tokenizer, out_dir, extra_files=None, weights=None, command=None):
    """Write a Hugging Face checkpoint to `out_dir` (replacing it) through a temporary folder.

    `weights` (default: the model's own tensors, see checkpoint_tensors) become model.safetensors;
    a LoRA policy is written as peft writes it, its adapters alone (adapter_config.json naming the
    base, adapter_model.safetensors). `extra_files` maps file names to callables that write them into
    the temporary folder. With `command`, the folder carries that command's marker (grpo/disk/outputs.py),
    so that the command may replace it again. A full disk or a read-only folder is a one-line error
    and leaves `out_dir` as it was.
    """
    quiet_transformers()
    out_dir = os.path.realpath(out_dir)                  # a symlink's folder is written, the link kept
    tmp = files.scratch_name(out_dir, "tmp")
    adapters = loading.is_lora(model)
    weights = checkpoint_tensors(model) if weights is None and not adapters else weights
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if adapters:
            model.save_pretrained(tmp)                                   # peft's adapter files
            os.remove(os.path.join(tmp, "README.md"))                    # and an empty model card
        else:
            model.config.architectures = [type(model).__name__]          # as save_pretrained records it
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            save_file({k: t.detach().cpu().contiguous() for k, t in weights.items()},
                      os.path.join(tmp, "model.safetensors"), {"format": "pt"})
        tokenizer.save_pretrained(tmp)
        for name, write in (extra_files or {}).items():
            write(os.path.join(tmp, name))
        if command:
            outputs.mark_dir(tmp, command, os.listdir(tmp))
        for name in os.listdir(tmp):
            if os.path.isdir(os.path.join(tmp, name)):          # a checkpoint inside, synced by its writer
                continue
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        files.replace_dir(tmp, out_dir)
    except (OSError, SafetensorError) as e:
        kept = "it still holds the last complete one" if os.path.isdir(out_dir) else "nothing was written"
        raise StageError(f"{out_dir}: cannot write the checkpoint ({getattr(e, 'strerror', None) or e}); "
                         f"{kept}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# update.py's output: checkpoint, optimizer state and metrics as one folder

def optimizer_state_tensors(policy, optimizer):
    """AdamW's per-parameter state keyed 'param_name/exp_avg' etc., for a safetensors file (no pickle)."""
    names = {p: n for n, p in distributed.unwrap(policy).named_parameters()}
    return {f"{names[p]}/{k}": distributed.full_tensor(v if torch.is_tensor(v) else torch.tensor(v))
            for p, state in optimizer.state.items() for k, v in state.items()}


def load_optimizer_state(policy, optimizer, path):
    """Restore AdamW's state from optimizer_state_tensors' file: every parameter's state, or none at all
    (an optimizer that has not stepped yet, as fresh as a new one)."""
    try:
        with safe_open(path, framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a damaged file raises several types; all mean the same here
        raise StageError(f"{path}: not a readable optimizer state ({str(e).splitlines()[0]}); "
                         f"update.py --fresh-optimizer starts AdamW without it") from None
    if not saved:                       # an optimizer that never stepped (a critic warm-up's frozen policy)
        return
    device = next(policy.parameters()).device
    for name, p in distributed.unwrap(policy).named_parameters():
        if not p.requires_grad:                                  # frozen (a LoRA policy's base): no state
            continue
        state = {key: saved.get(f"{name}/{key}") for key in ("step", "exp_avg", "exp_avg_sq")}
        if any(v is None for v in state.values()):
            raise StageError(f"{path}: no AdamW state for parameter {name}; is it from another model? "
                             f"(update.py --fresh-optimizer ignores it)")
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].shape != p.shape:
                raise StageError(f"{path}: {name}/{key} has shape {list(state[key].shape)}, "
                                 f"the parameter has {list(p.shape)}")
        moments = {key: state[key].to(device) for key in ("exp_avg", "exp_avg_sq")}
        if hasattr(p, "device_mesh"):                   # an FSDP2 shard: keep this rank's part of the state
            from torch.distributed.tensor import distribute_tensor

            moments = {k: distribute_tensor(v, p.device_mesh, p.placements) for k, v in moments.items()}
        optimizer.state[p] = {"step": state["step"].float(), **moments}


class BackgroundSaver:
    """One save at a time in a plain thread, so that writing a checkpoint overlaps the next iterations
    (safetensors' writer and file writes release the GIL). wait() re-raises the save's error."""

    def __init__(self):
        self._thread, self._error = None, None

    def submit(self, save):
        self.wait()

        def run():
            try:
                save()
            except BaseException as e:  # handed to the main thread by wait(), whatever it is
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-saver")
        self._thread.start()

    def wait(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def checkpoint_writer(model, tokenizer, optimizer, metrics, args, extra_files=None):
    """A function that writes the checkpoint, optimizer.safetensors and metrics.json into the folder it
    is given (replacing it). The weights and AdamW's state are gathered now, on every rank (FSDP's
    gathers are collectives), and written later from the live tensors; None on ranks other than 0."""
    weights = None if loading.is_lora(distributed.unwrap(model)) else checkpoint_tensors(model)
    state = optimizer_state_tensors(model, optimizer)
    # What the optimizer used, beside the arguments it was given: lr, weight_decay, betas, eps.
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if not distributed.is_main():
        return None
    model = distributed.unwrap(model)

    def write(out_dir):
        save_checkpoint(model, tokenizer, out_dir, weights=weights, command="update.py", extra_files={
            "optimizer.safetensors": lambda path: files.save_tensors(path, state, "optimizer/1", vars(args),
                                                                     param_groups=hyperparameters),
            "metrics.json": lambda path: files.write_json(path, metrics),
            **(extra_files or {}),
        })
    return write


def save_policy(policy, tokenizer, optimizer, metrics, args, out_dir, extra_files=None, saver=None,
                after_write=None):
    """Checkpoint, optimizer.safetensors and metrics.json, written into `out_dir` as one unit.

    With a BackgroundSaver the files are written in its thread, straight from the live weights and
    AdamW state (no copy of 1.6 GB for the default model), while the caller goes on with work that
    only reads them; it must call saver.wait() before anything changes them (train.py waits before
    each update). `after_write` runs once the files are in place.
    """
    write = checkpoint_writer(policy, tokenizer, optimizer, metrics, args, extra_files)
    if write is None:
        return

    def write_all():
        write(out_dir)
        if after_write is not None:
            after_write()

    if saver is None:
        write_all()
    else:
        saver.submit(write_all)


# ----------------------------------------------------------------------------------------
# train.py's run folder

def restore(run_dir, first_save):
    """(iterations in the last save, bad steps so far) of run_dir, repairing what a kill may have left
    (a checkpoint swap cut short, half-written copies under the project's scratch names).

    Without a readable policy/train_state.json, the run resumes from its last complete kept checkpoint
    (linked back into policy/, and said), or from the start when nothing was ever saved (no policy/,
    no kept checkpoint and no complete iteration at or after `first_save`, the first save point: the
    iterations there are recomputed from the base model). Anything else is refused in one line, and
    nothing is deleted: a resume never removes what it cannot rebuild."""
    policy_dir = os.path.join(run_dir, "policy")
    files.recover_dir(policy_dir)                            # killed inside files.replace_dir
    for pattern in (".*.grpo-tmp.*", os.path.join("checkpoints", ".*.grpo-tmp.*")):
        for path in glob.glob(os.path.join(run_dir, pattern)):
            shutil.rmtree(path, ignore_errors=True)          # half-written copies of a killed run
    state = read_state(policy_dir)
    if state is not None:
        return state["iteration"], state["bad_steps"]
    kept = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "iter_[0-9][0-9][0-9][0-9]")))
    complete = [path for path in kept if is_complete_save(path, int(path[-4:]))]
    if complete:
        path = complete[-1]
        print(f"{run_dir}: policy/train_state.json is missing or damaged; resuming from the kept "
              f"checkpoint {os.path.relpath(path, run_dir)}", flush=True)
        link_tree(path, policy_dir)
        state = read_state(policy_dir)
        return state["iteration"], state["bad_steps"]
    saved_after = [d for d in glob.glob(os.path.join(run_dir, "iter_[0-9][0-9][0-9][0-9]"))
                   if int(d[-4:]) >= first_save and os.path.isfile(os.path.join(d, "metrics.json"))]
    if os.path.isdir(policy_dir) or kept or saved_after:
        raise StageError(f"{run_dir}: policy/train_state.json is missing or damaged and no kept checkpoint is "
                         f"complete, so there is no save to resume from; nothing was changed (start a new run "
                         f"in another --run-dir)")
    return 0, 0


def read_state(save_dir):
    """A save's train_state.json ({"iteration", "bad_steps"}), or None where it is missing or damaged."""
    try:
        state = files.read_json(os.path.join(save_dir, "train_state.json"))
    except StageError:
        return None
    ok = isinstance(state, dict) and all(isinstance(state.get(k), int) for k in ("iteration", "bad_steps"))
    return state if ok else None


def is_complete_save(path, iteration):
    """Whether a kept checkpoint holds a whole save of `iteration`: its state, weights and AdamW state."""
    state = read_state(path)
    weights = any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "adapter_model.safetensors"))
    return (state is not None and state["iteration"] == iteration and weights
            and os.path.isfile(os.path.join(path, "optimizer.safetensors")))


def drop_iterations(run_dir, done):
    """Remove the iterations after the last save (`done` iterations), which a resumed run recomputes."""
    for it_dir in glob.glob(os.path.join(run_dir, "iter_[0-9][0-9][0-9][0-9]")):
        if int(it_dir[-4:]) >= done:
            shutil.rmtree(it_dir)


def has_save(run_dir):
    """Whether run_dir holds a resume point (policy/ with its train_state.json)."""
    return os.path.isfile(os.path.join(run_dir, "policy", "train_state.json"))


def save_resume_point(policy, tokenizer, optimizer, losses, update_args, run_dir, iterations_done, bad_steps,
                      saver, keep=False, critic=None, extra_files=None):
    """policy/: what update.py writes, and train_state.json, the resume point, written by `saver` in the
    background (the next iterations run while the files go to disk; policy/ is replaced only once they
    are all there). PPO's critic (ppo_critic.Critic) goes into policy/critic/ in the same unit. With
    `keep`, the same job then links it into checkpoints/ for replay. `extra_files` go into the save too
    (--staleness: the versions it samples from again, grpo/loop/staleness.py)."""
    state = {"iteration": iterations_done, "bad_steps": bad_steps}
    extra_files = {**(extra_files or {}), "train_state.json": lambda path: files.write_json(path, state)}
    if critic is not None:
        extra_files["critic"] = checkpoint_writer(critic.model, tokenizer, critic.optimizer, losses,
                                                  update_args)
    save_policy(policy, tokenizer, optimizer, losses, update_args, os.path.join(run_dir, "policy"),
                extra_files=extra_files, saver=saver,
                after_write=(lambda: keep_checkpoint(run_dir, iterations_done)) if keep else None)


def iteration_dir(run_dir, i, create):
    """iter_XXXX/, emptied and created when `create` (rank 0): a partial iteration is redone whole."""
    it_dir = os.path.join(run_dir, f"iter_{i:04d}")
    if create:
        shutil.rmtree(it_dir, ignore_errors=True)
        os.makedirs(it_dir)
    return it_dir


def sampler_dir(run_dir, i, base, saved_at, save_every, link):
    """The --model that iteration i's stage files record: the folder of the policy that samples it.
    The base model at 0; checkpoints/iter_XXXX when the save after i − 1 iterations is kept (the
    background save links it, or now with `link`, on resuming from that save); else policy/, which
    the next save replaces, so that iteration cannot be replayed."""
    if i == 0:
        return base
    if saved_at == i and is_save_point(i, save_every):
        if link:
            keep_checkpoint(run_dir, i)
        return checkpoint_dir(run_dir, i)
    return os.path.join(run_dir, "policy")


def is_save_point(n, save_every):
    """Whether policy/ is saved after n iterations by the --save-every rhythm (the last iteration
    saves as well); such a save, but for the last, is also kept as checkpoint_dir(run_dir, n)."""
    return bool(save_every) and n % save_every == 0


def checkpoint_dir(run_dir, i):
    return os.path.join(run_dir, "checkpoints", f"iter_{i:04d}")


def keep_checkpoint(run_dir, i):
    """checkpoint_dir(run_dir, i): policy/ (the policy about to sample iteration i) as hard links, which
    cost no time, and no space until policy/ is replaced (then they keep the old files: a whole save's
    size); a copy where links are not possible."""
    link_tree(os.path.join(run_dir, "policy"), checkpoint_dir(run_dir, i))


def link_tree(src, dst):
    """Folder `dst` made a copy of `src` by hard links, through a scratch folder and files.replace_dir."""
    tmp = files.scratch_name(dst, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link)
    files.replace_dir(tmp, dst)
