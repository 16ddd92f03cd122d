"""A C++ CPU kernel for paged attention that reads K/V in place: an opt-in speed path.

``paged_attention_forward`` otherwise gathers each sequence's K/V out of the paged store
(``index_select``: a copy of every block it reads) and runs SDPA on the copy. This kernel reads the
blocks where they lie, through each sequence's block table: per (sequence, KV head) it scores every
query row of the sequence against the keys it may see, takes the softmax and sums the values, and
never writes the gathered K/V anywhere. It is built once per machine with
``cpp_build`` from ``csrc/paged_kernel.cpp`` (a C++ compiler and ninja; the build is cached under
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/kvlab/torch_extensions``), runs in float32 on a CPU and is
parallel (OpenMP) over (sequence, KV head).

What it computes is exactly what the SDPA path computes, in another order of float32 sums: query row
``j`` of a sequence whose step starts at position ``s`` sees the keys at positions ``p`` with
``p <= s + j`` (and ``p > s + j - window`` under a sliding window); query head ``h`` reads KV head
``h // (heads // kv_heads)``; scores are scaled by ``scale`` (default ``1 / sqrt(head_dim)``). The
softmax is either online (one pass over the keys, a running max per row; the default, see
``MODE``) or two passes (all scores, then the values).

Queries take a register path where the build has AVX-512 and the head dimension is 16, 32, 64 or 128
(``has_decode_path``), in the online softmax. It goes a query token at a time: the token's query
rows of a KV head and their running sums of values stay in vector registers; 16 keys are scored into
one vector per row (each key's products, then a 16 x 16 transpose-and-add), the softmax moves 64
keys at a time, and each key's K and V are loaded once for all the rows. Where the kernel is on, it
also writes each step's new K/V into the pages (``write_kv``, one call a layer, in place of two
``index_copy_``).

It is used per group of sequences (``paged_attention.AttnGroup``) where it measured faster than the
gather + SDPA path (commit 3acb965 gives the numbers; compare ``scripts/bench.py`` with and without
``--paged-kernel`` on your machine). With the register path that is every group, prefills too.
Without it, groups whose longest query is at most ``MAX_QUERY`` tokens (decodes); there longer
queries are GEMM-shaped and SDPA measured faster. Enabled by ``SpeedPaths.paged_kernel`` (off by
default; ``kvlab serve`` turns it on for a float32 CPU model).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .cpp_build import build, build_failure

__all__ = ["MAX_QUERY", "MODE", "KernelStep", "PagedKernel", "load", "paged_kernel_available"]

# longest query (tokens of one sequence in a step) a group may have to be attended by the kernel,
# where it has no register path (with it: every query; ``PagedKernel``)
MAX_QUERY = 1
# 0: online softmax (one pass, a running max per row); 1: two passes (scores, then values)
MODE = 0

# -fno-trapping-math: GCC 12 vectorises the e^x loop (its floor and max) only under it; no value
# changes
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]


@functools.cache
def load() -> Any:
    """The compiled kernel, ``csrc/paged_kernel.cpp`` (built on first use, then imported:
    ``cpp_build``)."""
    return build("kvlab_paged_kernel", ["paged_kernel.cpp"], _FLAGS)


def paged_kernel_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the kernel can run here (building it if needed), else why not (a sentence)."""
    if device.type != "cpu":
        return f"it runs on a CPU only (the model is on {device.type})"
    if dtype != torch.float32:
        return f"it is written for float32 only (the model is {dtype})"
    failed = build_failure(load)
    return None if failed is None else f"no C++ build ({failed})"


class KernelStep:
    """One step's metadata for the groups the kernel attends (``PagedBatch.kernel``)."""

    def __init__(self, kernel: PagedKernel, batch: Any) -> None:
        self.kernel = kernel
        # id(group) -> (rows, qlens, qstarts, tables); the groups live as long as the batch
        self.meta: dict[int, tuple[torch.Tensor, ...]] = {}
        # id(group) -> whether the kernel attends it (``takes``)
        self.decided: dict[int, bool] = {}
        for g in batch.groups:
            if g.query_index.shape[1] <= kernel.max_query:
                # (B,) each: first packed row, query length, position of the first query token
                rows, qstarts = g.query_index[:, 0].contiguous(), g.query_pos[:, 0].contiguous()
                qlens = g.query_valid.sum(1)
                self.meta[id(g)] = (rows, qlens, qstarts, g.block_tables.contiguous())

    def takes(self, g: Any, group: int) -> bool:
        """Whether the kernel attends group ``g`` (``group`` query heads per KV head).

        Every group of queries of at most ``max_query`` tokens (with the register path: every
        group), except one case: without the register path (an AVX-512 build, a head dimension of
        16, 32, 64 or 128 and the online softmax), on one thread, where the sequences share most of
        their blocks (on average each block in two tables or more) and the SDPA path attends the
        union of the group's blocks. There each shared block is read once for all of them in one
        GEMM-shaped attention, which measured faster than the plain loops (16 decodes after a
        512-token shared prefix, SmolLM2's shapes); the register path, and the plain loops on two
        threads, measured faster than that union (commits 0ddde3a and 05f4be7)."""
        if id(g) not in self.meta:
            return False
        # decided once per step, at its first layer (every layer asks the same question)
        if id(g) not in self.decided:
            self.decided[id(g)] = self._takes(g, group)
        return self.decided[id(g)]

    def _takes(self, g: Any, group: int) -> bool:
        from ..paged_attention import _plan_union

        if g.union is False or self.kernel.decode_path or torch.get_num_threads() > 1:
            return True
        total = sum(len(t) for t in g.tables)
        if total < 2 * len({blk for t in g.tables for blk in t}):
            return True
        # as the SDPA path would decide it
        return not (g.union or _plan_union(g, group, self.kernel.store.k_pages.element_size()))

    def write_heads(
        self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """The store's ``write_heads`` (the same values in the same slots) as one C++ call, where it
        takes them (float32 rows with unit stride; else the store's own)."""
        store = self.kernel.store
        if any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in (key, value)):
            store.write_heads(layer, slot_mapping, key, value)
            return
        flat = (store.kv_heads, -1, store.head_dim)
        self.kernel.module.write_kv(
            store.k_pages[layer].view(flat),
            store.v_pages[layer].view(flat),
            slot_mapping,
            key,
            value,
        )

    def attend(
        self,
        g: Any,
        layer: int,
        q_all: torch.Tensor,
        out: torch.Tensor | None,
        scaling: float | None,
        window: int | None,
    ) -> torch.Tensor:
        """Attend ``g``'s rows of ``q_all`` (T, heads, D) into ``out`` (made if None); return it."""
        store = self.kernel.store
        if out is None:
            out = torch.empty(q_all.shape, dtype=q_all.dtype, device=q_all.device)
        q = q_all if q_all.stride(-1) == 1 else q_all.contiguous()
        scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
        rows, qlens, qstarts, tables = self.meta[id(g)]
        k, v = store.k_pages[layer], store.v_pages[layer]
        args = (q, out, k, v, rows, qlens, qstarts, tables, scale, window or 0, self.kernel.mode)
        # named in a profile's table (scripts/profile_step.py), beside the ATen ops; only while a
        # profiler runs, as the name costs ~6 us a call (30 calls a step)
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function("kvlab::paged_kernel"):
                self.kernel.module.attend(*args)
        else:
            self.kernel.module.attend(*args)
        return out


class PagedKernel:
    """The kernel for one engine's store: ``plan(batch)`` gives a step the groups it attends."""

    def __init__(self, store: Any, max_query: int | None = None, mode: int = MODE) -> None:
        why = paged_kernel_available(store.device, store.k_pages.dtype)
        if why is not None:
            raise ValueError(f"paged_kernel: {why}")
        self.store, self.mode, self.module = store, mode, load()
        # queries take the kernel's register path (``attend``'s decode_rows), a token at a time
        self.decode_path = mode == 0 and self.module.has_decode_path(store.head_dim)
        # None: queries of any length where the register path runs (prefills too), else MAX_QUERY
        self.max_query = (
            max_query if max_query is not None else (2**62 if self.decode_path else MAX_QUERY)
        )

    def plan(self, batch: Any) -> KernelStep:
        """The step's kernel: the metadata of the groups it attends."""
        return KernelStep(self, batch)
