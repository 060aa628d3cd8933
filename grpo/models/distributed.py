"""torchrun: ranks, shards of rows, gathers, gradient sync, DDP/FSDP2 wrapping.

One process is the world-size-1 case of every function here, so the stages call them
unconditionally. Under torchrun only rank 0 writes files and logs.
"""

import json
import os
from contextlib import contextmanager

import torch


def rank_and_world():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_main():
    """Rank 0, the one process that writes files and logs (every process when there is one)."""
    return rank_and_world()[0] == 0


def barrier():
    if rank_and_world()[1] > 1:
        torch.distributed.barrier()


def under_torchrun():
    """Whether torchrun started this process among several (WORLD_SIZE > 1): known from the environment
    before the process group is joined, so a setting torchrun cannot run is refused first."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def pick_device(name="auto"):
    """cuda when there is a GPU (under torchrun, this rank's: LOCAL_RANK), else the CPU; or `name`."""
    if name != "auto":
        device = torch.device(name)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None and under_torchrun():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def init_distributed(device_name="auto"):
    """The device of this process; under torchrun (WORLD_SIZE > 1) it first joins the process group,
    NCCL when the processes have GPUs and gloo when they run on CPUs, each rank on its LOCAL_RANK GPU."""
    device = pick_device(device_name)
    if under_torchrun():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def rank_seed(seed, rank):
    """Rank r's sampling seed: rank 0 keeps `seed`, so one process draws what rank 0 of many draws."""
    return seed + (rank << 32)


# ----------------------------------------------------------------------------------------
# Rows: shares of ranks, passes of at most M rows

def shard_slice(n, rank, world):
    """This rank's contiguous share of range(n); the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def row_slices(n, size):
    """Consecutive slices of at most `size` rows covering range(n); size <= 0 means one slice."""
    size = n if size is None or size <= 0 else size
    return [slice(i, min(i + size, n)) for i in range(0, n, max(size, 1))]


def micro_batches(rows, micro_batch_size):
    """This rank's passes over a minibatch's `rows`: a list of (row indices, loss weight).

    Each rank takes its share of the rows in passes of at most `micro_batch_size`. The weight is the
    world size, because DDP and FSDP average gradients over ranks and the loss already carries the
    whole minibatch's normaliser: the sum is the one-process gradient. Every rank makes as many
    passes as rank 0, which has the largest share (each pass is a collective), so a spare pass runs
    one row at weight 0, as does a rank with no rows at all.
    """
    rank, world = rank_and_world()
    passes = [(idx, float(world)) for idx in _rank_passes(rows, micro_batch_size, rank, world)]
    busiest = len(row_slices(max(-(-len(rows) // world), 1), micro_batch_size))
    return passes + [(rows[:1], 0.0)] * (busiest - len(passes))


def every_rank_passes(rows, micro_batch_size):
    """The row indices of every rank's passes over `rows` (micro_batches' real ones), rank after rank:
    what a rank computes to get, for all rows, the numbers each rank's own passes will compute."""
    world = rank_and_world()[1]
    return [idx for rank in range(world) for idx in _rank_passes(rows, micro_batch_size, rank, world)]


def _rank_passes(rows, micro_batch_size, rank, world):
    local = rows[shard_slice(len(rows), rank, world)]                          # [M / world]
    return [local[s] for s in row_slices(len(local), micro_batch_size)]


# ----------------------------------------------------------------------------------------
# Collectives

def all_reduce(values, op):
    """Sum ("sum") or max ("max") over ranks of a dict of floats; the dict itself in one process."""
    if rank_and_world()[1] == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_comm_device())
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
    torch.distributed.all_reduce(t, op=ops[op])
    return dict(zip(keys, t.tolist()))


def broadcast_ints(values):
    """Rank 0's tuple of ints on every rank (what rank 0 alone read from disk)."""
    if rank_and_world()[1] == 1:
        return tuple(values)
    t = torch.tensor(values if is_main() else [0] * len(values), dtype=torch.long, device=_comm_device())
    torch.distributed.broadcast(t, src=0)
    return tuple(t.tolist())


def _comm_device():
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    """Every rank's list of JSON-able records, concatenated in rank order (as UTF-8 JSON, never pickle)."""
    if rank_and_world()[1] == 1:
        return list(records)
    data = torch.frombuffer(bytearray(json.dumps(records).encode()), dtype=torch.uint8)
    return [r for part in all_gather_rows(data) for r in json.loads(bytes(part.tolist()).decode())]


# ----------------------------------------------------------------------------------------
# A model trained on several ranks

def distribute(model, fsdp=False):
    """Under torchrun: the model in DDP, or sharded in place by FSDP2's fully_shard (each decoder layer,
    then the whole) with `fsdp`. One process: the model itself."""
    if rank_and_world()[1] == 1:
        return model
    if not fsdp:
        device = next(model.parameters()).device
        device_ids = [device] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model


def unwrap(model):
    """The model inside a DDP wrapper (FSDP2 shards the model in place and keeps its class's methods)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full_tensor(t):
    """A DTensor (an FSDP2 shard) gathered into the whole tensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
