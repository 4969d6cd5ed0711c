"""A KV cache that speculative decoding can edit cheaply.

`transformers.DynamicCache` grows by `torch.cat` on every forward (a full copy of every layer's
keys and values per step) and can only drop a suffix. `TreeKVCache` keeps each layer's keys and
values in a preallocated buffer, so an update writes in place, a rollback moves a length, and a
commit gathers the accepted tree nodes into contiguous slots. Given a `capacity` (the shared loop
gives prompt + max new tokens + `ROOM`, `ModelRunner.reserve`) every buffer is allocated once, at
that size, and keeps its address for the whole answer (what a captured CUDA graph needs); a cache
without one, or a forward past it, grows by doubling (new addresses), counted in `regrowths`.

It is a `transformers.Cache`: models call `update` per layer and read the returned views.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer


class FilledView:
    """`BufferedLayer.keys` / `.values`: the buffer's first `length` positions, sliced when read;
    before the buffer exists (or after `reset`), whatever was assigned (`DynamicLayer` assigns)."""

    def __set_name__(self, owner, name: str) -> None:
        self.buffer, self.assigned = f"_{name}", f"_assigned_{name}"

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        buffer = getattr(layer, self.buffer, None)
        return getattr(layer, self.assigned) if buffer is None else buffer[..., : layer.length, :]

    def __set__(self, layer, value) -> None:
        setattr(layer, self.assigned, value)


class BufferedLayer(DynamicLayer):
    """One layer's keys/values in a buffer `[batch, kv_heads, capacity, head_dim]`: `capacity`
    positions at once when its cache has one, else grown by doubling from `min_capacity`."""

    min_capacity = 256

    def __init__(self, cache: "TreeKVCache | None" = None):
        super().__init__()
        self.owner = cache

    # the filled part of the buffers, a view made when read: changing `length` makes none (the
    # native layer writes and reads the buffers directly, and a step makes no view it does not
    # read)
    keys = FilledView()
    values = FilledView()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        self._keys = self._values = None
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = 0 if self._keys is None else self._keys.shape[-2]
        if needed <= capacity:
            return
        fixed = self.owner.capacity if self.owner is not None else None
        if fixed is not None and self._keys is None and needed <= fixed:
            capacity = fixed
        else:
            if self.owner is not None and self._keys is not None:
                self.owner.regrowths += 1
            capacity = max(needed, 2 * capacity, self.min_capacity, fixed or 0)
        # zeros, not garbage: a static step's attention reads the whole buffer under a mask, and a
        # masked NaN still poisons the weighted sum (0 * NaN)
        keys = key_states.new_zeros(*key_states.shape[:-2], capacity, key_states.shape[-1])
        values = value_states.new_zeros(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if self.length:
            keys[..., : self.length, :] = self._keys[..., : self.length, :]
            values[..., : self.length, :] = self._values[..., : self.length, :]
        self._keys, self._values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, added = self.length, key_states.shape[-2]
        self._reserve(key_states, value_states, start + added)
        self._keys[..., start : start + added, :] = key_states
        self._values[..., start : start + added, :] = value_states
        self.length = start + added
        return self.keys, self.values

    @property
    def key_buffer(self) -> torch.Tensor | None:
        """The whole keys buffer [batch, kv_heads, capacity, head_dim] (None before the first update or
        after `reset`): what a static step writes and reads at device positions (`graphs.static_layer`)."""
        return self._keys

    @property
    def value_buffer(self) -> torch.Tensor | None:
        """The whole values buffer, as `key_buffer`."""
        return self._values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative number, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep positions `start + offsets` (increasing) as `start .. start+len(offsets)-1`; drop the rest."""
        if not self.is_initialized:
            return
        index = offsets + start
        kept = offsets.numel()
        # index_select copies first, so overlapping source and destination are safe.
        self._keys[..., start : start + kept, :] = self._keys.index_select(-2, index)
        self._values[..., start : start + kept, :] = self._values.index_select(-2, index)
        self.length = start + kept

    def reset(self) -> None:
        self.keys = self.values = self._keys = self._values = None
        self.length = 0
        self.is_initialized = False


class TreeKVCache(Cache):
    """The cache of one sequence (batch 1) for any decoder of this suite; `capacity`: positions
    each layer's buffers hold from the start (None: grown as needed)."""

    def __init__(self, capacity: int | None = None):
        super().__init__(layer_class_to_replicate=lambda: BufferedLayer(self))
        self.capacity = capacity
        self.regrowths = 0  # buffers reallocated larger (new addresses) since the cache was made

    def reserve(self, index: int, added: int, batch: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for `added` positions in layer `index` (made as `update` makes it): its key and
        value buffers [batch, kv_heads, capacity, head_dim] and the first free position. The caller
        writes positions start .. start + added - 1 in place, then calls `advance`."""
        while len(self.layers) <= index:
            self.layers.append(BufferedLayer(self))
        layer = self.layers[index]
        capacity = 0 if not layer.is_initialized or layer._keys is None else layer._keys.shape[-2]
        if capacity < layer.get_seq_length() + added:
            like = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
            if not layer.is_initialized:
                layer.lazy_initialization(like, like)
            layer._reserve(like, like, layer.length + added)
        return layer._keys, layer._values, layer.length

    def advance(self, index: int, added: int) -> None:
        """After `reserve` and the writes: the layer holds `added` more positions (its `keys` and
        `values` views include them)."""
        self.layers[index].length += added

    def clear(self) -> None:
        """Empty, keeping every buffer (and its address) for the next answer."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.length = 0
        self.regrowths = 0

    @classmethod
    def reserved(cls, previous: "TreeKVCache | None", capacity: int) -> "TreeKVCache":
        """An empty cache of at least `capacity` positions: `previous` cleared while it is large
        enough (the same buffers and addresses, so captured graphs stay valid), else a new one."""
        if previous is not None and previous.capacity >= capacity:
            previous.clear()
            return previous
        return cls(capacity)

    def rollback(self, length: int) -> None:
        """Drop everything after the first `length` positions."""
        current = self.get_seq_length()
        if length > current:
            raise ValueError(f"cannot roll back to {length}: the cache holds {current} positions")
        self.crop(length - current)

    @torch.inference_mode()
    def commit(self, start: int, kept: Sequence[int] | torch.Tensor) -> None:
        """After a tree forward appended nodes at `start..`, keep only tree nodes `kept` (in order,
        increasing), contiguous right after `start`, and drop the other nodes. Given a list, the
        checks run on the host and the gather index goes to the device once (no read back)."""
        kept = kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)
        current = self.get_seq_length()
        if kept and kept[-1] >= current - start:
            raise ValueError(f"commit of node {kept[-1]} but only {current - start} nodes follow position {start}")
        if not kept:
            self.rollback(start)
            return
        if kept == list(range(len(kept))):  # the accepted nodes already sit right after `start`
            for layer in self.layers:
                layer.crop(start + len(kept) - layer.get_seq_length())
            return
        index = None
        for layer in self.layers:
            if layer.is_initialized:
                index = torch.tensor(kept,
                                     device=layer.device) if index is None or index.device != layer.device else index
                layer.keep(start, index)


def batch_change(previous: Sequence, current: Sequence) -> tuple[list[int], list] | None:
    """How a batch of `current` sequences (by identity) follows one of `previous`: (the rows of `previous`
    that hold current's first sequences, in order; the sequences after them, new to the batch: they
    joined, continuous batching). None when `current` is no such continuation (a new batch)."""
    rows = []
    for s in current:
        row = next((i for i, p in enumerate(previous) if p is s), None)
        if row is None:
            break
        rows.append(row)
    joining = list(current[len(rows):])
    if not rows or any(p is s for s in joining for p in previous):
        return None
    return rows, joining


class BatchKVCache(TreeKVCache):
    """The cache of B sequences decoded together (`methods/loop.py`). Every layer's buffers are
    [B, kv_heads, capacity, head_dim] with one filled length L shared by the batch (the forward
    appends after it) and a length per sequence, `lengths[b]` <= L: sequence b's KV is slots
    0 .. lengths[b] - 1 of its row, slot = position. Its slots lengths[b] .. L - 1 hold another
    sequence's step rows or its own rejected ones: padding, which every mask of the batch hides
    (`ModelRunner.forward_batch`). A commit moves each sequence's accepted rows to its own length;
    L is then the longest sequence."""

    def __init__(self, batch: int, capacity: int | None = None, layers: int | None = None,
                 slots: int | None = None):
        """`layers`: the model's layer count; with a `capacity`, every layer's buffers are made at once,
        at the first write, as views of one keys and one values tensor [layers, slots, kv_heads,
        capacity, head_dim] (its first B rows), so that a commit moves every layer's rows in one gather
        (`commit_batch`). `slots`: the sequences its buffers are made for (default B); more may join
        (`add_sequence`), the buffers then copied into larger ones."""
        super().__init__(capacity)
        self.lengths = [0] * batch
        self.layer_count = layers
        self.slots = max(slots or batch, batch)
        self.joined: tuple[torch.Tensor, torch.Tensor] | None = None  # views of `storage`'s first B rows
        self.storage: tuple[torch.Tensor, torch.Tensor] | None = None

    def _join(self, like: torch.Tensor) -> None:
        """Every layer's buffers as views of one pair of tensors (`layers` given, no layer written yet)."""
        if self.joined is not None or not self.layer_count or not self.capacity or \
                any(layer.is_initialized for layer in self.layers):
            return
        shape = (self.layer_count, self.slots, like.shape[1], self.capacity, like.shape[-1])
        self.storage = like.new_zeros(shape), like.new_zeros(shape)
        self.layers = []
        for _ in range(self.layer_count):
            layer = BufferedLayer(self)
            layer.lazy_initialization(like, like)
            self.layers.append(layer)
        self._view(len(self.lengths))

    def _view(self, rows: int) -> None:
        """The joined buffers: `storage`'s first `rows` sequences, each layer's keys and values views of them."""
        self.joined = keys, values = tuple(buffers.narrow(1, 0, rows) for buffers in self.storage)
        for index, layer in enumerate(self.layers):
            layer._keys, layer._values = keys[index], values[index]

    def _joined(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The joined buffers while every layer's are still their views (no layer grew past them)."""
        return self.joined if self.joined is not None and not self.regrowths else None

    def _batch_first(self) -> list[torch.Tensor]:
        """Every keys and values buffer as a view [B, ..., capacity, head_dim], the sequences first and
        the positions second to last: the joined pair (all layers in each), else each layer's."""
        joined = self._joined()
        if joined is not None:
            return [buffers.movedim(1, 0) for buffers in joined]
        return [buffer for layer in self.layers if layer.is_initialized and layer._keys is not None
                for buffer in (layer._keys, layer._values)]

    def reserve(self, index: int, added: int, batch: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.joined is None:
            self._join(torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device))
        return super().reserve(index, added, batch, kv_heads, head_dim, dtype, device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.joined is None:
            self._join(key_states[..., :0, :])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.inference_mode()
    def commit_batch(self, start: int, paths: Sequence[Sequence[int]]) -> None:
        """After a forward appended every sequence's rows at `start..`: keep sequence b's rows
        `paths[b]` (increasing) at lengths[b].., in one gather for every layer's keys and one for their
        values when the layers' buffers are joined (else one per layer's keys and values)."""
        if len(paths) != len(self.lengths):
            raise ValueError(f"{len(paths)} paths for a batch of {len(self.lengths)}")
        rows, sources, targets = [], [], []
        for b, path in enumerate(paths):
            path = list(path)
            if path and path[-1] >= self.get_seq_length() - start:
                raise ValueError(f"commit of row {path[-1]} but only {self.get_seq_length() - start} rows follow "
                                 f"{start}")
            if self.lengths[b] != start or path != list(range(len(path))):  # else already in place
                rows += [b] * len(path)
                sources += [start + node for node in path]
                targets += range(self.lengths[b], self.lengths[b] + len(path))
            self.lengths[b] += len(path)
        if rows:
            index = [torch.tensor(v) for v in (rows, sources, targets)]
            for buffer in self._batch_first():
                b, source, target = (i.to(buffer.device) for i in index)
                buffer[b, ..., target, :] = buffer[b, ..., source, :]
        for layer in self.layers:
            if layer.is_initialized:
                layer.length = max(self.lengths)

    @torch.inference_mode()
    def load_row(self, row: int, cache: TreeKVCache) -> None:
        """Sequence `row` takes the positions a batch-1 cache holds (its prompt, prefilled alone):
        copied into slots 0 .. n - 1 of its row, the buffers made at this cache's capacity first."""
        n = cache.get_seq_length()
        for index, source in enumerate(cache.layers):
            if source.is_initialized:
                keys = source.key_buffer
                self.reserve(index, n, len(self.lengths), keys.shape[1], keys.shape[-1], keys.dtype, keys.device)
        self._copy_row(row, cache)

    def _copy_row(self, row: int, cache: TreeKVCache) -> None:
        """Slots 0 .. n - 1 of sequence `row` := the batch-1 cache's n positions (the buffers hold them)."""
        n = cache.get_seq_length()
        for index, source in enumerate(cache.layers):
            if not source.is_initialized:
                continue
            layer = self.layers[index]
            if layer._keys.shape[-2] < n:
                raise RuntimeError(f"a sequence of {n} positions does not fit this cache's {layer._keys.shape[-2]}")
            layer._keys[row, :, :n] = source.key_buffer[0, :, :n]
            layer._values[row, :, :n] = source.value_buffer[0, :, :n]
        self.lengths[row] = n
        for layer in self.layers:
            if layer.is_initialized:
                layer.length = max(self.lengths)

    @torch.inference_mode()
    def keep_sequences(self, kept: Sequence[int]) -> None:
        """Only sequences `kept` (in this order) stay: the batch shrinks. In order (sequences left, the
        others' order kept), each moves up to its new row (its own slots copied; nothing when it stays
        in place) and the buffers narrow to the rows kept (views of the same storage); else the rows
        gathered in the new order (back into the same storage while the layers' buffers are joined)."""
        kept = list(kept)
        lengths, self.lengths = self.lengths, [self.lengths[b] for b in kept]
        joined = self._joined()
        if kept == sorted(set(kept)):
            for buffer in self._batch_first():
                for row, b in enumerate(kept):
                    if row != b:
                        buffer[row, ..., : lengths[b], :] = buffer[b, ..., : lengths[b], :]
            if joined is not None:
                self._view(len(kept))
            else:
                self.joined = None
                for layer in self.layers:
                    if layer.is_initialized and layer._keys is not None:
                        layer._keys, layer._values = (buffer.narrow(0, 0, len(kept)) for buffer in (layer._keys,
                                                                                                   layer._values))
        elif joined is not None:
            order = torch.tensor(kept, device=joined[0].device)
            for full, view in zip(self.storage, joined):
                full[:, : len(kept)] = view.index_select(1, order)  # gathered first, then written back
            self._view(len(kept))
        else:
            self.joined = None
            for layer in self.layers:
                if layer.is_initialized and layer._keys is not None:
                    order = torch.tensor(kept, device=layer._keys.device)
                    layer._keys, layer._values = (buffer.index_select(0, order) for buffer in (layer._keys,
                                                                                             layer._values))
        for layer in self.layers:
            if layer.is_initialized and layer._keys is not None:
                layer.length = max(self.lengths, default=0)

    @torch.inference_mode()
    def add_sequence(self, cache: TreeKVCache) -> int:
        """A sequence joins the batch (continuous batching): a new last row, holding the positions a
        batch-1 cache holds (its prompt, prefilled alone; `load_row`). Returns its row. The joined
        buffers take it in place up to `slots` rows, then are made twice as large (a copy); a cache
        whose layers hold buffers of their own grows each by a row (a copy)."""
        row = len(self.lengths)
        self.lengths.append(0)
        if not any(layer.is_initialized and layer._keys is not None for layer in self.layers):
            self.load_row(row, cache)  # nothing written yet: the buffers are made now
            return row
        if self._joined() is not None:
            if row >= self.slots:
                self.slots = max(2 * self.slots, row + 1)
                shape = (self.storage[0].shape[0], self.slots, *self.storage[0].shape[2:])
                grown = tuple(old.new_zeros(shape) for old in self.storage)
                for new, old in zip(grown, self.storage):
                    new[:, :row] = old[:, :row]
                self.storage = grown
            self._view(row + 1)
        else:
            self.joined = None
            for layer in self.layers:
                if layer.is_initialized and layer._keys is not None:
                    layer._keys, layer._values = (torch.cat([buffer, buffer.new_zeros(1, *buffer.shape[1:])])
                                                  for buffer in (layer._keys, layer._values))
        self._copy_row(row, cache)
        return row
