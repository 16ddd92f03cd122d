"""Is this endpoint sharing its prompt cache? The audit of Gu et al. over the wire, and what it
leaks.

- ``client``     the attacker's instrument: TTFT of a streamed one-token completion, timed on the
                 client (any OpenAI-compatible base URL; API key; optional vLLM-style
                 ``cache_salt``).
- ``prompts``    random spaced-letter prompts of a length in tokens with a shared prefix fraction.
- ``procedure``  the cache-hit and cache-miss procedures in random order, the two-sample KS test
                 with a decision at ``alpha``, and the samples a detection needs (power by
                 subsampling).
- ``dictionary`` the dictionary attack on a passphrase in the victim's system prompt.
- ``local``      start ``kvlab serve`` or ``vllm serve`` on a free loopback port to audit.

CLI: ``python -m kvlab.audit --base-url http://127.0.0.1:8000/v1 --keys VICTIM_KEY OTHER_ORG_KEY``.

Reference: C. Gu, X. L. Li, R. Kuditipudi, P. Liang, T. Hashimoto, "Auditing Prompt Caching in
Language Model APIs", ICML 2025 (arXiv 2502.07776). The code here is written from the paper's
description.
"""

from .client import AuditHTTPError, Endpoint, Timing, first_model, measure
from .dictionary import (
    Guess,
    Template,
    accuracy,
    chance_pvalue,
    make_template,
    run_dictionary_attack,
)
from .procedure import (
    AuditConfig,
    AuditResult,
    Level,
    calibrate,
    ks_test,
    miss_prompt,
    power,
    power_at,
    run_audit,
    run_levels,
    samples_to_detect,
)

__all__ = [
    "AuditConfig",
    "AuditHTTPError",
    "AuditResult",
    "Endpoint",
    "Guess",
    "Level",
    "Template",
    "Timing",
    "accuracy",
    "calibrate",
    "chance_pvalue",
    "first_model",
    "ks_test",
    "make_template",
    "miss_prompt",
    "measure",
    "power",
    "power_at",
    "run_audit",
    "run_dictionary_attack",
    "run_levels",
    "samples_to_detect",
]
