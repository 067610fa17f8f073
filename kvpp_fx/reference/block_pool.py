"""The reference engine's block pool: fixed cache blocks with reference counts and a prefix cache.

A full block is keyed by a chain hash of all tokens up to its end, so a later request whose prompt
starts with the same tokens reuses it. Freed blocks stay cached until reallocated, least recently
freed first.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocksError(RuntimeError):
    """The block pool cannot hold the scheduled tokens."""


class BlockPool:
    """Fixed blocks with reference counts and a prefix cache of full blocks (LRU among free ones)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    @staticmethod
    def chain_hashes(tokens: list[int], block_size: int) -> list[int]:
        hashes, h = [], None
        for end in range(block_size, len(tokens) + 1, block_size):
            h = hash((h, tuple(tokens[end - block_size:end])))
            hashes.append(h)
        return hashes

    def match_prefix(self, tokens: list[int]) -> list[int]:
        blocks = []
        for h in self.chain_hashes(tokens, self.block_size):
            block = self.by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take(self, block: int) -> None:
        self.refs[block] += 1
        self.free.pop(block, None)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocksError("the block pool is exhausted; raise num_blocks or lower the load.")
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def register(self, block: int, h: int) -> None:
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hash_of[block] = h
