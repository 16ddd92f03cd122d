"""A cache-aware router for a fleet of engine replicas, fed only by their KV events.

``KVIndex`` is the router's picture of the fleet's caches: which replica holds which block hash
(with the parent links), built *only* from the ``EventBatch`` stream each replica publishes
(``kvlab.cache.kv_events``), never by looking into a replica. Stores and removals are counted per
hash, because a replica may cache the same hash twice. The batches' sequence numbers guard the
index: a duplicate is dropped; after a lost batch or a restart the replica's part is cleared and the
replica is *stale* (routed as if it cached nothing) until its stream resets its cache or a snapshot
resyncs it.

``Router.route`` picks a replica for a request by one of these policies:

- ``round_robin``: replicas in turn; blind to the cache and to load.
- ``least_loaded``: the replica with the fewest requests in flight (as the router counts them).
- ``session_affinity``: a consistent hash ring of the session id (64 virtual nodes per replica), so
  a conversation sticks to one replica and removing a replica moves only its own sessions.
- ``prefix_tree``: SGLang's cache-aware router: an approximate prefix tree, built router-side from
  the prompts it routed (it never hears about evictions). If the best replica matches more than
  ``prefix_threshold`` of the prompt, go there; otherwise to the replica with the smallest tree (the
  least cached, as far as the router knows), which spreads new prefixes over the fleet. When the
  fleet is out of balance (max - min in flight > ``balance_abs`` and max > ``balance_rel`` x min) it
  routes by load alone.
- ``kv_aware``: NVIDIA Dynamo's KV router cost: ``weight x blocks to prefill + active blocks`` per
  replica, lowest wins. Blocks to prefill = the prompt's blocks minus the longest prefix the index
  says the replica holds; active blocks = the blocks of the requests in flight there. ``weight``
  trades hit rate (large) against balance (small).
- ``pull`` (not in ``POLICIES``, which are notebook 09's; ``ALL_POLICIES`` has it): route for load
  (fewest active blocks; ties to the longer cached prefix), then *pull the cache*: ``pull_plan``
  names the replica that holds a longer prefix of the prompt, and the driver has the chosen replica
  fetch those blocks from it (``kvlab.engine.offload``) instead of recomputing them. Mooncake /
  Dynamo move K/V between workers this way.

The index keeps the tiers apart by the events' ``medium``: ``blocks`` is the device pool ("GPU",
what ``overlap`` reads), ``host`` the host tier ("CPU", ``kvlab.cache.host_tier``).

The router hashes a prompt exactly as a replica's block manager does (``kvlab.cache.hashing.
prompt_block_hashes``: same block size, model fingerprint and salt), so its hashes meet the
replicas'. Ties break towards the lower replica id, so a run is deterministic.

References: NVIDIA Dynamo ``lib/llm/src/kv_router`` (indexer, scheduler cost
``overlap_score_weight``); Ray Serve LLM ``PrefixCacheAffinityRouter`` / KV-aware routing; SGLang
``sgl-router`` (cache-aware policy: ``cache_threshold``, ``balance_abs_threshold``,
``balance_rel_threshold``); vLLM production-stack router.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..cache.block_manager import cdiv
from ..cache.hashing import BlockHash, prompt_block_hashes
from ..cache.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = [
    "ALL_POLICIES",
    "POLICIES",
    "HashRing",
    "KVIndex",
    "PrefixTree",
    "RouteRequest",
    "Router",
]

POLICIES = ("round_robin", "least_loaded", "session_affinity", "prefix_tree", "kv_aware")
# pull needs replicas that can export and stage blocks (a host tier)
ALL_POLICIES = (*POLICIES, "pull")


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """What the router sees of a request: id, prompt token ids, session, new tokens, cache salt."""

    request_id: Hashable
    token_ids: tuple[int, ...]
    session: Hashable = None
    max_tokens: int = 16
    cache_salt: str | None = None


class KVIndex:
    """Replica -> cached block hashes (with counts), learnt only from KV events.

    Each replica numbers its batches 0, 1, 2, ... A batch with a number it already sent (or older)
    is a duplicate and is dropped. A gap (a lost batch) or a restart (a batch numbered 0 again; a
    re-sent first batch looks the same and is handled the same way, which is safe) makes the index
    unsure of that replica: its part is cleared (``AllBlocksCleared`` semantics) and it is marked
    ``stale``. A stale replica's overlap is 0, so no policy routes on what its index says. The index
    keeps filling from its later events, and the replica leaves ``stale`` at the first point from
    which the index is exact again: an ``AllBlocksCleared`` in a batch newer than any seen (its
    cache was reset), or a full snapshot fed with ``resync`` (what the replica caches after batch
    ``seq``). The index learns of a restart from the restarted replica's first batch; if that batch
    is lost, its next ones look like duplicates (no epoch in ``EventBatch`` tells them apart), so a
    fleet that restarts a replica should also call ``Router.remove_replica`` / ``add_replica``, as
    ``run_fleet`` does.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, Counter] = {}  # replica -> hash -> times stored minus times removed
        self.host: dict[int, Counter] = {}  # the same for the host tier (events with medium "CPU")
        # hash -> parent hash, while some replica holds it
        self.parent: dict[BlockHash, BlockHash | None] = {}
        # hash -> replicas x copies holding it (to prune ``parent``)
        self._holders: Counter = Counter()
        self.last_seq: dict[int, int] = {}
        # replicas whose index is unsure: routed as if they cached nothing
        self.stale: set[int] = set()
        self.gaps = 0  # batches that arrived after a lost one (a jump in the sequence numbers)
        self.restarts = 0  # batches numbered 0 from a replica that had sent batches before
        self.duplicates = 0  # batches dropped: their number was already seen (or older)
        self.num_events = 0

    def apply(self, replica: int, batch: EventBatch) -> None:
        """Apply one replica's event batch: in order; a duplicate is dropped, a gap or restart marks
        it stale."""
        last = self.last_seq.get(replica)
        restart = last is not None and batch.seq == 0
        if last is not None:
            if 0 < batch.seq <= last:
                self.duplicates += 1
                return
            if restart:
                self.restarts += 1
                self._mark_stale(replica)
            elif batch.seq > last + 1:
                self.gaps += 1
                self._mark_stale(replica)
        self.last_seq[replica] = batch.seq
        held = self.blocks.setdefault(replica, Counter())
        for ev in batch.events:
            self.num_events += 1
            # the host tier
            if not isinstance(ev, AllBlocksCleared) and ev.medium not in (None, MEDIUM_GPU):
                tier = self.host.setdefault(replica, Counter())
                for h in ev.block_hashes:
                    tier[h] += 1 if isinstance(ev, BlockStored) else -(tier[h] > 0)
                    if tier[h] <= 0:
                        del tier[h]
                continue
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    held[h] += 1
                    self._holders[h] += 1
                    self.parent[h] = parent
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if held[h] > 0:
                        self._drop(held, h, 1)
            elif isinstance(ev, AllBlocksCleared):
                # the replica's cache is empty now: exact from here on
                self.drop_replica(replica, forget_seq=False)
                held = self.blocks.setdefault(replica, Counter())
        # a batch 0 may be an old one sent again: even its reset does not make the index sure
        if restart:
            self.stale.add(replica)

    def _mark_stale(self, replica: int) -> None:
        self.drop_replica(replica, forget_seq=False)
        self.stale.add(replica)

    def resync(
        self, replica: int, hashes: Mapping[BlockHash, int] | Iterable[BlockHash], seq: int
    ) -> None:
        """Replace a replica's part with a full snapshot (hash -> copies, or hashes) taken after its
        batch ``seq``."""
        if type(seq) is not int or seq < 0:
            raise ValueError(f"seq must be an int >= 0, got {seq!r}")
        counts = Counter(hashes) if not isinstance(hashes, Mapping) else Counter(dict(hashes))
        if any(type(n) is not int or n <= 0 for n in counts.values()):
            raise ValueError("a snapshot's copy counts must be ints > 0")
        self.drop_replica(replica)
        held = self.blocks[replica] = Counter()
        for h, n in counts.items():
            held[h] += n
            self._holders[h] += n
            self.parent.setdefault(h, None)  # a snapshot has no parent links
        self.last_seq[replica] = seq

    def _drop(self, held: Counter, h: BlockHash, n: int) -> None:
        held[h] -= n
        if held[h] <= 0:
            del held[h]
        self._holders[h] -= n
        if self._holders[h] <= 0:
            del self._holders[h]
            self.parent.pop(h, None)

    def drop_replica(self, replica: int, forget_seq: bool = True) -> None:
        """Forget everything a replica held (it restarted or left the fleet); it is no longer
        stale."""
        self.host.pop(replica, None)
        held = self.blocks.pop(replica, Counter())
        for h, n in list(held.items()):
            self._drop(held, h, n)
        self.stale.discard(replica)
        if forget_seq:
            self.last_seq.pop(replica, None)

    def hashes(self, replica: int) -> set[BlockHash]:
        """The block hashes the index says ``replica`` caches (while stale: only those stored
        since)."""
        return set(self.blocks.get(replica, ()))

    def overlap(self, replica: int, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the replica holds (stops at the first miss; 0 while
        stale)."""
        if replica in self.stale:
            return 0
        held = self.blocks.get(replica, {})
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def num_blocks(self, replica: int) -> int:
        """Distinct hashes held by ``replica``."""
        return len(self.blocks.get(replica, ()))


class HashRing:
    """Consistent hashing of keys onto replicas, ``vnodes`` points per replica."""

    def __init__(self, replicas: Sequence[int] = (), vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._points: list[tuple[int, int]] = []
        for r in replicas:
            self.add(r)

    @staticmethod
    def _h(text: str) -> int:
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")

    def add(self, replica: int) -> None:
        """Put ``vnodes`` points of ``replica`` on the ring."""
        for v in range(self.vnodes):
            bisect.insort(self._points, (self._h(f"replica-{replica}-{v}"), replica))

    def remove(self, replica: int) -> None:
        """Take a replica's points off the ring (only its keys move)."""
        self._points = [p for p in self._points if p[1] != replica]

    def get(self, key: Hashable) -> int:
        """The replica owning ``key``: the first point clockwise from the key's hash."""
        if not self._points:
            raise LookupError("the ring is empty")
        i = bisect.bisect(self._points, (self._h(repr(key)), -1))
        return self._points[i % len(self._points)][1]


@dataclass
class _Node:
    children: dict = field(default_factory=dict)
    replicas: set = field(default_factory=set)


class PrefixTree:
    """SGLang-style approximate tree of routed prompts, in chunks of ``chunk`` tokens, tagged by
    replica."""

    def __init__(self, chunk: int = 16) -> None:
        self.chunk = chunk
        self.root = _Node()
        # replica -> chunks inserted for it (SGLang's tree size per worker)
        self.size: Counter = Counter()

    def _chunks(self, tokens: Sequence[int]):
        c = self.chunk
        for i in range(len(tokens) // c):
            yield tuple(tokens[i * c : (i + 1) * c])

    def insert(self, tokens: Sequence[int], replica: int) -> None:
        """Record that ``replica`` got this prompt (it will cache it, as far as the router
        knows)."""
        node = self.root
        for key in self._chunks(tokens):
            node = node.children.setdefault(key, _Node())
            if replica not in node.replicas:
                node.replicas.add(replica)
                self.size[replica] += 1

    def match(self, tokens: Sequence[int]) -> dict[int, int]:
        """Replica -> matched prefix tokens of ``tokens``, as the tree remembers it."""
        node, depth, best = self.root, 0, {}
        for key in self._chunks(tokens):
            node = node.children.get(key)
            if node is None:
                break
            depth += self.chunk
            for r in node.replicas:
                best[r] = depth
        return best

    def remove_replica(self, replica: int) -> None:
        """Forget a replica everywhere in the tree."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.replicas.discard(replica)
            stack.extend(node.children.values())
        self.size.pop(replica, None)


class Router:
    """Routes requests to replicas by ``policy``; its cache view comes only from
    ``apply_events``."""

    def __init__(
        self,
        policy: str | Callable,
        replicas: Sequence[int],
        block_size: int,
        *,
        model_fingerprint: str = "",
        weight: float = 1.0,
        prefix_threshold: float = 0.5,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
        vnodes: int = 64,
    ) -> None:
        if not callable(policy) and policy not in ALL_POLICIES:
            raise ValueError(
                f"policy must be one of {ALL_POLICIES} or a function (router, request) -> replica, "
                f"got {policy!r}"
            )
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.policy, self.block_size, self.model_fingerprint = policy, block_size, model_fingerprint
        self.weight, self.prefix_threshold = weight, prefix_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.replicas: list[int] = sorted(replicas)
        self.index = KVIndex()
        self.ring = HashRing(self.replicas, vnodes)
        self.tree = PrefixTree(block_size)
        # replica -> rid -> blocks
        self.inflight: dict[int, dict[Hashable, int]] = {r: {} for r in self.replicas}
        self._rr = itertools.count()
        # per replica, for the last routed request (kv_aware)
        self.last_overlap: dict[int, int] = {}

    # --- fleet membership and feedback ------------------------------------------------------------
    def add_replica(self, replica: int) -> None:
        """A replica joins (or rejoins, with an empty cache)."""
        if replica not in self.replicas:
            self.replicas = sorted([*self.replicas, replica])
            self.ring.add(replica)
            self.inflight[replica] = {}

    def remove_replica(self, replica: int) -> None:
        """A replica left (failed): drop its index entries, its ring points, its tree tags, its
        load."""
        self.replicas = [r for r in self.replicas if r != replica]
        self.ring.remove(replica)
        self.tree.remove_replica(replica)
        self.index.drop_replica(replica)
        self.inflight.pop(replica, None)

    def apply_events(self, replica: int, batch: EventBatch) -> None:
        """Feed one KV-event batch from ``replica`` into the index (ignored from a replica not in
        the fleet)."""
        if replica in self.inflight:
            self.index.apply(replica, batch)

    def resync(
        self, replica: int, hashes: Mapping[BlockHash, int] | Iterable[BlockHash], seq: int
    ) -> None:
        """A replica's full snapshot (what it caches after its batch ``seq``) replaces its part of
        the index."""
        if replica in self.inflight:
            self.index.resync(replica, hashes, seq)

    def finish(self, replica: int, request_id: Hashable) -> None:
        """A request finished on ``replica``: its load leaves the router's count."""
        self.inflight.get(replica, {}).pop(request_id, None)

    # --- routing ----------------------------------------------------------------------------------
    def load(self, replica: int) -> int:
        """Requests in flight on ``replica``, as the router counts them."""
        return len(self.inflight[replica])

    def active_blocks(self, replica: int) -> int:
        """Blocks of the requests in flight on ``replica`` (prompt + new tokens), Dynamo's load
        term."""
        return sum(self.inflight[replica].values())

    def hashes(self, req: RouteRequest) -> list[BlockHash]:
        """The prompt's full-block hashes that a replica could hit (capped at n - 1 tokens, as it
        is)."""
        n = len(req.token_ids)
        usable = (n - 1) // self.block_size * self.block_size
        return prompt_block_hashes(
            req.token_ids[:usable], self.block_size, self.model_fingerprint, req.cache_salt
        )

    def costs(self, req: RouteRequest) -> dict[int, float]:
        """kv_aware's cost of each replica: weight x blocks to prefill + active blocks."""
        hashes = self.hashes(req)
        total = cdiv(len(req.token_ids), self.block_size)
        self.last_overlap = {r: self.index.overlap(r, hashes) for r in self.replicas}
        return {
            r: self.weight * (total - self.last_overlap[r]) + self.active_blocks(r)
            for r in self.replicas
        }

    def _least_loaded(self) -> int:
        return min(self.replicas, key=lambda r: (self.load(r), r))

    def choose(self, req: RouteRequest) -> int:
        """The replica ``policy`` picks for ``req`` (changes nothing but the round-robin
        counter)."""
        p = self.policy
        if callable(p):  # your own: (router, request) -> a replica id
            r = p(self, req)
            if r not in self.replicas:
                raise ValueError(
                    f"the policy chose {r!r}, not a replica of the fleet {self.replicas}"
                )
            return r
        if p == "round_robin":
            return self.replicas[next(self._rr) % len(self.replicas)]
        if p == "least_loaded":
            return self._least_loaded()
        if p == "pull":  # for load; among equals, the one that has to pull least
            hashes = self.hashes(req)
            return min(
                self.replicas,
                key=lambda r: (self.active_blocks(r), -self.index.overlap(r, hashes), r),
            )
        if p == "session_affinity":
            return self.ring.get(req.request_id if req.session is None else req.session)
        if p == "prefix_tree":
            loads = [self.load(r) for r in self.replicas]
            if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(
                loads
            ):
                return self._least_loaded()
            match = self.tree.match(req.token_ids)
            if match:
                best = min(match, key=lambda r: (-match[r], self.load(r), r))
                if match[best] > self.prefix_threshold * len(req.token_ids):
                    return best
            # smallest tree
            return min(self.replicas, key=lambda r: (self.tree.size[r], self.load(r), r))
        costs = self.costs(req)
        return min(self.replicas, key=lambda r: (costs[r], self.active_blocks(r), r))

    def pull_plan(
        self, req: RouteRequest, replica: int, min_blocks: int = 1
    ) -> tuple[int, int, int] | None:
        """``(holder, first, end)``: ``replica`` should fetch blocks ``[first, end)`` of the prompt
        from ``holder``.

        The holder is the replica whose index overlap with the prompt is longest (ties to the lower
        id); None when no replica holds at least ``min_blocks`` more leading blocks than ``replica``
        itself.
        """
        hashes = self.hashes(req)
        own = self.index.overlap(replica, hashes)
        others = [(self.index.overlap(r, hashes), -r) for r in self.replicas if r != replica]
        if not others:
            return None
        best, holder = max(others)
        return (-holder, own, best) if best - own >= min_blocks else None

    def route(self, req: RouteRequest) -> int:
        """Pick a replica and count the request as in flight there."""
        r = self.choose(req)
        self.inflight[r][req.request_id] = cdiv(
            len(req.token_ids) + req.max_tokens, self.block_size
        )
        if self.policy == "prefix_tree":
            self.tree.insert(req.token_ids, r)
        return r
