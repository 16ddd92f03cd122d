"""Request intake: check a request without the engine lock, then build its ``Request`` under it.

A refused request raises ``RequestError`` (``kvlab.engine.errors``) whose ``field`` names the
offending field ("prompt", "max_tokens", "temperature", "tenant", "cache_salt", ...). The salt
rules are ``kvlab.engine.tenants``'; ``make_sampling`` (re-exported here) is ``sampling_params``'.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from ..cache.interface import TenantScope
from .config import EngineConfig
from .errors import RequestError, RequestTypeError, refused
from .sampling_params import SamplingParams, make_sampling
from .sequence import Request
from .tenants import (
    check_cache_salt,
    check_secret,
    public_prefix_length,
    request_salt,
    tenant_salt,
    warn_shared_tenants,
)

__all__ = [
    "Checked",
    "Intake",
    "RequestError",
    "RequestTypeError",
    "check_sampling",
    "encode",
    "make_sampling",
    "per_prompt",
]


class Checked(NamedTuple):
    """A request ``Intake.check`` accepted: its tokens and sampling, its tenant and the salt derived
    for it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    tenant: str | None
    # what the engine derived from the request's cache_salt and tenant (tenants.request_salt); None:
    # unsalted
    cache_salt: str | None


class Intake:
    """Checks requests and builds their ``Request`` state: automatic ids, seeded generators, tenant
    scopes."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int | None,
        check_fits: Callable[[int, int], None],
        config: EngineConfig,
        device: torch.device,
    ) -> None:
        """``config``: the engine's ``EngineConfig`` (its ``isolation``, ``secret`` and
        ``seed``)."""
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.isolation, self.device = config.isolation, device
        # the pool's check (Scheduler.check_fits): RequestError naming "prompt" or "max_tokens"
        self.check_fits = check_fits
        # the engine's secret: the one every salt is derived from (kvlab.engine.tenants); None: a
        # random one
        self._secret = check_secret(config.secret)
        seed = config.seed
        # token ids; used under "public-prefix"
        self.public_prefixes: list[tuple[int, ...]] = []
        self._ids = itertools.count()
        # seeds of requests that give none
        self._rng = random.Random(seed)
        # SharedTenantsWarning: once per engine
        self._warned_shared_tenants = False

    def salt_for(self, tenant: str | None) -> str | None:
        """The cache salt the engine gives ``tenant`` under its policy (None under "shared")."""
        return None if self.isolation == "shared" else tenant_salt(self._secret, tenant)

    def check_prefix(self, prefix: str | Sequence[int]) -> tuple[int, ...]:
        """An operator's public prefix as token ids (``ValueError`` if empty)."""
        ids = tuple(encode(self.tokenizer, prefix))
        if not ids:
            raise ValueError("a public prefix needs at least one token")
        return ids

    def add_public_prefix(self, ids: tuple[int, ...]) -> int:
        """Register checked prefix ids (under the engine lock); return their count."""
        if ids not in self.public_prefixes:
            self.public_prefixes.append(ids)
        return len(ids)

    def check(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None,
        tenant: str | None,
        cache_salt: str | None = None,
        unsafe_salt: str | None = None,
    ) -> Checked:
        """Tokenize and check one request, and derive its salt; raise ``RequestError`` naming the
        field at fault."""
        sampling = check_sampling(SamplingParams() if sampling is None else sampling)
        for name, value in (
            ("tenant", tenant),
            ("cache_salt", cache_salt),
            ("unsafe_salt", unsafe_salt),
        ):
            if value is not None and not isinstance(value, str):
                raise RequestTypeError(
                    name, f"{name} must be a str or None, got {type(value).__name__}"
                )
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        if unsafe_salt is not None and (tenant is not None or cache_salt is not None):
            raise RequestError(
                "unsafe_salt",
                "give a tenant (the engine derives its salt, with a cache_salt if "
                "given) or an unsafe_salt, not both",
            )
        try:
            # text (with a tokenizer), or real int ids: floats, bools, bytes... raise
            ids = encode(self.tokenizer, prompt)
        except (TypeError, ValueError) as e:
            raise refused("prompt", e) from None
        if not ids:
            raise RequestError("prompt", "the prompt is empty: a request needs at least one token")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if self.max_model_len is not None and len(ids) + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                "prompt" if len(ids) >= self.max_model_len else "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"model's {self.max_model_len} positions",
            )
        # the pool's size only: fixed at construction
        self.check_fits(len(ids), sampling.max_tokens)
        if tenant is not None and self.isolation == "shared" and not self._warned_shared_tenants:
            # once per engine
            self._warned_shared_tenants = True
            warn_shared_tenants(tenant, stacklevel=3)
        try:
            derived = (
                unsafe_salt
                if unsafe_salt is not None
                else request_salt(self._secret, self.isolation, tenant, cache_salt)
            )
        # a lone surrogate ("\ud800") in the tenant id
        except UnicodeEncodeError as e:
            raise RequestError("tenant", f"the tenant id is not valid Unicode: {e}") from None
        return Checked(ids, sampling, tenant, derived)

    def admit(
        self, checked: Checked, request_id: Hashable | None, live: dict[Hashable, Request]
    ) -> Request:
        """The ``Request`` of a checked request (call it under the engine lock): ids, scope,
        generator, arrival."""
        ids, sampling, tenant, cache_salt = checked
        public = (
            public_prefix_length(ids, self.public_prefixes)
            if self.isolation == "public-prefix"
            else 0
        )
        seq_id, request_id = self.new_ids(request_id, live)
        return Request(
            seq_id,
            request_id,
            ids,
            sampling,
            TenantScope(cache_salt, public, tenant),
            arrival_time=time.perf_counter(),
            generator=self.generator(sampling),
        )

    def new_ids(
        self, request_id: Hashable | None, live: dict[Hashable, Request]
    ) -> tuple[int, Hashable]:
        """A fresh internal sequence id, and ``request_id`` or, for None, an automatic id no
        ``live`` request uses."""
        if request_id is not None and request_id in live:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq_id = next(self._ids)
        if request_id is None:
            request_id = seq_id
            # a caller chose this number: never collide with it
            while request_id in live:
                request_id = next(self._ids)
        return seq_id, request_id

    def generator(self, sampling: SamplingParams) -> torch.Generator | None:
        """A generator seeded by ``sampling.seed`` (or the engine's seeded draw); None for
        greedy."""
        if sampling.greedy:
            return None
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        return torch.Generator(device=self.device).manual_seed(seed)


def encode(tokenizer: Any, text_or_ids: str | Sequence[int]) -> list[int]:
    """Token ids of a text (no special tokens added: ChatML markup is spelled out in the text).

    Ids pass through as Python ints when they are a sequence (list, tuple, range, 1-D numpy array or
    torch tensor) of real integers: Python or numpy ints, never bools, floats, strings or bytes.
    Anything else (bytes, a dict, a set, floats such as 1.7, digit strings such as "5") raises
    ``TypeError`` instead of being coerced into other tokens.
    """
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise TypeError("a text prompt needs a tokenizer: pass token ids")
        try:
            text_or_ids.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the prompt is not valid Unicode: a lone surrogate at character {e.start}"
            ) from None
        return list(tokenizer(text_or_ids, add_special_tokens=False)["input_ids"])
    import numpy as np

    if isinstance(text_or_ids, (np.ndarray, torch.Tensor)):
        if isinstance(text_or_ids, torch.Tensor):
            integer = not (
                text_or_ids.is_floating_point()
                or text_or_ids.is_complex()
                or text_or_ids.dtype == torch.bool
            )
        else:
            integer = bool(np.issubdtype(text_or_ids.dtype, np.integer))
        if text_or_ids.ndim != 1 or not integer:
            raise TypeError(
                f"token ids must be a 1-D array of integers, got {text_or_ids.ndim}-D "
                f"{text_or_ids.dtype}"
            )
        return [int(t) for t in text_or_ids.tolist()]
    if not isinstance(text_or_ids, Sequence) or isinstance(text_or_ids, (bytes, bytearray)):
        raise TypeError(
            "a prompt must be a str or a sequence of int token ids, got "
            f"{type(text_or_ids).__name__}"
        )
    ids = []
    for t in text_or_ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be ints, got {type(t).__name__} {t!r}")
        ids.append(int(t))
    return ids


def check_sampling(sampling: Any) -> SamplingParams:
    """``sampling`` if it is a ``SamplingParams`` (checked field by field when it was made), else
    ``RequestTypeError``."""
    if not isinstance(sampling, SamplingParams):
        raise RequestTypeError(
            "sampling", f"sampling must be a SamplingParams, got {type(sampling).__name__}"
        )
    # its fields were checked when it was made (frozen)
    return sampling


def per_prompt(
    prompts: Sequence[Any],
    sampling: Any,
    tenants: Sequence[str | None] | None,
    cache_salts: Sequence[str | None] | None = None,
    unsafe_salts: Sequence[str | None] | None = None,
) -> list[tuple[Any, Any, str | None, str | None, str | None]]:
    """``generate``'s arguments as ``(prompt, sampling, tenant, cache_salt, unsafe_salt)`` per
    prompt.

    One sampling may serve all prompts; ``tenants``, ``cache_salts`` and ``unsafe_salts`` give one
    per prompt.
    """
    named = (
        ("prompts", prompts),
        ("tenants", tenants),
        ("cache_salts", cache_salts),
        ("unsafe_salts", unsafe_salts),
    )
    for name, value in named:
        # a list or tuple: a lone string would run one request per character
        if not isinstance(value, (list, tuple)) and (name == "prompts" or value is not None):
            one = f"; for one, pass [{name[:-1]}]" if isinstance(value, (str, bytes)) else ""
            raise TypeError(
                f"{name} must be a list or tuple, one per prompt, got {type(value).__name__}{one}"
            )
    n = len(prompts)
    samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    columns = [[None] * n if value is None else list(value) for _, value in named[1:]]
    if len(samplings) != n or any(len(column) != n for column in columns):
        raise ValueError("give one sampling, tenant and salt per prompt (or one sampling for all)")
    return list(zip(prompts, samplings, *columns))
