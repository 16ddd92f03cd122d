"""A radix tree over token ids: SGLang's RadixAttention prefix cache, beside vLLM's hash blocks
(pure Python).

vLLM (``block_manager``) finds a cached prefix by hashing full blocks; SGLang keeps every cached
sequence in a radix tree whose edges are runs of token ids and matches at any token
(``page_size=1``) or page (``page_size > 1``, SGLang's paged mode) boundary. This module is that
second design, written from SGLang's semantics (``python/sglang/srt/mem_cache/radix_cache.py``:
``match_prefix``, ``insert``, ``evict``, ``inc_lock_ref`` / ``dec_lock_ref``,
``cache_finished_req``, ``cache_unfinished_req``):

- K/V memory is ``num_pages`` pages of ``page_size`` slots. A node's edge holds its token ids
  (always whole pages) and one physical page per ``page_size`` of them.
- ``match_prefix`` walks the tree, splits the node where a match ends inside its edge, and touches
  (LRU) every node on the matched path; ``insert`` adds a page-aligned sequence and says how much
  was there.
- ``lock`` / ``unlock`` add / remove one reference on every node from a node up to its root. A
  running request locks the path it uses; ``evict`` removes only unlocked leaves, least recently
  used first, a whole node at a time (its parent may become the next leaf).
- A tenant ``salt`` selects its own root: tenants never share a node (there is no public-prefix
  sharing across salts, which vLLM's hash chain allows).

The sequence-level methods mirror ``BlockManager`` (``can_allocate``, ``allocate``, ``append``,
``fork``, ``free``, ``block_table``, ``stats``, ``check_invariants``), so the trace replay, the
scheduler and the engine run on either cache; a sequence's "block table" is its page table (one slot
per page when ``page_size=1``). Their rules:

- ``allocate`` matches at most ``n - 1`` prompt tokens (the last token's logits are needed, SGLang's
  ``max_prefix_len = input_len - 1``), rounded down to a page. It locks the match, takes pages for
  the rest and inserts the page-aligned prompt at once (register before compute, as the block
  manager: an engine step writes every new token's K/V before anyone reads), so later requests hit
  it. Prompt pages the tree already held past the capped match stay private duplicates until
  ``free``.
- Decoded tokens enter the tree when the sequence is freed (SGLang's ``cache_finished_req``): pages
  that duplicate tree pages, and the partial last page, go back to the free list.
- ``fork`` first inserts the parent (SGLang's ``cache_unfinished_req``), so parent and child share
  tree pages; a partial last page is copied for the child (copy-on-write, reported by its first
  ``append``).
- Every page is free, or owned by exactly one tree node, or private to exactly one sequence
  (``check_invariants``). Every public method either succeeds or raises with the state unchanged.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .block_manager import AppendResult, cdiv
from .block_pool import NoFreeBlocksError
from .debug import check
from .interface import NO_SCOPE, SeqState, SequenceTables, TenantScope, check_prompt, check_token
from .metrics import PrefixCacheMetrics

__all__ = ["MatchResult", "RadixCache", "RadixNode", "RadixPlan", "RadixSeq"]


class RadixNode:
    """One edge of the tree: its token ids (whole pages), their physical pages, lock count and LRU
    time."""

    __slots__ = (
        "children",
        "key",
        "last_access",
        "lock_ref",
        "node_id",
        "pages",
        "parent",
        "salt",
        "tenant",
    )

    def __init__(
        self,
        key: list[int],
        pages: list[int],
        parent: RadixNode | None,
        salt: str | None,
        tenant: Hashable = None,
        last_access: int = 0,
        node_id: int = 0,
    ) -> None:
        # token ids on the edge into this node
        self.key = key
        # one physical page per page_size tokens of key
        self.pages = pages
        # None for a root
        self.parent = parent
        # first token (page 1) or first page (tuple) -> child
        self.children: dict[Hashable, RadixNode] = {}
        # running sequences (and lock() calls) using this node or a node below it
        self.lock_ref = 0
        # logical clock of the last match or insert through this node
        self.last_access = last_access
        # the root this node hangs under
        self.salt = salt
        # who inserted it (cross-tenant accounting)
        self.tenant = tenant
        self.node_id = node_id

    def __repr__(self) -> str:
        head = self.key[:6]
        return (
            f"RadixNode(#{self.node_id}, {len(self.key)} tokens "
            f"{head}{'...' if len(self.key) > 6 else ''}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )

    def path(self) -> tuple[list[int], list[int]]:
        """Token ids and pages from the root down to the end of this node."""
        keys, pages, node = [], [], self
        while node is not None:
            keys.append(node.key)
            pages.append(node.pages)
            node = node.parent
        return [t for k in reversed(keys) for t in k], [p for ps in reversed(pages) for p in ps]

    def root(self) -> RadixNode:
        """The root this node hangs under."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node


@dataclass(slots=True, frozen=True)
class MatchResult:
    """A matched prefix: its length in tokens, its pages, and the node where it ends (the root when
    empty)."""

    length: int
    pages: list[int]
    node: RadixNode


@dataclass(slots=True, frozen=True)
class RadixPlan:
    """What ``allocate`` would do for one prompt: tokens it would hit, pages it needs, pages it can
    get."""

    tokens: tuple[int, ...]
    scope: TenantScope
    cached_tokens: int
    pages_needed: int
    # free pages + evictable pages not on the matched path
    pages_available: int
    # the cache's clock when planned: stale once anything changed
    clock: int
    # the planning cache's token
    owner: object = field(default=None, repr=False, compare=False)

    def __bool__(self) -> bool:
        return self.pages_needed <= self.pages_available

    @property
    def blocks_needed(self) -> int:
        """Pages needed (the block manager's name)."""
        return self.pages_needed


@dataclass(slots=True, kw_only=True)
class RadixSeq(SeqState):
    """A live sequence of the radix cache: also the pages only it owns and the tree node it locks.

    Its ``block_table`` is its page table; ``num_restored_tokens`` stays 0 (the radix tree has no
    second tier).
    """

    # pages of block_table that are not in the tree (written by this sequence only)
    private: set[int]
    # the deepest tree node this sequence uses; locked (with its path) while it lives
    node: RadixNode
    # (src, dst) page copy its first append reports (fork)
    pending_cow: tuple[int, int] | None = None


class RadixCache(SequenceTables):
    """A radix tree of cached token sequences over a pool of K/V pages, with locks and LRU leaf
    eviction."""

    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        *,
        model_fingerprint: str = "",
        enable_caching: bool = True,
        track_misses: bool = True,
        trace: bool = False,
    ) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        # one cache serves one model; kept for the record
        self.model_fingerprint = model_fingerprint
        self.enable_caching = enable_caching
        self.free_pages: deque[int] = deque(range(num_pages))
        # one per salt (None = no salt)
        self.roots: dict[str | None, RadixNode] = {}
        self.seqs: dict[Hashable, RadixSeq] = {}
        self.metrics = PrefixCacheMetrics()
        self.clock = 0
        # pages owned by tree nodes
        self.tree_pages = 0
        # pages of unlocked tree nodes
        self.evictable_pages = 0
        self.num_evicted_pages = 0
        self.num_evicted_nodes = 0
        self.num_splits = 0
        self._ids = itertools.count(1)
        # evictable leaves: unlocked, childless, not a root
        self._leaves: set[RadixNode] = set()
        # locks taken through lock(), not by a sequence
        self._ext_locks: Counter[RadixNode] = Counter()
        # binds a plan to this cache: another one's plan is refused
        self._plan_token = object()
        # every sequence ever inserted (page-less nodes, never evicted): tells "evicted" misses from
        # new text
        self._history: dict[str | None, RadixNode] | None = {} if track_misses else None
        # trace: one (salt, path tokens, edge tokens, last access) per evicted node
        self.evict_log: list[tuple[str | None, tuple[int, ...], int, int]] | None = (
            [] if trace else None
        )

    # --- the page pool, under the block manager's names -------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens per page (the block manager's name)."""
        return self.page_size

    @property
    def num_blocks(self) -> int:
        """Pages in the pool (the block manager's name)."""
        return self.num_pages

    @property
    def num_free_blocks(self) -> int:
        """Pages that an allocation can get: free ones plus those of unlocked (evictable) tree
        nodes."""
        return len(self.free_pages) + self.evictable_pages

    @property
    def usage(self) -> float:
        """Fraction of pages held by a live sequence (private, or on a locked path)."""
        return 1.0 - self.num_free_blocks / self.num_pages

    def evictable_size(self) -> int:
        """Tokens in unlocked tree nodes."""
        return self.evictable_pages * self.page_size

    def protected_size(self) -> int:
        """Tokens in locked tree nodes."""
        return (self.tree_pages - self.evictable_pages) * self.page_size

    def total_size(self) -> int:
        """Tokens held by the tree."""
        return self.tree_pages * self.page_size

    def num_nodes(self) -> int:
        """Tree nodes, roots excluded."""
        return sum(1 for root in self.roots.values() for _ in self._subtree(root)) - len(self.roots)

    # --- tree internals ---------------------------------------------------------------------------
    def _ck(self, tokens: Sequence[int], pos: int = 0) -> Hashable:
        """A child's key in its parent: its first token, or its first page."""
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])

    def _common(self, key: list[int], tokens: list[int], pos: int, limit: int) -> int:
        """Length of the common prefix of ``key`` and ``tokens[pos:limit]``, rounded down to a
        page."""
        n = min(len(key), limit - pos)
        seg = tokens[pos : pos + n]
        if (key if n == len(key) else key[:n]) == seg:
            m = n
        # binary search on slice equality: a few C-level comparisons instead of a Python loop
        else:
            lo, hi = 0, n - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if key[:mid] == seg[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo
        return m - m % self.page_size

    def _walk(
        self,
        root: RadixNode,
        tokens: list[int],
        limit: int,
        split: bool,
        touch: bool,
        account: bool = True,
    ) -> tuple[int, list[int], RadixNode, list[tuple[RadixNode, int]]]:
        """Match ``tokens[:limit]`` from ``root``: (length, pages, last node, [(node, tokens matched
        in it)]).

        With ``split`` a match ending inside an edge splits that node, so the last node ends exactly
        at the match; without it the last node is the last one matched whole.
        """
        node, pos, pages, visited, size = root, 0, [], [], self.page_size
        while limit - pos >= size:
            child = node.children.get(self._ck(tokens, pos))
            if child is None:
                break
            m = self._common(child.key, tokens, pos, limit)
            if m == 0:
                break
            if m < len(child.key):
                if not split:
                    pages.extend(child.pages[: m // size])
                    visited.append((child, m))
                    pos += m
                    break
                child = self._split(child, m, account)
            pages.extend(child.pages)
            visited.append((child, m))
            pos += m
            node = child
        if touch:
            for v, _ in visited:
                v.last_access = self.clock
        return pos, pages, node, visited

    def _split(self, child: RadixNode, m: int, account: bool = True) -> RadixNode:
        """Cut ``child``'s edge after ``m`` tokens: a new upper node, ``child`` keeps the rest (and
        its id)."""
        size = self.page_size
        upper = RadixNode(
            child.key[:m],
            child.pages[: m // size],
            child.parent,
            child.salt,
            child.tenant,
            child.last_access,
            next(self._ids),
        )
        # every lock below passes through both parts
        upper.lock_ref = child.lock_ref
        child.parent.children[self._ck(upper.key)] = upper
        child.key, child.pages, child.parent = child.key[m:], child.pages[m // size :], upper
        upper.children[self._ck(child.key)] = child
        if account:
            self.num_splits += 1
        return upper

    def _add_leaf(
        self,
        parent: RadixNode,
        key: list[int],
        pages: list[int],
        tenant: Hashable,
        account: bool = True,
    ) -> RadixNode:
        leaf = RadixNode(key, pages, parent, parent.salt, tenant, self.clock, next(self._ids))
        parent.children[self._ck(key)] = leaf
        if account:
            self._leaves.discard(parent)
            self._leaves.add(leaf)
            self.tree_pages += len(pages)
            self.evictable_pages += len(pages)
        return leaf

    def _insert(
        self,
        root: RadixNode,
        tokens: list[int],
        pages: list[int],
        tenant: Hashable,
        account: bool = True,
    ) -> tuple[int, list[int], RadixNode]:
        """Insert page-aligned ``tokens`` with their ``pages``: (tokens already there, their pages,
        last node)."""
        k, existing, node, _ = self._walk(
            root, tokens, len(tokens), split=True, touch=True, account=account
        )
        if k < len(tokens):
            node = self._add_leaf(
                node, tokens[k:], pages[k // self.page_size :] if account else [], tenant, account
            )
        return k, existing, node

    def _lock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def _unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    def _subtree(self, node: RadixNode):
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _detach(self, node: RadixNode, evicted: bool) -> None:
        """Remove an unlocked node and everything below it from the tree; their pages become
        free."""
        for n in list(self._subtree(node)):
            self._leaves.discard(n)
            self.free_pages.extend(n.pages)
            self.tree_pages -= len(n.pages)
            self.evictable_pages -= len(n.pages)
            if evicted:
                self.num_evicted_pages += len(n.pages)
                self.num_evicted_nodes += 1
                if self.evict_log is not None:
                    self.evict_log.append((n.salt, tuple(n.path()[0]), len(n.key), n.last_access))
        parent = node.parent
        del parent.children[self._ck(node.key)]
        # a detached node is no node of this tree (lock() refuses it)
        node.parent = None
        if parent.parent is not None and parent.lock_ref == 0 and not parent.children:
            self._leaves.add(parent)

    def _take(self, k: int) -> list[int]:
        """``k`` free pages, evicting LRU leaves first if the free list is short."""
        if len(self.free_pages) < k:
            self._evict(k - len(self.free_pages))
        if len(self.free_pages) < k:
            raise NoFreeBlocksError(
                f"need {k} pages, {len(self.free_pages)} free and nothing left to evict"
            )
        return [self.free_pages.popleft() for _ in range(k)]

    def _root(self, salt: str | None) -> RadixNode:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = RadixNode([], [], None, salt, node_id=next(self._ids))
            # never evicted (SGLang's root_node.lock_ref = 1)
            root.lock_ref = 1
        return root

    def _history_insert(self, salt: str | None, tokens: list[int]) -> None:
        if self._history is not None and tokens:
            root = self._history.get(salt)
            if root is None:
                root = self._history[salt] = RadixNode([], [], None, salt)
            self._insert(root, tokens, [], None, account=False)

    def _history_match(self, salt: str | None, tokens: list[int], limit: int) -> int:
        root = None if self._history is None else self._history.get(salt)
        return (
            0
            if root is None
            else self._walk(root, tokens, limit, split=False, touch=False, account=False)[0]
        )

    def _check_tokens(self, token_ids: Sequence[int], what: str = "a prompt") -> list[int]:
        # the block manager's check, so lookups time alike
        return check_prompt(token_ids, NO_SCOPE, what)

    def _check_salt(self, salt: str | None) -> None:
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"salt must be a str or None, got {type(salt).__name__}")

    def _check_node(self, node: RadixNode) -> None:
        if (
            not isinstance(node, RadixNode)
            or node.parent is None
            or self.roots.get(node.salt) is not node.root()
        ):
            raise ValueError(f"{node!r} is not a node of this tree (or is a root)")

    # --- the tree API (SGLang's names) ------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> MatchResult:
        """The longest cached prefix, whole pages only; splits the node it ends in and touches its
        path."""
        tokens = self._check_tokens(token_ids, "a key")
        self._check_salt(salt)
        self.clock += 1
        root = self.roots.get(salt)
        if root is None:
            return MatchResult(0, [], self._root(salt))
        m, pages, node, _ = self._walk(root, tokens, len(tokens), split=True, touch=True)
        return MatchResult(m, pages, node)

    def insert(
        self, token_ids: Sequence[int], salt: str | None = None, tenant: Hashable = None
    ) -> int:
        """Cache ``token_ids`` (cut to whole pages), taking pages for the new part; return tokens
        already cached."""
        tokens = self._check_tokens(token_ids, "a key")
        self._check_salt(salt)
        size = self.page_size
        tokens = tokens[: len(tokens) // size * size]
        k, visited = 0, []
        if salt in self.roots:
            k, _, _, visited = self._walk(
                self.roots[salt], tokens, len(tokens), split=False, touch=False
            )
        needed = (len(tokens) - k) // size
        unlocked = sum(m // size for v, m in visited if v.lock_ref == 0)
        if needed > len(self.free_pages) + self.evictable_pages - unlocked:
            raise NoFreeBlocksError(
                f"inserting {len(tokens) - k} new tokens needs {needed} pages, "
                f"{len(self.free_pages) + self.evictable_pages - unlocked} can be freed"
            )
        self.clock += 1
        root = self._root(salt)
        k, _, node, _ = self._walk(root, tokens, len(tokens), split=True, touch=True)
        # evicting for the new pages must not take the path we extend
        self._lock(node)
        pages = self._take(needed)
        self._unlock(node)
        self._insert(root, tokens, [0] * (k // size) + pages, tenant)
        self._history_insert(salt, tokens)
        return k

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its path to the root from eviction (one reference each)."""
        self._check_node(node)
        self.clock += 1
        self._ext_locks[node] += 1
        self._lock(node)

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference taken with ``lock(node)``."""
        self._check_node(node)
        if self._ext_locks[node] <= 0:
            self._ext_locks.pop(node, None)
            raise ValueError(f"{node!r} holds no lock taken with lock()")
        self.clock += 1
        self._ext_locks[node] -= 1
        if not self._ext_locks[node]:
            del self._ext_locks[node]
        self._unlock(node)

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages by removing unlocked leaves, least recently used first.

        A leaf goes whole (so more pages than asked may be freed); a parent left childless and
        unlocked joins the candidates. Returns the pages freed (fewer if every other page is
        locked).
        """
        if type(num_pages) is not int or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        # a mutation like any other: a plan made before it is stale
        self.clock += 1
        return self._evict(num_pages)

    def _evict(self, num_pages: int) -> int:
        heap = [(n.last_access, n.node_id, n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._detach(node, evicted=True)
            freed += len(node.pages)
            if parent in self._leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def resident(self) -> list[tuple[str | None, tuple[int, ...]]]:
        """Every cached sequence (root-to-leaf path) with its salt."""
        return [
            (salt, tuple(n.path()[0]))
            for salt, root in self.roots.items()
            for n in self._subtree(root)
            if n is not root and not n.children
        ]

    def dump(self, max_tokens: int = 8, show=str) -> str:
        """The tree as indented text: tokens of each edge (``show`` maps ids to text), lock count,
        last access."""
        lines = []

        def rec(node: RadixNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.node_id):
                head = " ".join(show(t) for t in child.key[:max_tokens])
                more = f" … (+{len(child.key) - max_tokens})" if len(child.key) > max_tokens else ""
                lines.append(
                    f"{'  ' * depth}[{len(child.key)}] {head}{more}   lock={child.lock_ref} "
                    f"t={child.last_access}"
                )
                rec(child, depth + 1)

        for salt, root in self.roots.items():
            lines.append(f"root salt={salt!r}")
            rec(root, 1)
        return "\n".join(lines)

    # --- the sequence API (the block manager's names) ---------------------------------------------
    def wasted_slots(self) -> int:
        """Empty slots in the partial last pages of live sequences."""
        return sum(-len(s.token_ids) % self.page_size for s in self.seqs.values())

    def stats(self) -> dict:
        """The block manager's metrics plus the tree's: nodes, cached tokens, splits, evicted pages
        and nodes."""
        return {
            **self.metrics.as_dict(),
            "usage": self.usage,
            "num_free_blocks": self.num_free_blocks,
            "num_cached_blocks": self.tree_pages,
            "evictions": self.num_evicted_pages,
            "wasted_slots": self.wasted_slots(),
            "tree_nodes": self.num_nodes(),
            "tree_tokens": self.total_size(),
            "splits": self.num_splits,
            "evicted_nodes": self.num_evicted_nodes,
            "evicted_tokens": self.num_evicted_pages * self.page_size,
        }

    def _check_prompt(self, token_ids: Sequence[int], scope: TenantScope) -> list[int]:
        tokens = check_prompt(token_ids, scope)
        if scope.cache_salt is not None and scope.public_tokens:
            raise ValueError(
                "the radix cache keeps each salt in its own tree: a public prefix cannot be shared "
                "across salts (the block manager can)"
            )
        return tokens

    def can_allocate(self, token_ids: Sequence[int], scope: TenantScope = NO_SCOPE) -> RadixPlan:
        """What ``allocate`` would do, changing nothing: a plan that is truthy when enough pages can
        be had."""
        tokens = self._check_prompt(token_ids, scope)
        n, size = len(tokens), self.page_size
        m, unlocked = 0, 0
        root = self.roots.get(scope.cache_salt)
        if self.enable_caching and root is not None:
            m, _, _, visited = self._walk(
                root, tokens, (n - 1) // size * size, split=False, touch=False
            )
            # locking them takes them off the table
            unlocked = sum(c // size for v, c in visited if v.lock_ref == 0)
        available = len(self.free_pages) + self.evictable_pages - unlocked
        return RadixPlan(
            tuple(tokens),
            scope,
            m,
            cdiv(n, size) - m // size,
            available,
            self.clock,
            self._plan_token,
        )

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        scope: TenantScope = NO_SCOPE,
        *,
        plan: RadixPlan | None = None,
        preempted: bool = False,
    ) -> int:
        """Give a new sequence its pages, reusing the longest cached prefix (< n tokens); return
        cached tokens."""
        self._check_new(seq_id)
        if plan is not None and (
            not isinstance(plan, RadixPlan) or plan.owner is not self._plan_token
        ):
            raise ValueError(
                "this plan was not made by this cache's can_allocate (plans do not travel between "
                "caches: another tree's pages are not this one's)"
            )
        if (
            plan is None
            or plan.clock != self.clock
            or plan.scope != scope
            or plan.tokens != tuple(token_ids)
        ):
            plan = self.can_allocate(token_ids, scope)
        if not plan:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {plan.pages_needed} pages, "
                f"{plan.pages_available} of {self.num_pages} can be had"
            )
        tokens, size = list(plan.tokens), self.page_size
        n, salt, tenant = len(tokens), scope.cache_salt, scope.label
        cap = (n - 1) // size * size
        self.clock += 1
        root = self._root(salt)
        m, hits, node = 0, [], root
        if self.enable_caching:
            m, hits, node, visited = self._walk(root, tokens, cap, split=True, touch=True)
            self.metrics.cross_tenant_hits += sum(
                len(v.pages) for v, _ in visited if v.tenant != tenant
            )
            seen = max(m, min(self._history_match(salt, tokens, cap), cap))
            misses = {"short": n - cap, "no_prefix": cap - seen, "evicted": seen - m}
        else:
            misses = {"short": n - cap, "no_prefix": cap, "evicted": 0}
        self._lock(node)
        try:
            new = self._take(cdiv(n, size) - len(hits))
        # cannot happen with a current plan; never leave the path locked
        except NoFreeBlocksError:
            self._unlock(node)
            raise
        seq = RadixSeq(seq_id, tokens, hits + new, salt, tenant, m, private=set(new), node=node)
        if self.enable_caching:
            self._adopt(seq, n // size * size)
        self.seqs[seq_id] = seq
        self.metrics.blocks_hit += len(hits)
        self.metrics.blocks_taken += len(new)
        self.metrics.record_lookup(tenant, n, m, misses, preempted)
        return m

    def _adopt(self, seq: RadixSeq, length: int) -> tuple[int, list[int]]:
        """Insert the sequence's first ``length`` tokens with its pages; lock the new path instead
        of the old."""
        size = self.page_size
        k, existing, last = self._insert(
            self._root(seq.cache_salt),
            seq.token_ids[:length],
            seq.block_table[: length // size],
            seq.tenant,
        )
        # now the tree's
        seq.private.difference_update(seq.block_table[k // size : length // size])
        self._history_insert(seq.cache_salt, seq.token_ids[:length])
        if last is not seq.node:
            self._lock(last)
            self._unlock(seq.node)
            seq.node = last
        return k, existing

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether the next ``append`` can get the page it may need."""
        seq = self._seq(seq_id)
        return len(seq.token_ids) % self.page_size != 0 or self.num_free_blocks > 0

    def append(self, seq_id: Hashable, token_id: int) -> AppendResult:
        """Write one decoded token: take a page when the last is full (evicting an LRU leaf if
        needed)."""
        seq = self._seq(seq_id)
        check_token(token_id)
        if not self.can_append(seq_id):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs a page and none can be had")
        self.clock += 1
        new_page = None
        if len(seq.token_ids) % self.page_size == 0:
            (new_page,) = self._take(1)
            seq.block_table.append(new_page)
            seq.private.add(new_page)
        seq.token_ids.append(token_id)
        cow, seq.pending_cow = seq.pending_cow, None
        return AppendResult(new_page, cow)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id``: the parent's whole pages enter the tree
        and are shared.

        The parent's pages that duplicate tree pages are swapped for the tree's and freed (SGLang's
        ``cache_unfinished_req``); a partial last page is copied for the child, and the child's
        first ``append`` reports the ``(src, dst)`` copy.
        """
        parent = self._seq(parent_id)
        self._check_new(child_id)
        size, n = self.page_size, len(parent.token_ids)
        length, tail = n // size * size, n % size != 0
        if tail:
            _, _, _, visited = self._walk(
                self._root(parent.cache_salt), parent.token_ids, length, split=False, touch=False
            )
            unlocked = sum(c // size for v, c in visited if v.lock_ref == 0)
            if len(self.free_pages) + self.evictable_pages - unlocked < 1:
                raise NoFreeBlocksError(
                    f"forking {parent_id!r} needs a page for its partial last page; none can be had"
                )
        self.clock += 1
        k, existing = self._adopt(parent, length)
        for i in range(k // size):
            page = parent.block_table[i]
            if page in parent.private:
                parent.private.discard(page)
                self.free_pages.append(page)
                parent.block_table[i] = existing[i]
        child = RadixSeq(
            child_id,
            list(parent.token_ids),
            parent.block_table[: length // size],
            parent.cache_salt,
            parent.tenant,
            parent.num_cached_tokens,
            private=set(),
            node=parent.node,
        )
        self._lock(parent.node)
        if tail:
            (copy,) = self._take(1)
            child.block_table.append(copy)
            child.private.add(copy)
            child.pending_cow = (parent.block_table[-1], copy)
            self.metrics.cow_copies += 1
        self.seqs[child_id] = child

    def free(self, seq_id: Hashable, uncache_from: int | None = None) -> None:
        """Cache a finished sequence's whole pages in the tree, free the rest, unlock its path.

        ``uncache_from``: the K/V of the positions from there on was never computed (an engine step
        failed). The tree pages this sequence contributed from there on leave the tree, with
        everything below them; nothing there may be locked by another sequence (free that one
        first).
        """
        seq = self._seq(seq_id)
        size = self.page_size
        cut = None
        if uncache_from is not None:
            if type(uncache_from) is not int or not 0 <= uncache_from <= len(seq.token_ids):
                raise ValueError(
                    f"uncache_from must be an int in [0, {len(seq.token_ids)}], got "
                    f"{uncache_from!r}"
                )
            cut = self._uncache_point(seq, uncache_from)
        self.clock += 1
        if cut is not None:
            self._unlock(seq.node)
            node, offset = cut
            if offset:
                # node keeps the part from the cut on
                self._split(node, offset)
            self._detach(node, evicted=False)
        elif uncache_from is None and self.enable_caching:
            # cache_finished_req; its duplicates stay private
            self._adopt(seq, len(seq.token_ids) // size * size)
            self._unlock(seq.node)
        else:
            self._unlock(seq.node)
        self.free_pages.extend(p for p in reversed(seq.block_table) if p in seq.private)
        del self.seqs[seq_id]

    def _uncache_point(self, seq: RadixSeq, position: int) -> tuple[RadixNode, int] | None:
        """Where the tree pages this sequence contributed from ``position`` on start: (node, offset
        in its edge)."""
        size = self.page_size
        path_pages = seq.node.path()[1]
        first = next(
            (
                i
                for i in range(position // size, len(path_pages))
                if seq.block_table[i] == path_pages[i] and seq.block_table[i] not in seq.private
            ),
            None,
        )
        if first is None:
            return None
        node, depth = seq.node, len(seq.node.path()[0])
        while depth - len(node.key) > first * size:
            depth -= len(node.key)
            node = node.parent
        if node.lock_ref != 1:
            raise ValueError(
                f"page {seq.block_table[first]} (positions from {first * size} on) is still used "
                "by "
                "another sequence: free that sequence first"
            )
        return node, first * size - (depth - len(node.key))

    # --- invariants -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless tree, locks, LRU times, leaves, page ownership and tables
        agree."""
        size, owner = self.page_size, {}

        def claim(page: int, who: str) -> None:
            check(
                type(page) is int and 0 <= page < self.num_pages,
                f"{who}: {page!r} is not a page of the pool",
            )
            check(page not in owner, f"page {page} owned by {owner.get(page)} and by {who}")
            owner[page] = who

        for page in self.free_pages:
            claim(page, "the free list")
        seq_locks = Counter(s.node for s in self.seqs.values())
        leaves, tree_pages, evictable = set(), 0, 0
        for salt, root in self.roots.items():
            check(
                root.parent is None and not root.key and not root.pages and root.salt == salt,
                f"root of salt {salt!r} is malformed",
            )
            for node in self._subtree(root):
                below = 0
                for ck, child in node.children.items():
                    check(child.parent is node, f"{child!r} does not point back to its parent")
                    check(ck == self._ck(child.key), f"{child!r} is filed under the wrong key")
                    check(child.salt == salt, f"{child!r} hangs under another salt's root")
                    check(
                        node is root or child.last_access <= node.last_access,
                        f"{child!r} was used more recently than its parent (LRU would evict the "
                        "parent first)",
                    )
                    below += child.lock_ref
                if node is root:
                    continue
                check(
                    len(node.key) > 0
                    and len(node.key) % size == 0
                    and len(node.pages) == len(node.key) // size,
                    f"{node!r}: an edge must be whole pages with one physical page each",
                )
                check(
                    node.lock_ref == seq_locks[node] + self._ext_locks[node] + below,
                    f"{node!r}: lock_ref {node.lock_ref} but {seq_locks[node]} sequences, "
                    f"{self._ext_locks[node]} lock() calls and {below} from below",
                )
                for page in node.pages:
                    claim(page, f"tree node #{node.node_id}")
                tree_pages += len(node.pages)
                if node.lock_ref == 0:
                    evictable += len(node.pages)
                    if not node.children:
                        leaves.add(node)
        check(
            tree_pages == self.tree_pages,
            f"tree holds {tree_pages} pages, counted {self.tree_pages}",
        )
        check(
            evictable == self.evictable_pages,
            f"{evictable} evictable pages, counted {self.evictable_pages}",
        )
        check(leaves == self._leaves, "the evictable-leaf set is stale")
        for node in self._ext_locks:
            check(
                self.roots.get(node.salt) is node.root(),
                f"lock() holds {node!r}, which left the tree",
            )
        for seq in self.seqs.values():
            n = len(seq.token_ids)
            check(
                len(seq.block_table) == cdiv(n, size),
                f"sequence {seq.seq_id!r}: {len(seq.block_table)} pages for {n} tokens",
            )
            check(
                self.roots.get(seq.cache_salt) is seq.node.root(),
                f"sequence {seq.seq_id!r} locks a node outside its salt's tree",
            )
            path_tokens, path_pages = seq.node.path()
            check(
                path_tokens == seq.token_ids[: len(path_tokens)],
                f"sequence {seq.seq_id!r} locks a path that spells other tokens than its own",
            )
            check(
                seq.private <= set(seq.block_table),
                f"sequence {seq.seq_id!r} owns pages outside its table",
            )
            for i, page in enumerate(seq.block_table):
                if page in seq.private:
                    claim(page, f"sequence {seq.seq_id!r}")
                else:
                    check(
                        i < len(path_pages) and path_pages[i] == page,
                        f"sequence {seq.seq_id!r}: page {i} is neither its own nor on its locked "
                        "path",
                    )
            if seq.pending_cow is not None:
                check(
                    seq.pending_cow[1] == seq.block_table[-1] and seq.pending_cow[1] in seq.private,
                    f"sequence {seq.seq_id!r}: its pending copy is not its own last page",
                )
        check(
            len(owner) == self.num_pages,
            f"{self.num_pages - len(owner)} pages are neither free, cached nor held (leak)",
        )
