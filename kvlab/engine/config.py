"""An engine's settings in one checked dataclass (pure Python): ``Engine(model, tok, config,
**overrides)``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..cache.hashing import DEFAULT_BLOCK_SIZE
from .accelerator import Accelerator
from .tenants import check_policy, check_secret

__all__ = ["CACHES", "EngineConfig"]

CACHES = ("blocks", "radix")
# the booleans EngineConfig had before the speed paths moved behind ``accelerator``
SPEED_FLAGS = ("packed_linear", "paged_kernel", "fused_layers")


def _check_int(name: str, value: object, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if type(value) is not int or value < low:
        raise ValueError(
            f"{name} must be an int >= {low}{' or None' if optional else ''}, got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What an ``Engine`` is built with; every field is checked when the config is made.

    Sizes: ``num_blocks`` (default 512) or ``kv_cache_bytes`` (the blocks that fit) of
    ``block_size`` slots; ``cache`` is "blocks" (vLLM's hash blocks) or "radix" (SGLang's tree of
    ``page_size`` pages). Tenancy: ``isolation`` ("shared", "tenant", "public-prefix") and the
    ``secret`` every salt is derived from (None: a random one per engine). ``host_tier_bytes``: a
    host-memory second tier of that size. ``max_num_seqs``, ``max_num_batched_tokens`` and
    ``enable_chunked_prefill`` go to the ``Scheduler``. ``accelerator``: the speed paths
    (``kvlab.engine.accelerator``), e.g. ``kvlab.engine.speed.SpeedPaths(packed_linear=True,
    paged_kernel=True)``; None (the default): the teaching path, with nothing compiled.
    """

    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    cache: str = "blocks"
    page_size: int = 1
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # prompts longer than a step's token budget run in chunks; None: the Scheduler's default (on)
    enable_chunked_prefill: bool | None = None
    isolation: str = "shared"
    secret: bytes | str | None = field(default=None, repr=False)
    seed: int = 0
    enable_kv_events: bool = False
    host_tier_bytes: int | None = None
    offload_evicted: bool = True
    debug: bool = False
    # the speed paths, bound once per engine (kvlab.engine.speed.SpeedPaths); None: the teaching
    # path
    accelerator: Accelerator | None = None

    def __post_init__(self) -> None:
        _check_int("num_blocks", self.num_blocks, 1, optional=True)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True)
        _check_int("block_size", self.block_size, 1)
        _check_int("page_size", self.page_size, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs)
        _check_int("host_tier_bytes", self.host_tier_bytes, 0, optional=True)
        if type(self.seed) is not int:
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        check_policy(self.isolation)
        if self.secret is not None:
            check_secret(self.secret)
        if self.accelerator is not None and not isinstance(self.accelerator, Accelerator):
            raise TypeError(
                "accelerator must have bind(model, store) and describe() "
                "(kvlab.engine.accelerator), "
                f"got {self.accelerator!r}"
            )
        flags = "enable_prefix_caching enable_kv_events offload_evicted debug"
        for name in flags.split():
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.enable_chunked_prefill, (bool, type(None))):
            raise TypeError(
                "enable_chunked_prefill must be a bool or None, got "
                f"{self.enable_chunked_prefill!r}"
            )

    def replace(self, **overrides: object) -> EngineConfig:
        """A copy with ``overrides`` (field names) changed; an unknown name raises ``TypeError``
        naming it."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        moved = sorted(set(unknown) & set(SPEED_FLAGS))
        if moved:
            flags = ", ".join(f"{name}=True" for name in moved)
            raise TypeError(
                f"{', '.join(moved)}: the speed paths are one setting now, "
                f"accelerator=kvlab.engine.speed.SpeedPaths({flags})"
            )
        if unknown:
            raise TypeError(
                f"unknown engine setting(s) {', '.join(map(repr, unknown))}: "
                f"EngineConfig has {', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **overrides) if overrides else self
