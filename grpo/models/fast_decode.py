"""The sampler's fast decode step: the linear layers' products on packed weights (oneDNN on a CPU),
a KV cache whose keys and values are written in place into buffers made once for the whole
completion, and the token drawn as torch.multinomial draws it, a batch at once. The first two change
no number beyond rounding, the draw none (docs/performance.md has what each saves).

transformers' DynamicLayer concatenates the new position onto its keys and values, which copies
every layer's whole cache at every decode step. PreallocatedLayer keeps the same tensors as views
of the front of larger buffers, so attention reads the same numbers and the step copies only the
new position. This module imports transformers, so modeling.prefill imports it where a cache is made.
"""

import contextlib

import torch
from transformers.cache_utils import DynamicLayer

from grpo.models import distributed


# MKL's sgemm runs the decode step's products, a few dozen rows against each weight, well below the
# rate oneDNN reaches on a weight packed once into its own layout (benchmarks/levers.py
# decode-linears, on the 2-core AMD machine this project is measured on); False: every product
# through MKL.
ONEDNN_DECODE = True


@contextlib.contextmanager
def decode_linears(model, rows):
    """Within this block, on a CPU, every plain float32 nn.Linear of the model (the LM head included)
    computes through oneDNN on a copy of its weight packed once for products of about `rows` rows
    (torch.ops.mkldnn._reorder_linear_weight and _linear_pointwise: what torch.compile's CPU backend
    calls for a frozen linear), for the sampler's inference-mode passes. Only the rounding changes,
    by the order in which a decode step already differs from a full forward pass (the numbers in
    docs/performance.md); the packed copies (the model's size again) live for the block. Under LoRA
    the wrappers stay and the plain linears inside them (the base layer, lora_A, lora_B) are packed
    like any other. A call with gradients enabled computes as nn.Linear does (the packed product has
    no backward). On a GPU, for any other layer (bf16 weights, quantised ones), and for a linear whose
    forward is already replaced (an enclosing block, a hook's wrapper), nothing changes."""
    bare = distributed.unwrap(model)
    linears = [m for m in bare.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 and "forward" not in vars(m)]
    if not (ONEDNN_DECODE and linears and torch.backends.mkldnn.is_available()):
        yield
        return
    patched = []
    try:
        for linear in linears:
            linear.forward = _packed_forward(linear, rows)  # the instance's forward, ahead of nn.Linear's
            patched.append(linear)
        yield
    finally:
        for linear in patched:
            del linear.forward


def _packed_forward(linear, rows):
    weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)   # [d_out, d_in], packed
    bias = None if linear.bias is None else linear.bias.detach()

    def forward(x):                                                          # [..., d_in] -> [..., d_out]
        if torch.is_grad_enabled():
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], linear.out_features)
    return forward


# ----------------------------------------------------------------------------------------
# The KV cache, written in place

class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values [n, H, S, d] are views of the front of buffers
    [n, H, S + room, d]. update() copies the new positions into the buffers and widens the views.
    Where the room runs out, or something replaced the keys (a reorder, a batch select: anything but
    the front of the buffer, which a crop leaves), it makes new buffers from what the layer holds, so
    it is never wrong, only slower. The writes are in place: for passes without gradients only."""

    def __init__(self, layer, room):
        super().__init__()
        self.dtype, self.device, self.is_initialized = layer.dtype, layer.device, True
        self.keys, self.values = layer.keys, layer.values
        self.room = room
        self._new_buffers(room)

    def _new_buffers(self, room):
        self.key_buffer, self.value_buffer = _with_room(self.keys, room), _with_room(self.values, room)
        length = self.keys.shape[-2]
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.key_buffer.shape[-2] or not self._holds_front():
            self._new_buffers(max(end - start, self.room))
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]   # [n, H, end, d]
        return self.keys, self.values

    def _holds_front(self):
        """Whether the keys are still the buffer's first positions (a slice of rows or heads, which a
        batch select can make, starts at the same address but is not)."""
        return (self.keys.data_ptr() == self.key_buffer.data_ptr()
                and self.keys.shape[:2] == self.key_buffer.shape[:2]
                and self.keys.stride() == self.key_buffer.stride())


def _with_room(x, room):
    """x [n, H, S, d] copied to the front of a new buffer [n, H, S + room, d]."""
    buffer = x.new_empty(*x.shape[:2], x.shape[2] + room, x.shape[3])
    buffer[:, :, :x.shape[2]] = x
    return buffer


def preallocate(cache, room):
    """Make each filled plain layer of a DynamicCache a PreallocatedLayer with room for `room` more
    positions (in place); other layers (sliding windows, quantised caches) stay as they are. Only
    without gradients: the layers write into their buffers in place."""
    if torch.is_grad_enabled():
        raise RuntimeError("fast_decode.preallocate is for passes without gradients (it writes in place)")
    cache.layers = [PreallocatedLayer(layer, room) if type(layer) is DynamicLayer and layer.is_initialized
                    else layer for layer in cache.layers]
    return cache


def draw(probs, generator):
    """One token per row of softmax probabilities [n, V], as torch.multinomial(probs, 1) draws it:
    argmax_v p_v / q_v, q_v ~ Exp(1). For float32 on a CPU the exponentials are exponential_'s own,
    -log1p(-u) of float64 uniforms in memory order, cast to float32 (the cast hides the last-bit
    differences between torch's log1p and libm's), made a batch at once: the same tokens for a seed
    in half the time (tests/test_sampling.py, benchmarks/levers.py draw). Otherwise torch.multinomial."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if torch.isnan(probs).any():                                    # softmax of an inf or NaN logit
        raise ValueError("probability tensor contains nan (the logits were not finite)")
    u = torch.empty_like(probs, dtype=torch.float64).uniform_(generator=generator)      # [n, V]
    q = -torch.log1p(-u)                                                                # Exp(1), [n, V]
    return (probs / q.to(probs.dtype)).argmax(-1)                                       # [n]
