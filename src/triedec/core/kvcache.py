"""A preallocated KV cache written by slot (no per-step ``torch.cat``).

Layout per layer: keys/values ``[1, kv_heads, capacity, head_dim]``. Slots ``[0, length)`` are
*committed*. A forward of T new tokens writes them as *pending* slots ``[length, length + T)``; the
caller then decides which of them to keep with :meth:`KVCache.commit` (speculative decoding keeps
the accepted path) and, for beam search, drops dead committed slots with :meth:`KVCache.select`.
Each slot also records its position id so that sliding-window masks can be derived from it.

Pure torch: nothing here knows about transformers (the adapter bridges to it). Buffers are
created inside the adapter's inference-mode forward, so the methods that mutate them run in
inference mode too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triedec.core.errors import TriedecError


class KVCache:
    """Per-layer preallocated key/value buffers plus each slot's position id.

    Mutation contract:
    * :meth:`stage` records the positions of the T tokens about to be written (pending slots);
    * :meth:`write` (called once per layer during a forward) stores the pending K/V; :meth:`view`
      returns views over ``[0, length + T)`` (what attention reads);
    * :meth:`commit` keeps a subset of the pending slots, in the given order, right after the
      committed ones; :meth:`select` keeps a subset of the committed slots (compaction);
    * :meth:`reserve` grows the buffers (beam search's trie can outgrow its first estimate).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise TriedecError(f"KV cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.length = 0  # committed slots
        self.pending = 0  # slots written by the last forward, not yet committed
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._positions = torch.zeros(capacity, dtype=torch.long)
        self.peak = 0  # most slots ever in use (committed + pending)

    # ---- forward-time writes ------------------------------------------------------------------

    def stage(self, positions: torch.Tensor) -> None:
        """Reserve ``len(positions)`` pending slots and record their position ids ``[T]``."""
        n = positions.numel()
        if self.length + n > self.capacity:
            raise TriedecError(
                f"KV cache full: {self.length} committed + {n} new tokens exceed capacity {self.capacity}"
            )
        self._positions[self.length : self.length + n] = positions.cpu()
        self.pending = n
        self.peak = max(self.peak, self.length + n)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's new K/V ``[1, kv_heads, T, head_dim]`` in the pending slots."""
        if layer == len(self.keys):  # lazy allocation: shapes, dtype and device come from the model
            shape_k = (keys.shape[0], keys.shape[1], self.capacity, keys.shape[3])
            shape_v = (values.shape[0], values.shape[1], self.capacity, values.shape[3])
            self.keys.append(torch.empty(shape_k, dtype=keys.dtype, device=keys.device))
            self.values.append(torch.empty(shape_v, dtype=values.dtype, device=values.device))
        n = keys.shape[-2]
        if n != self.pending:
            raise TriedecError(f"layer {layer} wrote {n} tokens but {self.pending} were staged")
        self.keys[layer].narrow(2, self.length, n).copy_(keys)
        self.values[layer].narrow(2, self.length, n).copy_(values)

    def allocate(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the buffers of layers not yet written, ``[1, kv_heads, capacity, head_dim]`` each
        (for a forward that writes the pending slots in place, not through :meth:`write`)."""
        while len(self.keys) < layers:
            for bufs in (self.keys, self.values):
                bufs.append(torch.empty((1, kv_heads, self.capacity, head_dim), dtype=dtype, device=device))

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[1, kv_heads, length + pending, head_dim]`` of one layer's committed + pending
        K and V (what attention reads during a forward, after :meth:`write`)."""
        end = self.length + self.pending
        return self.keys[layer].narrow(2, 0, end), self.values[layer].narrow(2, 0, end)

    # ---- after the forward --------------------------------------------------------------------

    def commit(self, keep: Sequence[int] | torch.Tensor) -> None:
        """Keep pending slots ``keep`` (indices relative to the first pending slot), in that order,
        at contiguous slots right after the committed ones; drop the other pending slots."""
        if not isinstance(keep, torch.Tensor) and all(isinstance(k, int) and k == i for i, k in enumerate(keep)):
            # the first slots as they stand (every plain step, and an accepted chain): nothing moves
            # (checked in Python: torch's checks cost ~30 us, every request every step)
            if len(keep) > self.pending:
                raise TriedecError(f"commit indices {list(keep)} outside the {self.pending} pending slots")
            self.length += len(keep)
            self.pending = 0
            return
        self._move(keep)

    @torch.inference_mode()
    def _move(self, keep: Sequence[int] | torch.Tensor) -> None:
        keep_t = torch.as_tensor(keep, dtype=torch.long)
        m = keep_t.numel()
        if m and (int(keep_t.min()) < 0 or int(keep_t.max()) >= self.pending):
            raise TriedecError(f"commit indices {keep_t.tolist()} outside the {self.pending} pending slots")
        identity = torch.equal(keep_t, torch.arange(m))
        if m and not identity:
            src = keep_t + self.length
            for buf in (*self.keys, *self.values):
                idx = src.to(buf.device)
                buf[:, :, self.length : self.length + m] = buf.index_select(2, idx)
            self._positions[self.length : self.length + m] = self._positions[src]
        self.length += m
        self.pending = 0

    @torch.inference_mode()
    def select(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Keep only the committed ``slots`` (ascending), compacted to ``[0, len(slots))``:
        one ``index_select`` per layer. Pending slots are dropped."""
        idx = torch.as_tensor(slots, dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.length):
            raise TriedecError("select indices outside the committed slots")
        m = idx.numel()
        for buf in (*self.keys, *self.values):
            buf[:, :, :m] = buf.index_select(2, idx.to(buf.device))
        self._positions[:m] = self._positions[idx]
        self.length = m
        self.pending = 0

    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Grow to at least ``capacity`` slots (buffers reallocated, committed slots copied)."""
        if capacity <= self.capacity:
            return
        n = self.length + self.pending
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                grown = torch.empty((*buf.shape[:2], capacity, buf.shape[3]), dtype=buf.dtype, device=buf.device)
                grown[:, :, :n] = buf[:, :, :n]
                bufs[i] = grown
        positions = torch.zeros(capacity, dtype=torch.long)
        positions[:n] = self._positions[:n]
        self._positions = positions
        self.capacity = capacity

    @torch.inference_mode()
    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Make ``source``'s first ``length`` committed slots this empty cache's committed slots
        (the same tokens' K/V and positions, copied: the caches stay independent)."""
        if self.length or self.pending:
            raise TriedecError("copy_prefix needs an empty cache")
        if not 0 <= length <= min(source.length, self.capacity):
            raise TriedecError(f"cannot copy {length} slots: the source holds {source.length}, the capacity is "
                               f"{self.capacity}")
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for layer, buf in enumerate(theirs):
                if layer == len(mine):
                    mine.append(torch.empty((*buf.shape[:2], self.capacity, buf.shape[3]), dtype=buf.dtype,
                                            device=buf.device))
                mine[layer][:, :, :length] = buf[:, :, :length]
        self._positions[:length] = source._positions[:length]
        self.length = length
        self.peak = max(self.peak, length)

    @torch.inference_mode()
    def clone(self) -> KVCache:
        """An independent copy of the committed slots (same capacity)."""
        other = KVCache(self.capacity)
        other.length, other.peak = self.length, self.length
        other.keys = [b.clone() for b in self.keys]
        other.values = [b.clone() for b in self.values]
        other._positions = self._positions.clone()
        return other

    @torch.inference_mode()
    def extend_to(self, length: int) -> None:
        """Grow the committed slots to ``length`` by repeating the committed ones (a cache of that
        length for timing forwards: attention's cost does not depend on the values)."""
        if not 0 < self.length <= length <= self.capacity:
            raise TriedecError(f"cannot extend {self.length} committed slots to {length} (capacity {self.capacity})")
        for buf in (*self.keys, *self.values):
            for start in range(self.length, length, self.length):
                n = min(self.length, length - start)
                buf[:, :, start : start + n] = buf[:, :, :n]
        self._positions[self.length : length] = torch.arange(self.length, length)
        self.length = self.peak = length

    # ---- views --------------------------------------------------------------------------------

    def positions(self) -> torch.Tensor:
        """Position ids ``[length + pending]`` of committed + pending slots."""
        return self._positions[: self.length + self.pending]

    def bytes_per_slot(self) -> int:
        return sum(b[:, :, :1].numel() * b.element_size() for b in (*self.keys, *self.values))

    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.keys, *self.values))
