"""What notebook 04_paged_block_manager.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable

# --- 04_paged_block_manager.ipynb, cell 7 ---
NONE_HASH = hashlib.sha256(b"kvlab-root").digest()


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """sha256 over the parent hash, the block's token ids (as int64) and its extra keys."""
    h = hashlib.sha256(NONE_HASH if parent is None else parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


# --- 04_paged_block_manager.ipynb, cell 22 ---
class ToyBlocks:
    """A block manager's state; ``take`` and ``free_seq`` run the functions given (04's build)."""

    def __init__(self, num_blocks: int, block_size: int, take: Callable, free_seq: Callable):
        self.block_size, self.take_fn, self.free_fn = block_size, take, free_seq
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, list[int]] = {}
        self.free = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[Hashable, list[int]] = {}

    def take(self) -> int:
        return self.take_fn(self)

    def free_seq(self, seq_id: Hashable) -> None:
        self.free_fn(self, seq_id)

    def lookup(self, h: bytes) -> int | None:
        return self.cached[h][0] if h in self.cached else None   # the block cached first under h

    def register(self, b: int, h: bytes) -> None:
        self.hash_of[b] = h
        self.cached.setdefault(h, []).append(b)

    def uncache(self, b: int) -> None:
        h, self.hash_of[b] = self.hash_of[b], None
        self.cached[h].remove(b)
        if not self.cached[h]:
            del self.cached[h]
