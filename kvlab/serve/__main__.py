"""``python -m kvlab.serve [--model smollm2] [--port 8000]``: start the OpenAI-compatible server.

Binds 127.0.0.1 unless ``--host`` says otherwise. Tenants come from ``--api-keys FILE`` or
``$KVLAB_API_KEYS`` (JSON ``{"key": "tenant"}``); without either the server is open. With keys the
cache isolation defaults to ``tenant`` (no tenant hits another's cached prefix); ``--isolation
shared`` must be given to share across keys (as vLLM does without ``cache_salt``). The server secret
(tenant salts, ``cache_salt`` HMAC) comes from ``$KVLAB_SERVER_SECRET`` (>= 16 bytes), else a random
one per start; it is never a command-line argument (other users can read those in ``ps``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..engine.tenants import POLICIES
from .protocol import PROMPT_BYTES_PER_TOKEN

BUNDLED_NAME = "kvlab-passphrase-qwen2"


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m kvlab.serve", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="'smollm2', a HF folder or id (default: the bundled model)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="the name clients send (default: from --model)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--isolation",
        choices=POLICIES,
        default=None,
        help="the engine's cache isolation policy (default: tenant when API keys are configured, "
        "so no tenant gets cached tokens from another's prompt; shared on an open server, whose "
        "requests are all one anonymous tenant). Give --isolation shared to share across keys on "
        "purpose",
    )
    p.add_argument(
        "--public-prefix",
        action="append",
        default=[],
        help="text every tenant may share under --isolation public-prefix (repeatable): "
        "completions that start with it, and chats whose system message is it (as the chat "
        "template renders it)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        help="JSON file {key: tenant} (else $KVLAB_API_KEYS; none = open)",
    )
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the token budget of a step, which a long prompt's prefill is chunked into "
        "(default: sized to the device: 2048 on CUDA, else what the model prefills in about 0.25 "
        "s, measured at start; a step's time is every running stream's inter-token gap)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="run each prompt's prefill whole instead of in chunks of the step's token budget "
        "(--max-num-batched-tokens); chunked is the default, as in vLLM V1",
    )
    p.add_argument(
        "--no-packed-linear",
        action="store_true",
        help="keep F.linear for the linear layers; by default a float32 model on a CPU runs them "
        "on prepacked GEMMs: oneDNN's, and kvlab's panel GEMM for a decode step's few rows "
        "(SpeedPaths.packed_linear: the same greedy tokens, faster)",
    )
    p.add_argument(
        "--no-paged-kernel",
        action="store_true",
        help="keep the SDPA path for decodes; by default a float32 model on a CPU attends them "
        "with kvlab's C++ paged-attention kernel (SpeedPaths.paged_kernel; built once per "
        "machine)",
    )
    p.add_argument(
        "--no-fused-layers",
        action="store_true",
        help="run a Llama model through transformers' own layers; by default a float32 Llama on "
        "a CPU runs with four fused prepacked GEMMs a layer (SpeedPaths.fused_layers: same "
        "greedy tokens)",
    )
    p.add_argument(
        "--max-waiting", type=int, default=128, help="queued requests beyond the batch before 503"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="bytes of a request body before 413 (default: what the largest valid request of "
        "this model can need, from its context and --max-prompt-bytes, at most 1 MiB; "
        "kvlab.serve.guard)",
    )
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help="UTF-8 bytes of prompt text (or chat message contents) accepted before tokenizing; "
        f"larger is refused with 400 (default: {PROMPT_BYTES_PER_TOKEN} x the model's context in "
        "tokens)",
    )
    p.add_argument(
        "--head-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a whole request head (then it is closed: a "
        "slowloris client holds nothing); also an idle kept-alive connection's limit (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a POST's body may take to arrive after its head (408 after; default 30)",
    )
    p.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve GET /metrics without an API key on a server with keys (by default it needs "
        "one: its counters show every tenant's load)",
    )
    p.add_argument(
        "--enable-debug-endpoint", action="store_true", help="GET /debug/engine (invariants, leaks)"
    )
    p.add_argument("--log-level", default="warning")
    return p


def default_isolation(given: str | None, keys: dict[str, str]) -> str:
    """The isolation policy: ``given`` when the command line names one, else ``tenant`` with API
    keys, else ``shared``.

    Keys name tenants, and tenants that share one cache learn each other's prompts through its
    timing (and ``cached_tokens``): sharing across keys is kept for operators who ask for it by
    name. An open server has one anonymous tenant, so "shared" and "tenant" serve it alike; "shared"
    stays its default.
    """
    if given is not None:
        return given
    return "tenant" if keys else "shared"


# seconds a start waits on another process's C++ build of a speed path
SPEED_BUILD_WAIT_S = 45.0


def speed_paths(model, off: set[str] = frozenset()):
    """The server's speed paths for ``model`` (a ``kvlab.engine.speed.SpeedPaths``): each on where
    it runs.

    ``off`` names those turned off by hand. ``describe()`` says in one line which are on, and why
    the others are off. ``scripts/serve_bench.py`` builds its in-process engine with the same
    choice.
    """
    from ..engine.speed import SpeedPaths

    # another start's build (or a killed one's compiler still running) is waited on this long at
    # most: the server then starts without that path and says why; a killed build's lock is removed
    # but not rebuilt during the start (the set-up, the next start or `python -m kvlab.engine.speed`
    # builds it)
    return SpeedPaths.auto(model, off, build_wait_s=SPEED_BUILD_WAIT_S, rebuild_stale=False)


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line (checked before the model loads), or None."""
    if args.public_prefix and args.isolation != "public-prefix":
        return "--public-prefix needs --isolation public-prefix"
    at_least = [
        ("--max-waiting", args.max_waiting, 0),
        ("--num-blocks", args.num_blocks, 1),
        ("--block-size", args.block_size, 1),
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
        ("--max-body-bytes", args.max_body_bytes, 1),
        ("--max-prompt-bytes", args.max_prompt_bytes, 1),
    ]
    for option, value, low in at_least:
        if value is not None and value < low:
            return f"{option} must be at least {low}, got {value}"
    for option, value in (
        ("--head-timeout", args.head_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if not 0 < value < float("inf"):
            return f"{option} must be a positive number of seconds, got {value}"
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < args.max_num_seqs:
        return (
            f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
            f"--max-num-seqs ({args.max_num_seqs}): a step gives each running sequence a token"
        )
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    return check_model_path(args.model)


def check_model_path(model: str | None) -> str | None:
    """Why ``--model`` cannot be loaded, for a path that is missing or no model folder (cheap: loads
    nothing)."""
    from ..engine.smollm2 import is_alias

    if model is None or is_alias(model):
        return None
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            return f"--model {model}: not a model folder (no config.json in it)"
        return None
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model:
        return f"--model {model}: no such folder"
    return None  # a hub id: its cache is looked up when the model loads


def public_prefixes(tokenizer, text: str) -> list[str | list[int]]:
    """What ``--public-prefix TEXT`` registers: the text, and the tokens every chat whose system
    message is ``TEXT`` starts with.

    A chat is rendered by the model's chat template, which puts markup before the system message
    (``<|im_start|>system\n`` in ChatML): the text alone is no prefix of it. The chat prefix is what
    two chats with this system message and different user messages have in common, as the server
    tokenizes them.
    """
    from ..engine.models import encode

    out: list[str | list[int]] = [text]
    if not getattr(tokenizer, "chat_template", None):
        return out
    try:
        a, b = (
            encode(
                tokenizer,
                tokenizer.apply_chat_template(
                    [{"role": "system", "content": text}, {"role": "user", "content": user}],
                    add_generation_prompt=True,
                    tokenize=False,
                ),
            )
            for user in ("a", "Zq 9")
        )
    except Exception:  # a template without a system role: the text alone
        return out
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if n:
        out.append(a[:n])
    return out


def main(argv: list[str] | None = None) -> int:
    """Load the model, build the engine and serve until interrupted."""
    args = build_parser().parse_args(argv)
    if problem := check_args(args):
        print(f"kvlab serve: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    from ..engine.engine import Engine
    from ..engine.models import load_model
    from ..engine.tenants import check_secret
    from .app import ServeConfig, create_app
    from .guard import default_body_limit, head_timeout_protocol
    from .tenancy import load_api_keys

    try:
        keys = load_api_keys(args.api_keys)
        secret = check_secret(os.environ.get("KVLAB_SERVER_SECRET"))
    except (ValueError, TypeError) as e:
        print(f"kvlab serve: {e}", file=sys.stderr)
        return 2
    isolation = default_isolation(args.isolation, keys)
    try:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    except (OSError, ValueError) as e:
        # a model that cannot be found or read: one line, no traceback
        print(
            f"kvlab serve: cannot load the model {args.model or BUNDLED_NAME}: {e}", file=sys.stderr
        )
        return 2
    budget = args.max_num_batched_tokens
    if budget is None:  # sized to the device: a step's time is every running stream's gap
        from .budget import default_token_budget

        budget, how = default_token_budget(model, args.max_num_seqs)
        print(
            f"kvlab serve: token budget {budget} a step ({how}; --max-num-batched-tokens sets it)",
            file=sys.stderr,
            flush=True,
        )
    # the speed paths run where they can; where one cannot, the server says why and runs without it
    off = {
        key
        for key in ("packed_linear", "paged_kernel", "fused_layers")
        if getattr(args, "no_" + key)
    }
    speed = speed_paths(model, off)
    print(f"kvlab serve: {speed.describe()}", file=sys.stderr, flush=True)
    engine = Engine(
        model,
        tokenizer,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=not args.no_prefix_caching,
        isolation=isolation,
        secret=secret,
        enable_chunked_prefill=False if args.no_chunked_prefill else None,
        accelerator=speed,
    )
    # as text (completions) and as a chat's system turn (the template's markup)
    for text in args.public_prefix:
        for prefix in public_prefixes(tokenizer, text):
            engine.add_public_prefix(prefix)
    name = args.served_model_name or (BUNDLED_NAME if args.model is None else str(args.model))
    # the secret is the engine's alone: it derives every salt, with or without a request's
    # cache_salt
    config = ServeConfig(model_name=name, api_keys=keys, max_waiting=args.max_waiting,
                         max_body_bytes=args.max_body_bytes if args.max_body_bytes is not None else
                         default_body_limit(engine.max_model_len, args.max_prompt_bytes),
                         debug_endpoint=args.enable_debug_endpoint,
                         max_prompt_bytes=args.max_prompt_bytes, body_timeout=args.body_timeout,
                         metrics_open=args.open_metrics)
    who = f"{len(set(keys.values()))} tenants" if keys else "open (no API keys)"
    print(
        f"kvlab serve: {name} on http://{args.host}:{args.port}/v1, isolation {isolation}, {who}",
        flush=True,
    )
    # chosen by name (the default with keys is "tenant"): said once, at start
    if keys and isolation == "shared":
        print(
            "kvlab serve: --isolation shared with API keys: every tenant hits every other's "
            "cached prefixes (and can time them); use --isolation tenant to keep them apart",
            file=sys.stderr,
            flush=True,
        )
    # h11 with a deadline on each request head; a kept-alive idle connection is closed after at most
    # 5 s
    uvicorn.run(
        create_app(engine, config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=head_timeout_protocol(args.head_timeout),
        timeout_keep_alive=min(5, args.head_timeout),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
