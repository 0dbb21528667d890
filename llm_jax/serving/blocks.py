"""The paged KV cache's host side: a pool of fixed-size blocks, the prefix cache over it, and each
request's block table.

The device holds ``num_blocks`` pages of ``block_size`` token slots (per layer, for K and V); this module
decides which page each token's K/V lives in. Token ``p`` of a request is slot
``table[p // block_size] * block_size + p % block_size`` of the flat cache.

Prefix caching: a block full of computed K/V is named by a chained hash of its tokens and its parent
block's hash, so equal names mean equal token prefixes. Such a block outlives its request: when its last
reference goes it joins the free list still findable by its hash, and is evicted (its hash forgotten) only
when the pool hands it out again. Blocks that hold nothing findable are handed out before cached ones, and
cached ones least recently released first.

Plain Python, no JAX (the device step consumes what the scheduler builds from these tables).
"""

import collections
import hashlib
import struct
from collections.abc import Hashable, Iterable, Sequence

NULL_BLOCK = 0
"""Never handed out: block tables are padded with it, and padding tokens' K/V may be written to it."""

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(16)
"""The parent hash of a sequence's first block; sequences whose K/V differ for the same tokens (another
LoRA adapter: :func:`root_hash`) start from another."""


def root_hash(namespace: str) -> BlockHash:
    """The parent hash of the first block of sequences in ``namespace`` (a LoRA adapter's name): their
    blocks are never shared with other namespaces' or the base model's."""
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=b"llm_jax.root").digest()


def salted(root: BlockHash, salt: str) -> BlockHash:
    """``root``'s namespace split by ``salt`` (vLLM's ``cache_salt``): requests share cached blocks only when
    they give the same salt, so one user cannot probe the cache for another's prompts."""
    return hashlib.blake2b(root + salt.encode(), digest_size=16, person=b"llm_jax.salt").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The name of a full block: a 16-byte blake2b digest of the parent's hash and the tokens as int64.

    Stable across processes and runs (Python's ``hash`` is salted per process). The parent hash has a
    fixed length, so (parent, tokens) is encoded without ambiguity."""
    payload = parent + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(payload, digest_size=16).digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int,
                        block_size: int, root: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Extends ``hashes`` in place (the hashes of ``token_ids``' first blocks, the first block's parent
    ``root``) to its first ``num_blocks`` full blocks, hashing only the new ones; returns it."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks=} full blocks of {block_size=} need more than {len(token_ids)} tokens")
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots with reference counts, an LRU free list and the
    prefix cache (hash → block). Block ``NULL_BLOCK`` is reserved, so ``capacity`` is ``num_blocks - 1``."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be at least 2: block {NULL_BLOCK} is the reserved null block")
        if block_size < 1:
            raise ValueError(f"{block_size=} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks  # a block's name while it is cached
        self._cached: dict[BlockHash, int] = {}
        # Blocks with no references, the next one handed out first (an ordered set: O(1) removal by id).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            b for b in range(num_blocks) if b != NULL_BLOCK)
        self.queried_tokens = 0  # prefix-cache lookups of admitted requests, in tokens
        self.hit_tokens = 0  # the tokens of those lookups found cached

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never used, released, or cached with no references."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.capacity - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, in use or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.capacity

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def block_hash(self, block: int) -> BlockHash | None:
        """The block's name while it is in the prefix cache, else None."""
        return self._hashes[block]

    def eviction_order(self) -> tuple[int, ...]:
        """The free blocks, the next one handed out first."""
        return tuple(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hands out ``n`` free blocks with one reference each, evicting the cached ones from the cache."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: {len(self._free)} of {self.capacity} are free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            if (block_hash := self._hashes[block]) is not None:
                del self._cached[block_hash]
                self._hashes[block] = None
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """Takes one more reference on each block (cached blocks a new request shares)."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drops one reference on each block. A block left without references joins the free list: at the
        front if it holds nothing findable, else at the back, so the blocks given first are evicted first."""
        for block in blocks:
            if block == NULL_BLOCK or self._ref_counts[block] == 0:
                raise ValueError(f"block {block} is not held (reference count {self._ref_counts[block]})")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hashes[block] is None:
                    self._free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Makes a held block, full of computed K/V, findable by ``block_hash``. Returns False (and caches
        nothing) when caching is off or another block already holds the same tokens: the duplicate stays
        private, since a request's block table only ever grows and is never rewritten."""
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is not held: only a request's computed block can be cached")
        if not self.enable_prefix_caching or block_hash in self._cached or self._hashes[block] is not None:
            return False
        self._cached[block_hash] = block
        self._hashes[block] = block_hash
        return True

    def forget_cached(self) -> None:
        """Empties the prefix cache (the pages' contents were lost): no block is findable any more."""
        for block in self._cached.values():
            self._hashes[block] = None
        self._cached.clear()

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash] | None = None,
                           root: BlockHash = ROOT_HASH) -> list[int]:
        """The blocks holding the longest cached prefix of ``token_ids`` in whole blocks.

        Never the whole sequence: the cached prefix covers at most ``len(token_ids) - 1`` tokens, so the
        last token is always computed and gives the logits the next token is sampled from. When the tokens
        are whole blocks all cached, the whole last block is recomputed into a fresh block, rather than one
        token written into a shared block (which must never change). ``block_hashes`` may give the
        tokens' block hashes already computed (at least that many blocks); ``root``, their namespace."""
        if not self.enable_prefix_caching:
            return []
        num_blocks = max(len(token_ids) - 1, 0) // self.block_size
        if block_hashes is None:
            block_hashes = extend_block_hashes([], token_ids, num_blocks, self.block_size, root)
        blocks = []
        for block_hash in block_hashes[:num_blocks]:
            if (block := self._cached.get(block_hash)) is None:
                break
            blocks.append(block)
        return blocks

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup: ``num_tokens`` looked up, ``num_hit_tokens`` found."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens


class KVBlockManager:
    """Each request's block table over one ``BlockPool``: grows it as the request's tokens are scheduled,
    offers its blocks to the prefix cache once they are full of computed K/V, and frees it."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._tables: dict[Hashable, list[int]] = {}
        # Hashes of each request's full blocks, extended as its tokens are appended (dropped by free).
        self._hashes: dict[Hashable, list[BlockHash]] = {}
        self._num_offered: dict[Hashable, int] = {}  # leading blocks already offered to the prefix cache
        # Hashes of prompt blocks that requests hold but have not computed yet, and for each request how
        # many of its leading hashes were counted there (its prompt's full blocks when it started).
        self._computing: collections.Counter[BlockHash] = collections.Counter()
        self._num_counted: dict[Hashable, int] = {}

    def block_table(self, request_id: Hashable) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def cached_prefix(self, request_id: Hashable, token_ids: Sequence[int], root: BlockHash = ROOT_HASH) -> list[int]:
        """``BlockPool.find_cached_prefix`` for a request's tokens (in namespace ``root``), reusing the
        hashes it already computed."""
        if not self.pool.enable_prefix_caching:
            return []
        num_blocks = max(len(token_ids) - 1, 0) // self.pool.block_size
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, num_blocks, self.pool.block_size, root)
        return self.pool.find_cached_prefix(token_ids, hashes)

    def num_blocks_to_take(self, request_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> int:
        """How many free blocks ``allocate`` would use: fresh blocks plus the prefix's unreferenced blocks
        (sharing a cached block with no references takes it off the free list)."""
        table = self._tables.get(request_id, ())
        fresh = max(cdiv(num_tokens, self.pool.block_size) - len(table) - len(prefix), 0)
        return fresh + sum(self.pool.ref_count(b) == 0 for b in prefix)

    def can_allocate(self, request_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        return self.num_blocks_to_take(request_id, num_tokens, prefix) <= self.pool.num_free

    def allocate(self, request_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Grows the request's block table to hold its first ``num_tokens`` tokens, starting it with the
        cached ``prefix`` blocks (only for a request that holds none). Returns False, changing nothing,
        when the free blocks do not suffice."""
        table = self._tables.setdefault(request_id, [])
        if prefix and table:
            raise ValueError(f"request {request_id!r} already holds {len(table)} blocks: a cached prefix "
                             "can only start a block table")
        if not self.can_allocate(request_id, num_tokens, prefix):
            if not table:
                del self._tables[request_id]
            return False
        self.pool.acquire(prefix)
        table.extend(prefix)
        if request_id not in self._num_offered:  # its first allocation: the blocks it will compute
            self._num_offered[request_id] = len(prefix)
            hashes = self._hashes.get(request_id, [])
            self._computing.update(hashes[len(prefix):])
            self._num_counted[request_id] = len(hashes)
        table.extend(self.pool.allocate(max(cdiv(num_tokens, self.pool.block_size) - len(table), 0)))
        return True

    def cache_full_blocks(self, request_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int,
                          root: BlockHash = ROOT_HASH) -> None:
        """Offers the request's blocks that became full of computed K/V to the prefix cache (named in
        namespace ``root``). Call it after the step that computed them: a block is findable only once its
        K/V are written."""
        if not self.pool.enable_prefix_caching:
            return
        table = self._tables[request_id]
        num_full = min(num_computed_tokens // self.pool.block_size, len(table))
        start = self._num_offered.get(request_id, 0)
        if num_full <= start:
            return
        hashes = extend_block_hashes(self._hashes.setdefault(request_id, []), token_ids, num_full,
                                     self.pool.block_size, root)
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i])
        self._uncount(hashes, start, min(num_full, self._num_counted.get(request_id, 0)))
        self._num_offered[request_id] = num_full

    def computing(self, request_id: Hashable, block: int) -> bool:
        """Whether the ``block``-th full block of the request's tokens (hashed by ``cached_prefix``) is one
        another request holds and has yet to compute: once computed it is in the prefix cache, so a
        request waiting for it computes less."""
        hashes = self._hashes.get(request_id, ())
        return block < len(hashes) and self._computing[hashes[block]] > 0

    def _uncount(self, hashes: Sequence[BlockHash], start: int, stop: int) -> None:
        for i in range(start, stop):
            self._computing[hashes[i]] -= 1
            if not self._computing[hashes[i]]:
                del self._computing[hashes[i]]

    def free(self, request_id: Hashable) -> None:
        """Releases the request's blocks, last first (a chain's tail is evicted before its head, which
        keeps the longest prefixes findable), and forgets it. Its cached blocks stay findable."""
        self.pool.release(reversed(self._tables.pop(request_id, [])))
        hashes = self._hashes.pop(request_id, [])
        self._uncount(hashes, self._num_offered.pop(request_id, 0), self._num_counted.pop(request_id, 0))
