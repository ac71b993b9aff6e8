"""A KV cache written in place: each layer's keys and values in buffers sized for the whole generation.

transformers' ``DynamicCache`` grows each layer's K/V by ``torch.cat`` at every decoded token — a copy of
the whole cache per layer per token (35 % of a 16 × 8 × 64-token generation's time on this machine,
``benchmarks/RESULTS.md``). :func:`preallocated_cache` keeps ``DynamicCache``'s interface (the model, the
mask builder, ``batch_repeat_interleave`` for a group's samples, ``batch_select_indices`` when rows finish)
with layers that write each step into buffers of ``capacity`` positions and hand attention a view of the
filled part; a generation longer than planned doubles the buffers (amortised O(1)). The values are the
same tensors ``DynamicCache`` would hold — attention reads identical numbers.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["preallocated_cache", "PreallocatedLayer", "full_attention_only"]


def _dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class PreallocatedLayer(_dynamic_layer()):
    """One layer's K/V ``[B, H_kv, capacity, D]``, the first ``n`` positions filled; ``keys`` / ``values`` are
    views of them (what ``DynamicLayer`` exposes)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.n = int(capacity), 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, t, D = key_states.shape
        cap = max(self.capacity, t)
        self._k = key_states.new_empty(B, H, cap, D)
        self._v = value_states.new_empty(B, value_states.shape[1], cap, value_states.shape[-1])
        self.n = 0
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.n + t > self._k.shape[-2]:  # longer than planned: double (amortised)
            grow = max(self.n + t, 2 * self._k.shape[-2]) - self._k.shape[-2]
            self._k = torch.nn.functional.pad(self._k, (0, 0, 0, grow))
            self._v = torch.nn.functional.pad(self._v, (0, 0, 0, grow))
        self._k[:, :, self.n:self.n + t] = key_states
        self._v[:, :, self.n:self.n + t] = value_states
        self.n += t
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:  # only the filled positions are copied (the rest is written before it is read)
            self._k, self._v = (self._repeat(t, repeats) for t in (self._k, self._v))
            self._views()

    def _repeat(self, buf: torch.Tensor, repeats: int) -> torch.Tensor:
        out = buf.new_empty(buf.shape[0] * repeats, *buf.shape[1:])
        out[:, :, :self.n] = buf[:, :, :self.n].repeat_interleave(repeats, 0)
        return out

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.n + max_length
        if self.is_initialized and max_length < self.n:
            self.n = max_length
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))


def full_attention_only(model) -> bool:
    """Whether every layer of ``model``'s decoder attends to the whole past (no sliding window, no linear
    attention) — the layers :class:`PreallocatedLayer` stands in for. False for a model without a transformers
    config (its own cache, if any, is left to it)."""
    text_config = getattr(getattr(model, "config", None), "get_text_config", None)
    if text_config is None:
        return False
    cfg = text_config(decoder=True)
    types = getattr(cfg, "layer_types", None)
    return getattr(cfg, "sliding_window", None) is None and (types is None or set(types) == {"full_attention"})


def preallocated_cache(capacity: int):
    """A ``DynamicCache`` whose layers (created as the model first writes each) are :class:`PreallocatedLayer`
    of ``capacity`` positions."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(PreallocatedLayer, capacity)
    return cache
