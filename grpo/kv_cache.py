"""The sampler's KV cache: each layer's keys and values written in place into buffers made once for
the whole completion.

transformers' DynamicLayer concatenates the new position onto its keys and values, which copies
every layer's whole cache at every decode step (on the default job, aten::cat took 0.45 s of a
9.02 s sampler run, 0.03 s with these buffers: docs/performance.md). PreallocatedLayer keeps the
same tensors as views of the front of larger buffers, so attention reads the same numbers and the
step copies only the new position. Imported only where a cache is made (modeling.prefill), since
it imports transformers.
"""

import torch
from transformers.cache_utils import DynamicLayer


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
        raise RuntimeError("kv_cache.preallocate is for passes without gradients (it writes in place)")
    cache.layers = [PreallocatedLayer(layer, room) if type(layer) is DynamicLayer and layer.is_initialized
                    else layer for layer in cache.layers]
    return cache
