"""The metadata of one packed step that the paged attention reads (``build_batch`` makes it;
nano-vllm keeps its ``Context`` apart from its attention the same way)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .accelerator import KernelPlan
    from .kv_store import PagedKVStore

__all__ = ["AttnGroup", "MissingBatchError", "PagedBatch"]


@dataclass(slots=True)
class AttnGroup:
    """Sequences attended together, padded to the longest query and the longest block table."""

    # (B, Qmax) index of each query token in the packed row (padding -> 0)
    query_index: torch.Tensor
    # (B, Qmax) bool
    query_valid: torch.Tensor
    # (B, Qmax) absolute position of each query token
    query_pos: torch.Tensor
    # (B, max_blocks) physical block ids (padding -> 0)
    block_tables: torch.Tensor
    # (B,) context length of each sequence after this step
    context: torch.Tensor
    block_size: int
    # no padding and packed in order: the group is the whole step, (B * Qmax) rows
    dense: bool = False
    # every sequence starts at position 0: its keys are this step's, attention is plain causal
    fresh: bool = False
    # (union, group, window, dtype) -> the mask as attended
    masks: dict = field(default_factory=dict)
    # the block tables as lists (``_plan_union`` reads them)
    tables: list[list[int]] = field(default_factory=list)
    # attend over the union of the group's blocks (``_plan_union``; None: not decided yet)
    union: bool | None = None
    # (U,) the distinct blocks of the group, when ``union``
    union_blocks: torch.Tensor | None = None
    # (B, U * block_size) position of each union key in each sequence (-1: not its)
    union_pos: torch.Tensor | None = None


@dataclass(slots=True)
class PagedBatch:
    """Everything the attention function needs for one packed forward."""

    store: PagedKVStore
    # (T,) where each new token's K/V is written
    slot_mapping: torch.Tensor
    groups: list[AttnGroup]
    num_tokens: int
    # layer index of each call, in order (the engine checks it)
    layers_run: list[int] = field(default_factory=list)
    # the sliding window each of those calls was given
    windows_run: list[int | None] = field(default_factory=list)
    # the accelerator's kernel plan of this step (kvlab.engine.accelerator.KernelPlan), set by the
    # runner
    kernel: KernelPlan | None = None


class MissingBatchError(RuntimeError):
    """The paged attention was called without its ``kvlab_batch`` keyword."""
