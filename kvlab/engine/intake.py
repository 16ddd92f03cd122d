"""Request intake: check a request without the engine lock, then build its ``Request`` under it."""

from __future__ import annotations

import itertools
import random
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ..cache.block_manager import TenantScope
from .models import encode
from .sampling_params import SamplingParams
from .sequence import Request
from .tenants import SharedTenantsWarning, public_prefix_length, tenant_salt

__all__ = ["Checked", "Intake", "check_sampling", "per_prompt"]


Checked = tuple[list[int], SamplingParams, str | None, str | None]  # Intake.check's: ids, sampling, tenant, salt


class Intake:
    """Checks requests and builds their ``Request`` state: automatic ids, seeded generators, tenant scopes."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int | None,
                 check_fits: Callable[[int, int], None], isolation: str, secret: bytes, device: torch.device,
                 seed: int) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.check_fits, self.isolation, self._secret, self.device = check_fits, isolation, secret, device
        self.public_prefixes: list[tuple[int, ...]] = []  # token ids; used under "public-prefix"
        self._ids = itertools.count()
        self._rng = random.Random(seed)  # seeds of requests that give none
        self._warned_shared_tenants = False  # SharedTenantsWarning: once per engine

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

    def check(self, prompt: str | Sequence[int], sampling: SamplingParams | None, tenant: str | None,
              unsafe_salt: str | None) -> Checked:
        """Tokenize and check one request; raise ``TypeError``/``ValueError`` naming the problem."""
        sampling = check_sampling(SamplingParams() if sampling is None else sampling)
        for name, value in (("tenant", tenant), ("unsafe_salt", unsafe_salt)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
        if unsafe_salt is not None and tenant is not None:
            raise ValueError("give a tenant (the engine derives its salt) or an unsafe_salt, not both")
        ids = encode(self.tokenizer, prompt)  # text (with a tokenizer), or real int ids: floats, bools, bytes... raise
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if self.max_model_len is not None and len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"model's {self.max_model_len} positions")
        self.check_fits(len(ids), sampling.max_tokens)  # the pool's size only: fixed at construction
        if tenant is not None and self.isolation == "shared" and not self._warned_shared_tenants:
            self._warned_shared_tenants = True  # once per engine
            warnings.warn(SharedTenantsWarning(
                f"tenant {tenant!r} on an engine with isolation='shared': tenants share every cached prefix "
                "(one tenant's prompts can speed up, and so reveal themselves to, another's); use "
                "isolation='tenant' or 'public-prefix' to keep them apart"), stacklevel=3)
        return ids, sampling, tenant, unsafe_salt if unsafe_salt is not None else self.salt_for(tenant)

    def admit(self, checked: Checked, request_id: Hashable | None, live: dict[Hashable, Request]) -> Request:
        """The ``Request`` of a checked request (call it under the engine lock): ids, scope, generator, arrival."""
        ids, sampling, tenant, salt = checked
        public = public_prefix_length(ids, self.public_prefixes) if self.isolation == "public-prefix" else 0
        seq_id, request_id = self.new_ids(request_id, live)
        return Request(seq_id, request_id, ids, sampling, TenantScope(salt, public, tenant),
                       arrival_time=time.perf_counter(), generator=self.generator(sampling))

    def new_ids(self, request_id: Hashable | None, live: dict[Hashable, Request]) -> tuple[int, Hashable]:
        """A fresh internal sequence id, and ``request_id`` or, for None, an automatic id no ``live`` request uses."""
        if request_id is not None and request_id in live:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq_id = next(self._ids)
        if request_id is None:
            request_id = seq_id
            while request_id in live:  # a caller chose this number: never collide with it
                request_id = next(self._ids)
        return seq_id, request_id

    def generator(self, sampling: SamplingParams) -> torch.Generator | None:
        """A generator seeded by ``sampling.seed`` (or the engine's seeded draw); None for greedy."""
        if sampling.greedy:
            return None
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        return torch.Generator(device=self.device).manual_seed(seed)


def check_sampling(sampling: Any) -> SamplingParams:
    """``sampling`` if it is a valid ``SamplingParams``; else ``TypeError``/``ValueError``."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    sampling.validate()
    return sampling


def per_prompt(prompts: Sequence[Any], sampling: Any, tenants: Sequence[str | None] | None,
               unsafe_salts: Sequence[str | None] | None) -> list[tuple[Any, Any, str | None, str | None]]:
    """``generate``'s arguments as ``(prompt, sampling, tenant, salt)`` per prompt (one sampling may serve all)."""
    for name, value in (("prompts", prompts), ("tenants", tenants), ("unsafe_salts", unsafe_salts)):
        # a list or tuple: a lone string would run one request per character
        if not isinstance(value, (list, tuple)) and (name == "prompts" or value is not None):
            one = f"; for one, pass [{name[:-1]}]" if isinstance(value, (str, bytes)) else ""
            raise TypeError(f"{name} must be a list or tuple, one per prompt, got {type(value).__name__}{one}")
    n = len(prompts)
    samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    tenants = [None] * n if tenants is None else list(tenants)
    salts = [None] * n if unsafe_salts is None else list(unsafe_salts)
    if len(samplings) != n or len(tenants) != n or len(salts) != n:
        raise ValueError("give one sampling, tenant and salt per prompt (or one sampling for all)")
    return list(zip(prompts, samplings, tenants, salts))
