"""``python -m kvlab.audit``: audit an OpenAI-compatible endpoint for prompt-cache sharing \
(Gu et al.).

    python -m kvlab.audit --base-url http://127.0.0.1:8000/v1 --keys VICTIM_KEY [ATTACKER_KEY ...]

The victim is the first key. Levels tested: the victim's own key (per user), then each further key
(named by ``--levels``, e.g. ``per-org global``). ``--salt-per-user`` adds a ``cache_salt`` per key
(vLLM's field). ``--keys-file`` reads keys, one per line, instead of the command line. Prints the
table (p-value, samples, decision at ``--alpha``); ``--json FILE`` also writes the results (a new
file; an existing one is refused unless ``--overwrite``). ``--json`` is checked before anything is
measured: its folder must exist and be writable, and it must not be a folder nor an input
(``--keys-file``, even with ``--overwrite``). Should the write still fail at the end, the results go
to stdout instead of being lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .client import AuditHTTPError, Endpoint, list_models
from .procedure import AuditConfig, Level, calibrate, run_audit, samples_to_detect


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(prog="python -m kvlab.audit", description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument(
        "--keys", nargs="+", default=None, help="API keys: the victim first, then attackers"
    )
    ap.add_argument(
        "--keys-file",
        default=None,
        help="a file with one API key per line (read only; a regular file of at most 1 MiB)",
    )
    ap.add_argument(
        "--levels",
        nargs="+",
        default=None,
        help="names of the levels of the attacker keys after the first (default: key 2, "
             "key 3, ...)",
    )
    ap.add_argument(
        "--model", default=None, help="model name (default: the first that /v1/models lists)"
    )
    ap.add_argument(
        "--salt-per-user", action="store_true", help="send cache_salt=<user> with every request"
    )
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--prefix-fraction", type=float, default=0.95)
    ap.add_argument("--victim-requests", type=int, default=1)
    ap.add_argument("--samples", type=int, default=30, help="samples per procedure")
    ap.add_argument("--alpha", type=float, default=1e-3, help="significance level of the decision")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--power", action="store_true", help="also estimate the samples needed to detect"
    )
    ap.add_argument("--json", default=None, help="write the results to this new file")
    ap.add_argument("--overwrite", action="store_true",
                    help="let --json replace an existing file (never an input such as --keys-file)")
    return ap.parse_args(argv)


MAX_KEYS_FILE_BYTES = 1 << 20


def check_key(key: str, where: str) -> str:
    """``key`` if an HTTP header can carry it (visible ASCII); else ``ValueError`` naming where it
    is, not the key."""
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"{where} holds U+{ord(bad):04X} at character {key.index(bad) + 1}: an API key is sent "
            "in an HTTP header, which carries visible ASCII only (no spaces, no accents)"
        )
    return key


def read_keys(args: argparse.Namespace) -> list[str | None]:
    """The keys from ``--keys`` or ``--keys-file`` ([None] when neither: an open server, one user).

    The file is a regular file of at most 1 MiB of UTF-8 (a leading BOM is skipped), one key a line;
    every key must be visible ASCII. A refusal names the key by its place (line or position), never
    by its text.
    """
    from ..inputs import read_input

    if args.keys and args.keys_file:
        raise ValueError("give --keys or --keys-file, not both")
    if args.keys_file:
        data = read_input(args.keys_file, "--keys-file", MAX_KEYS_FILE_BYTES)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--keys-file {args.keys_file} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                f"byte {e.start + 1})"
            ) from None
        keys = [check_key(line.strip(), f"--keys-file {args.keys_file} line {n}: the key")
                for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not keys:
            raise ValueError(f"--keys-file {args.keys_file} holds no key")
        return keys
    return (
        [check_key(k, f"--keys: key {i}") for i, k in enumerate(args.keys, 1)]
        if args.keys
        else [None]
    )


def check_context(config: AuditConfig, model: str, context: int | None) -> None:
    """Refuse a prompt the server's advertised context (``max_model_len``) cannot hold with its one
    answer token."""
    if context is not None and config.prompt_tokens >= context:
        raise ValueError(
            f"--prompt-tokens {config.prompt_tokens} does not fit {model}'s context: GET "
            f"/v1/models says max_model_len {context}, and each probe adds one generated token "
            f"(give at most {context - 1})"
        )


def _same_file(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` name one file (through links too), or the same path when one does
    not exist."""
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b) or a.resolve() == b.resolve()
    except OSError:
        return False


def check_json_target(path: str, overwrite: bool, inputs: dict[str, str | None]) -> Path:
    """``--json``'s file, checked before anything is measured; ``ValueError`` says what is wrong
    with it.

    ``inputs`` maps an option (``--keys-file``) to the file it reads: the results never go over one
    of them.
    """
    target = Path(path)
    for option, given in inputs.items():
        if given is not None and _same_file(target, Path(given)):
            raise ValueError(
                f"--json {path} is the {option} file: the audit never writes over an input "
                "(not even with --overwrite); pick another file"
            )
    if target.is_dir():
        raise ValueError(f"--json {path} is a folder: give a file name inside it")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"--json {path}: the folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--json {path}: cannot write in the folder {folder}")
    if target.exists() and not overwrite:
        raise ValueError(f"{path} exists: pick a new file or pass --overwrite")
    if target.exists() and not target.is_file():
        raise ValueError(f"--json {path} exists and is not a regular file")
    return target


def write_results(target: Path, text: str, overwrite: bool) -> None:
    """Write ``text`` to ``target``: a new file, or (``overwrite``) one that replaces the file
    there."""
    with open(target, "w" if overwrite else "x", encoding="utf-8") as f:
        f.write(text)


def build_levels(base_url: str, keys: list[str | None], names: list[str] | None, model: str,
                 salt_per_user: bool) -> list[Level]:
    """Per-user (the victim's own key) and one level per further key; users are salted apart on
    request."""
    attackers = keys[1:]
    names = names or [f"key {i + 2}" for i in range(len(attackers))]
    if len(names) != len(attackers):
        raise ValueError(
            f"--levels names {len(names)} levels but {len(attackers)} attacker keys were given"
        )
    salt = (lambda user: f"user-{user}") if salt_per_user else (lambda user: None)
    victim = Endpoint(base_url, keys[0], model, salt(0), "victim")
    levels = [
        Level("per-user (same key)", victim, Endpoint(base_url, keys[0], model, salt(0), "victim"))
    ]
    for i, (name, key) in enumerate(zip(names, attackers), start=1):
        levels.append(Level(name, victim, Endpoint(base_url, key, model, salt(i), f"attacker {i}")))
    return levels


def main(argv: list[str] | None = None) -> int:
    """Run the audit and print one line per level; exit 0, or 2 with a message on bad input or a
    failed request."""
    args = parse_args(argv)
    try:
        target = (
            check_json_target(args.json, args.overwrite, {"--keys-file": args.keys_file})
            if args.json
            else None
        )
        keys = read_keys(args)
        # every count is bounded before a request, the prompt against the served context before one
        # is measured
        config = AuditConfig(
            args.prompt_tokens,
            args.prefix_fraction,
            args.victim_requests,
            args.samples,
            args.alpha,
            args.seed,
        )
        probe_ep = Endpoint(args.base_url, keys[0])
        cards = list_models(probe_ep)
        model = args.model or cards[0].id
        check_context(config, model, next((c.max_model_len for c in cards if c.id == model), None))
        ratio = calibrate(Endpoint(args.base_url, keys[0], model), seed=args.seed)
        config = dataclasses.replace(config, tokens_per_letter=ratio)
        levels = build_levels(args.base_url, keys, args.levels, model, args.salt_per_user)
    except (ValueError, AuditHTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"model {model}; {ratio:.2f} tokens per spaced letter; {config.samples} samples per "
        f"procedure, {config.prompt_tokens} prompt tokens, prefix fraction "
        f"{config.prefix_fraction}, alpha {config.alpha}"
    )
    rows = []
    for level in levels:
        try:
            res = run_audit(level, config)
        except AuditHTTPError as e:
            print(f"error at level {level.name}: {e}", file=sys.stderr)
            return 2
        row, note = res.row(), res.cached_note()
        if args.power:
            row["samples to detect (power 0.9)"] = samples_to_detect(res, seed=args.seed)
        rows.append(row)
        print(
            f"{level.name:>24}: median TTFT hit {row['median TTFT hit (ms)']:.1f} ms, miss "
            f"{row['median TTFT miss (ms)']:.1f} ms, KS p = {res.pvalue:.3g} -> "
            f"{'sharing DETECTED' if res.detected else 'not detected'} at alpha {config.alpha}"
            + (f"; samples to detect: {row['samples to detect (power 0.9)']}" if args.power else "")
            + (f"; {note}" if note else "")
        )
    if target is not None:
        text = json.dumps({"config": vars(config), "rows": rows}, indent=1, default=str)
        try:
            write_results(target, text, args.overwrite)
        # checked before measuring, yet gone or full since: keep the results anyway
        except OSError as e:
            print(
                f"error: cannot write --json {args.json}: {e}; the results follow on stdout",
                file=sys.stderr,
            )
            print(text)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
