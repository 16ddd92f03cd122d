"""Notebook 04: the block figures, the exercise checkers, and the replay that checks the build
exercises (04's hash chain, ``take``/``free``, ``allocate``; 05's ``append``) on
``kvlab.built.nb04.ToyBlocks`` beside kvlab's ``BlockManager``. A checker returns a ``Verdict`` and
never raises; the worked solutions: ``kvlab.lessons.solutions``."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from kvlab.built.nb04 import ToyBlocks
from kvlab.cache import cdiv
from kvlab.cache.block_manager import BlockManager
from kvlab.cache.hash_tools import first_block_extra_keys, hash_token_blocks
from kvlab.cache.hashing import hash_block
from kvlab.lessons import solutions as SOL
from kvlab.lessons.common import Verdict, call_answer, unanswered, verdict
from kvlab.lessons.traces import ARTICLE_QUESTIONS, SYSTEM_PROMPTS, timestamp_trace, toy_tokenize
from kvlab.lessons.traces import replay as replay_trace


# ----------------------------------------------------------------------------- exercises 04.1-3
def check_cached_tokens(predict: Callable[[int, int], int] | None) -> Verdict:
    """Exercise 04.1: ``predict(n, block_size)`` = cached tokens when an identical n-token prompt
    repeats."""
    hint = "only whole blocks are cached, and the last prompt token is always computed again"
    for bs in (1, 2, 4, 16, 64):
        for n in range(1, 3 * bs + 3):
            m = BlockManager(8 + 2 * (n // bs + 1), bs)
            m.allocate("first", list(range(n)))
            truth = m.allocate("again", list(range(n)))
            guess, failed = call_answer(predict, n, bs, hint=hint, name="predict")
            if failed is not None:
                return failed
            if guess != truth:
                off = ("a different number" if not isinstance(guess, int)
                       else ("too many" if guess > truth else "too few"))
                return verdict(False,
                               hint=f"for n={n}, block_size={bs} you predicted {guess!r}: {off}; "
                                    f"{hint}")
    return verdict(True, "right for every n and block size tried")


def check_find_leaks(find_leaks: Callable[[BlockManager], set[int]] | None) -> Verdict:
    """Exercise 04.2: ``find_leaks(manager)`` returns the ids of blocks with more refs than table
    entries."""
    hint = ("count, per block id, the block tables (manager.seqs) that hold it, and compare with "
            "its ref_count")
    rng = random.Random(4)
    for trial in range(20):
        m = BlockManager(32, 4)
        system = [rng.randrange(1000) for _ in range(rng.randint(4, 20))]
        for i in range(rng.randint(3, 6)):
            m.allocate(i, system + [rng.randrange(1000) for _ in range(rng.randint(1, 9))])
        for i in list(m.seqs)[::2]:
            m.free(i)
        in_use = sorted({b for s in m.seqs.values() for b in s.block_table})
        leaked = set(rng.sample(in_use, rng.randint(1, min(3, len(in_use)))))
        for b in leaked:  # a reference that no block table holds
            m.pool.share(m.pool.blocks[b], "nobody")
        found, failed = call_answer(find_leaks, m, hint=hint, name="find_leaks")
        if failed is not None:
            return failed
        found = set(found or ())
        if found != leaked:
            return verdict(False,
                           hint=f"trial {trial}: you found {sorted(found)}; {len(found - leaked)} "
                                f"of them are not leaked and you missed {len(leaked - found)}; "
                                f"{hint}")
    return verdict(True, "right on 20 managers with planted leaks")


def check_timestamp_prompt(build: Callable[[list[int], list[int],
                                            list[int]], list[int]] | None) -> Verdict:
    """Exercise 04.3: ``build(system, timestamp, question)`` keeps every part and hits >= 95 % of
    the ideal."""
    hint = ("a block is reused only if every token before it is the same: where can a changing "
            "part go?")
    base, stamped = (timestamp_trace(24, where="none", seed=1),
                     timestamp_trace(24, where="start", seed=1))
    ideal = replay_trace(BlockManager(4096, 16), base)["hit_tokens"]
    system, built = base[0].prompt[:256], []
    for b, s in zip(base, stamped, strict=True):
        stamp, question = s.prompt[:8], b.prompt[256:]
        prompt, failed = call_answer(build, list(system), list(stamp), list(question), hint=hint,
                                     name="build")
        if failed is not None:
            return failed
        try:
            same_parts = sorted(prompt) == sorted(system + stamp + question)
        except TypeError:
            same_parts = False
        if not same_parts:
            return verdict(False,
                           hint="the prompt must be a list of token ids holding the system prompt, "
                                "the timestamp and the question, once each")
        built.append(type(b)(b.req_id, prompt, b.output))
    got = replay_trace(BlockManager(4096, 16), built)["hit_tokens"]
    return verdict(got >= 0.95 * ideal, f"{got} cached tokens vs {ideal} without any timestamp",
                   f"{got} cached tokens, need at least 95% of the {ideal} a timestamp-free prompt "
                   f"gets; {hint}")


# ----------------------------------------------------------------------------- figures
REF_COLORS = ["#ffffff", "#9ecae1", "#fdae6b", "#e6550d", "#a63603"]  # ref count 0, 1, 2, 3, >=4
CACHED_FREE = "#d9d9d9"


def _color(ref: int, cached: bool = False) -> str:
    return REF_COLORS[min(ref, 4)] if ref else (CACHED_FREE if cached else "white")


def fig_block_tables(manager: BlockManager, title: str = "") -> Figure:
    """Sequences x logical blocks (physical id, colour = ref count), and the pool with its LRU
    order."""
    bs, seqs, blocks = manager.block_size, manager.seqs, manager.pool.blocks
    width, per_row = max([len(s.block_table) for s in seqs.values()] + [1]), min(len(blocks), 16)
    pool_rows = cdiv(len(blocks), per_row)
    fig, (ax, axp) = plt.subplots(2, 1, figsize=(max(6.0, 0.55 * max(width, per_row) + 2),
                                                 0.5 * (len(seqs) + pool_rows) + 2.4),
                                  gridspec_kw={"height_ratios": [max(len(seqs), 1), pool_rows]})
    for row, s in enumerate(seqs.values()):
        y = len(seqs) - 1 - row
        for j, pid in enumerate(s.block_table):
            fill = min(bs, len(s.token_ids) - j * bs) / bs  # the shaded part: slots written
            ax.add_patch(Rectangle((j, y), fill, 0.8, facecolor=_color(blocks[pid].ref_count),
                                   edgecolor="none"))
            ax.add_patch(Rectangle((j, y), 1, 0.8, facecolor="none", edgecolor="black"))
            ax.text(j + 0.5, y + 0.4, str(pid), ha="center", va="center", fontsize=8)
    ax.set_yticks([len(seqs) - 1 - r + 0.4 for r in range(len(seqs))], [str(s) for s in seqs])
    ax.set(xlim=(0, width), ylim=(-0.2, max(len(seqs), 1)),
           xlabel=f"logical block (block size {bs} tokens; shaded part = slots written)",
           title=title or "block tables: cell text = physical block id, colour = ref count")
    rank = {b: i + 1 for i, b in enumerate(manager.pool.free)}
    for b in blocks:
        x, y, free = b.block_id % per_row, pool_rows - 1 - b.block_id // per_row, b.ref_count == 0
        victim = free and rank.get(b.block_id) == 1
        axp.add_patch(Rectangle((x, y), 0.9, 0.8,
                                facecolor=_color(b.ref_count, b.block_hash is not None),
                                edgecolor="red" if victim else "black",
                                linewidth=2.5 if victim else 0.8))
        axp.text(x + 0.45, y + 0.55, str(b.block_id), ha="center", va="center", fontsize=8)
        if free:
            axp.text(x + 0.45, y + 0.18, f"LRU{rank[b.block_id]}", ha="center", va="center",
                     fontsize=6)
    axp.set(xlim=(0, per_row), ylim=(-0.1, pool_rows), xticks=[], yticks=[])
    axp.set_title("physical pool: LRUk = k-th in the free list (red edge = next victim)",
                  fontsize=9)
    handles = [Patch(facecolor=_color(r), edgecolor="black",
                     label=f"ref {r}" + ("+" if r == 4 else ""))
               for r in range(1, 5)]
    handles += [Patch(facecolor=CACHED_FREE, edgecolor="black", label="free, still cached"),
                Patch(facecolor="white", edgecolor="black", label="free, empty")]
    axp.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.05), ncol=6, fontsize=7,
               frameon=False)
    for a in (ax, axp):
        a.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def fig_logical_physical(manager: BlockManager) -> Figure:
    """Each sequence's logical blocks (left) and the physical pool (right), one line per block-table
    entry."""
    seqs, pool = list(manager.seqs.values()), manager.pool.blocks
    height = max(sum(len(s.block_table) for s in seqs) + len(seqs) - 1, len(pool))
    fig, ax = plt.subplots(figsize=(7.0, 0.28 * height + 1.6))
    scale, y = height / max(len(pool), 1), height
    for s in seqs:
        for j, pid in enumerate(s.block_table):
            y -= 1
            ax.add_patch(Rectangle((0, y), 1.4, 0.8, facecolor="#c6dbef", edgecolor="black"))
            ax.text(0.7, y + 0.4, f"{s.seq_id} · {j}", ha="center", va="center", fontsize=7)
            ax.plot([1.4, 3.6], [y + 0.4, height - (pid + 0.6) * scale], color="grey", lw=0.8,
                    gid=f"map {s.seq_id} {j} {pid}")
        y -= 1
    for b in pool:
        py = height - (b.block_id + 1) * scale
        ax.add_patch(Rectangle((3.6, py), 1.0, 0.8 * scale,
                               facecolor=_color(b.ref_count, b.block_hash is not None),
                               edgecolor="black"))
        ax.text(4.1, py + 0.4 * scale, f"{b.block_id}", ha="center", va="center", fontsize=7)
        ax.text(4.7, py + 0.4 * scale, f"ref {b.ref_count}", ha="left", va="center", fontsize=6)
    ax.text(0.7, height + 0.3, "logical (sequence · block)", ha="center", fontsize=8)
    ax.text(4.1, height + 0.3, "physical pool (block id)", ha="center", fontsize=8)
    ax.set(xlim=(-0.1, 5.5), ylim=(-0.2, height + 1))
    ax.axis("off")
    ax.set_title("block tables map logical blocks to physical ones; a shared block has several "
                 "lines in\n(colour = ref count, as in the block-table figures; grey = free but "
                 "still cached)", fontsize=9)
    fig.tight_layout()
    return fig


def fig_hash_chain(manager: BlockManager) -> Figure:
    """Each sequence's full-block hashes as a chain (each hash takes its parent's), the salt
    entering its block."""
    seqs = list(manager.seqs.values())
    width, bs = max([len(s.block_hashes) for s in seqs] + [1]), manager.block_size
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * width + 1.5), 1.3 * len(seqs) + 1.3))
    for r, s in enumerate(seqs):
        y = len(seqs) - 1 - r
        for j, h in enumerate(s.block_hashes):
            salted = s.cache_salt is not None and j == s.salt_block
            ax.add_patch(Rectangle((1.9 * j, y), 1.5, 0.75,
                                   facecolor="#fdd0a2" if salted else "white",
                                   edgecolor="black", gid="salted" if salted else "block"))
            ax.text(1.9 * j + 0.75, y + 0.52, f"#{h[:3].hex()}", ha="center", va="center",
                    fontsize=8,
                    family="monospace", gid=f"hash {s.seq_id} {j}")
            ax.text(1.9 * j + 0.75, y + 0.22, f"tokens {j * bs}–{(j + 1) * bs - 1}"
                    + (f"\n+ salt {s.cache_salt!r}" if salted else ""), ha="center", va="center",
                    fontsize=6)
            if j:
                ax.annotate("", xy=(1.9 * j, y + 0.37), xytext=(1.9 * j - 0.4, y + 0.37),
                            arrowprops={"arrowstyle": "->"})
        ax.text(-0.2, y + 0.37, str(s.seq_id), ha="right", va="center", fontsize=8)
    ax.set(xlim=(-2.2, 1.9 * width), ylim=(-0.3, len(seqs) + 0.1))
    ax.axis("off")
    ax.set_title("hash chain: a block's hash = sha256(parent hash, its tokens, extra keys); the "
                 "salt (shaded) changes\nits block's hash and so every hash after it — same "
                 "tokens, no shared blocks", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- section 3's runners
def timestamp_table(n_requests: int, seed: int = 0):
    """Hit rate with no timestamp, one at the start and one at the end of the system prompt (blocks
    of 16)."""
    import pandas as pd

    rows = []
    for where in ("none", "start", "end"):
        r = replay_trace(BlockManager(4096, 16),
                         timestamp_trace(n_requests, where=where, seed=seed))
        rows.append({"timestamp": where, "hit rate": r["hit_rate"], "hit tokens": r["hit_tokens"],
                     "miss_no_prefix": r["miss_no_prefix"], "miss_short": r["miss_short"]})
    return pd.DataFrame(rows).set_index("timestamp")


# ------------------------------------------------------------------ build exercises 04.B1-B3, 05.B1
def block_trace(n_ops: int = 40, block_size: int = 4, num_blocks: int = 24, seed: int = 0,
                appends: bool = False) -> list[tuple]:
    """``("allocate", seq, tokens)``, ``("free", seq)`` and, with ``appends``, ``("append", seq,
    token)`` on the article's prompts: repeated prompts, second turns that repeat a whole earlier
    sequence, evictions."""
    rng = random.Random(seed)
    m, ops, live, done = BlockManager(num_blocks, block_size), [], [], []
    for k in range(n_ops):
        lang = rng.choice(("zh", "en"))
        prompt = (toy_tokenize(SYSTEM_PROMPTS[lang])
                  + toy_tokenize(rng.choice(ARTICLE_QUESTIONS[lang])))
        prompt = (prompt[: rng.randint(len(prompt) // 2, len(prompt))]
                  + [rng.randrange(5000)] * rng.randint(0, 5))
        # the same prompt again, or an earlier sequence with what it generated
        if done and rng.random() < 0.4:
            prompt = (list(rng.choice(done))
                      + ([rng.randrange(5000)] if appends and rng.random() < 0.5 else []))
        prompt = prompt[: num_blocks * block_size // 2]
        while live and (len(live) >= 3 or rng.random() < 0.3 or not m.can_allocate(prompt)):
            seq = live.pop(rng.randrange(len(live)))
            done.append(list(m.seqs[seq].token_ids))
            m.free(seq)
            ops.append(("free", seq))
        m.allocate(f"r{k}", prompt)
        live.append(f"r{k}")
        ops.append(("allocate", f"r{k}", prompt))
        for _ in range(rng.randint(0, 2 * block_size) if appends else 0):
            if not m.can_append(f"r{k}"):
                break
            ops.append(("append", f"r{k}", rng.randrange(5000)))
            m.append(f"r{k}", ops[-1][2])
    return ops


def kvlab_pieces(**yours: Callable | None) -> SimpleNamespace:
    """The pieces of a paged cache, kvlab's (the worked solutions) unless one of ``yours`` is
    given."""
    ref = {"hashes": SOL.build_04_block_hashes, "take": SOL.build_04_take,
           "free": SOL.build_04_free,
           "allocate": SOL.build_04_allocate, "append": SOL.build_05_append}
    return SimpleNamespace(**{k: yours.get(k) or f for k, f in ref.items()})


def replay(ops: list[tuple], pieces: SimpleNamespace, block_size: int = 4,
           num_blocks: int = 24) -> tuple[list[dict], tuple[str, str] | None]:
    """Run ``ops`` on kvlab's ``BlockManager`` and on a ``ToyBlocks`` run by ``pieces``, compared
    after every step: (one row per step, ``(where, what differed)`` at the first difference or
    None). May raise."""
    m, rows, tokens = BlockManager(num_blocks, block_size), [], {}
    toy = ToyBlocks(num_blocks, block_size, pieces.take, pieces.free)
    for kind, seq, *arg in ops:
        got = want = None
        if kind == "free":
            m.free(seq)
            pieces.free(toy, seq)
            del tokens[seq]
        elif kind == "allocate":
            tokens[seq], want = list(arg[0]), m.allocate(seq, arg[0])
            got = pieces.allocate(toy, seq, list(arg[0]),
                                  list(pieces.hashes(list(arg[0]), block_size, ())))
        else:
            tokens[seq].append(arg[0])
            m.append(seq, arg[0])
            pieces.append(toy, seq, list(tokens[seq]))
        at = (f"step {len(rows)} ({kind} {seq!r}"
              + (f", {len(arg[0])} tokens)" if kind == "allocate" else ")"))
        rows.append({"step": kind, "seq": seq, "cached (yours)": got, "cached (kvlab)": want,
                     "free (yours)": len(toy.free), "free (kvlab)": m.num_free_blocks,
                     "evictions (kvlab)": m.pool.num_evictions})
        if got != want:
            how = ("more" if got > want else "fewer") if isinstance(got, int) else "not a count"
            return (rows,
                    (at,
                     f"you report {got!r} cached tokens, {how} than kvlab's BlockManager's {want}"))
        if kind != "free" and toy.tables.get(seq) != m.block_table(seq):
            return rows, (at, f"block table {toy.tables.get(seq)}, kvlab's {m.block_table(seq)}")
        pool = m.pool.blocks
        for what, yours, kvlab in (("ref counts differ", toy.ref, [b.ref_count for b in pool]),
                                   ("cached blocks differ",
                                    sorted(b for b, h in enumerate(toy.hash_of) if h is not None),
                                    sorted(b.block_id for b in pool if b.block_hash is not None)),
                                   ("free list differs", list(toy.free), list(m.pool.free))):
            if yours != kvlab:
                k = next((i for i, (x, y) in enumerate(zip(yours, kvlab)) if x != y),
                         min(len(yours), len(kvlab)))
                return rows, (at,
                              f"{what}: "
                              + (f"block {k}: {yours[k]} vs {kvlab[k]}"
                                 if what.startswith("ref") else
                                 f"from position {k} on yours are "
                                 f"{yours[k:k + 4]}, kvlab's {kvlab[k:k + 4]}"))
    return rows, None


def _check(yours: dict, ops: list[tuple], name: str, hint: Callable[[str], str],
           **given: Callable | None) -> Verdict:
    """Replay ``ops`` with ``yours`` (and the ``given`` pieces, kvlab's where None); a verdict
    naming the first difference and ``hint(what differed)``."""
    if any(fn is None for fn in yours.values()):
        return unanswered(hint(""))
    try:
        rows, problem = replay(ops, kvlab_pieces(**yours, **given))
    except NotImplementedError:
        return unanswered(hint(""))
    except Exception as err:  # noqa: BLE001 (the reader's code may fail in any way)
        return verdict(False, hint=f"{name} raised {type(err).__name__}: {err}; {hint(str(err))}")
    if problem is not None:
        return verdict(False, hint=f"{problem[0]}: {problem[1]}: {hint(problem[1])}")
    count = ", ".join(f"{n} {k}" for k in ("allocate", "append", "free")
                      if (n := sum(r["step"] == k for r in rows)))
    return verdict(True,
                   f"{len(rows)} steps ({count}; {sum(r['cached (kvlab)'] or 0 for r in rows)} "
                   f"cached tokens, {rows[-1]['evictions (kvlab)']} evictions) with the same hits, "
                   "tables, ref counts, cached blocks and free list as kvlab's BlockManager")


def check_block_hashes(fn: Callable[..., list[bytes]] | None) -> Verdict:
    """Build 04.B1: ``fn(token_ids, block_size, extra_keys)`` = kvlab's ``hash_token_blocks``, with
    and without keys."""
    hint = ("one hash per full block: hash_block(parent, the block's tokens, extra keys), parent "
            "None for block 0 and the previous block's hash after it; the extra keys go into block "
            "0 only")
    rng = random.Random(7)
    for keys in ((), first_block_extra_keys("toy-model", "tenant-a")):
        for bs, n in ((4, 13), (4, 16), (16, 40), (2, 1)):
            tokens = [rng.randrange(1000) for _ in range(n)]
            want = hash_token_blocks(tokens, bs, keys)
            got, failed = call_answer(fn, tokens, bs, keys, hint=hint, name="my_block_hashes")
            if failed is not None:
                return failed
            got = list(got) if isinstance(got, list | tuple) else got
            where = f"{n} tokens in blocks of {bs}" + (", with extra keys" if keys else "")
            if not isinstance(got, list) or len(got) != len(want):
                size = len(got) if isinstance(got, list) else type(got).__name__
                return verdict(False,
                               hint=f"{where}: expected one hash per full block, got {size}; the "
                                    "partial tail block gets no hash")
            for i, (g, w) in enumerate(zip(got, want)):
                block = tokens[i * bs:(i + 1) * bs]
                if g != w:
                    why = ("not chained: give each block its parent's hash"
                           if i and g == hash_block(None, block) else
                           "the extra keys belong to block 0 only"
                           if i and g == hash_block(want[i - 1], block, keys) else
                           "block 0 needs the extra keys"
                           if not i and keys and g == hash_block(None, block) else
                           hint)
                    return verdict(False, hint=f"{where}: block {i}'s hash differs: {why}")
    return verdict(True, "the same chain as kvlab's hash_token_blocks, with and without extra keys")


def check_take_free(take: Callable | None, free: Callable | None) -> Verdict:
    """Build 04.B2: ``take(blocks)`` and ``free(blocks, seq_id)`` on a ``ToyBlocks``, replayed with
    kvlab's ``allocate`` against kvlab's ``BlockManager``: same ref counts, cached blocks
    (evictions) and free-list order."""
    def hint(what: str) -> str:
        return ("a block at ref count 0 goes to the TAIL of blocks.free when it holds a hash (it "
                "can still be hit, so it is evicted last) and to the HEAD when it holds none "
                "(free.move_to_end(b, last=False)); release the table tail first (reversed), so a "
                "chain's tail is evicted before its head"
                if what.startswith("free list") else
                "take the HEAD of blocks.free (next(iter(blocks.free))), remove it from the free "
                "list, evict what it caches (blocks.uncache(b) when blocks.hash_of[b] is not None) "
                "and set its ref count to 1"
                if what.startswith(("cached", "block table")) else
                "free drops ONE reference per table entry (blocks.tables.pop(seq_id)); take sets "
                "the new block's ref count to 1" if what.startswith("ref") else
                "write both: take = the free list's head, evicted, ref count 1; free = one "
                "reference less per block, tail first, a block at 0 back into blocks.free (cached "
                "ones at the tail)")
    return _check({"take": take, "free": free}, block_trace(), "my_take or my_free", hint)


def check_allocate(fn: Callable[..., int] | None, hashes: Callable | None = None,
                   take: Callable | None = None,
                   free: Callable | None = None) -> Verdict:
    """Build 04.B3: ``fn(blocks, seq_id, token_ids, hashes)`` on a ``ToyBlocks`` (with ``take`` and
    ``free``), replayed step for step against kvlab's ``BlockManager``: same hits, block tables, ref
    counts and free list."""
    def hint(what: str) -> str:
        return ("stop at the first miss, and never hit the block of the last prompt token: at most "
                "(len(token_ids) - 1) // block_size blocks" if "more than" in what else
                "a cached block with ref count 0 (in blocks.free) is still a hit: del "
                "blocks.free[b] as you add its "
                "reference" if "you report" in what or what.startswith("free") else
                "the hits first, then one blocks.take() per remaining block, in order; register "
                "each FULL new block (blocks.register(b, hashes[i])); store the table in "
                "blocks.tables[seq_id]"
                if what.startswith(("block table", "cached")) else
                "look up the full blocks' hashes in order with blocks.lookup(h), up to (n - 1) // "
                "block_size blocks, stopping at the first miss; each hit gets one more reference; "
                "take the other blocks, register the full ones, store the table in "
                "blocks.tables[seq_id], return the cached tokens")
    return _check({"allocate": fn}, block_trace(), "my_allocate", hint, hashes=hashes, take=take,
                  free=free)


def check_append(fn: Callable | None, **pieces: Callable | None) -> Verdict:
    """Build 05.B1: ``fn(blocks, seq_id, token_ids)`` (the new token last) on a ``ToyBlocks``,
    replayed with decode steps and second turns against kvlab's ``BlockManager.append``: same
    tables, cached blocks, hits."""
    def hint(what: str) -> str:
        return ("take a new block (blocks.take()) only when the token starts one: (len(token_ids) "
                "- 1) % block_size == 0" if what.startswith(("block table", "free", "ref")) else
                "when the token fills its block (len(token_ids) % block_size == 0), register that "
                "block under hash_block(parent, its tokens): the parent is the hash of the block "
                "before it (blocks.hash_of[table[-2]]), None for block 0" if what else
                "a new block when the last one is full; register the block this token fills under "
                "its chained hash")
    return _check({"append": fn}, block_trace(60, appends=True), "my_append", hint, **pieces)


def replay_table(pieces: SimpleNamespace, appends: bool = False):
    """The replay behind the checkers as a DataFrame, one row per step (what the notebook shows)."""
    import pandas as pd

    rows, _ = replay(block_trace(60 if appends else 40, appends=appends), pieces)
    return pd.DataFrame(rows).convert_dtypes()
