"""Measure the engine path (issue 37): its non-blank lines, and the kvlab functions one ``generate`` passes.

    .venv/bin/python scripts/count_engine_path.py            # both numbers, and the list of functions
    .venv/bin/python scripts/count_engine_path.py --lines    # lines only (no model is loaded)

Lines: the non-blank lines of ``ENGINE_PATH`` (the files a request's path runs through, as the issue
counts them; a file that does not exist is reported and counted as 0). Functions: ``sys.setprofile``
over one ``Engine.generate`` of two prompts (8 new tokens each, greedy) on the bundled model, after a
warm-up call on the same engine; a function is counted once per (file, qualified name), for every
file under ``kvlab/`` (comprehensions and generator expressions are listed apart: Python 3.11 gives them
code objects of their own, 3.12 inlines most). Goals: <= 1,400 lines, <= 60 functions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_PATH = [
    *(
        f"kvlab/engine/{name}.py"
        for name in (
            "engine",
            "runner",
            "scheduler",
            "sequence",
            "intake",
            "tenants",
            "kv_store",
            "paged_attention",
            "sampling",
            "sampling_params",
            "models",
            "config",
        )
    ),
    *(f"kvlab/cache/{name}.py" for name in ("block_manager", "block_pool", "hashing", "interface")),
]


INLINE = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")


def count_lines(paths: list[str] = ENGINE_PATH) -> dict[str, int]:
    """Non-blank lines of each file in ``paths`` (relative to the repository root); -1 for a missing file."""
    out = {}
    for rel in paths:
        path = ROOT / rel
        out[rel] = (
            sum(1 for ln in path.read_text().splitlines() if ln.strip()) if path.exists() else -1
        )
    return out


def count_functions(max_tokens: int = 8) -> list[str]:
    """The distinct kvlab functions one ``Engine.generate`` call enters, as ``file:qualname``, sorted."""
    import torch

    from kvlab.engine import Engine, SamplingParams
    from kvlab.engine.models import load_model

    torch.manual_seed(0)
    model, tok = load_model(device="cpu")
    engine = Engine(model, tok, num_blocks=64)
    prompts = ["The passphrase is", "Once upon a time"]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts, sp)  # warm-up: lazy imports and first-call set-up are not the path
    kvlab = str(ROOT / "kvlab")
    seen: set[str] = set()

    def profiler(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(kvlab):
                rel = Path(code.co_filename).relative_to(ROOT)
                seen.add(f"{rel}:{getattr(code, 'co_qualname', code.co_name)}")

    sys.setprofile(profiler)
    try:
        engine.generate(prompts, sp)
    finally:
        sys.setprofile(None)
    return sorted(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", action="store_true", help="count lines only (no model)")
    args = ap.parse_args()
    lines = count_lines()
    for rel, n in lines.items():
        print(f"{n:6d}  {rel}" if n >= 0 else f"   n/a  {rel} (missing)")
    total = sum(n for n in lines.values() if n > 0)
    print(
        f"{total:6d}  engine path, non-blank lines ({sum(n >= 0 for n in lines.values())} files; goal <= 1,400)"
    )
    if args.lines:
        return
    codes = count_functions()
    # comprehensions and generator expressions are code objects of their own in Python 3.11, not functions
    funcs = [c for c in codes if not c.endswith(INLINE)]
    files = sorted({f.split(":")[0] for f in funcs})
    print(
        f"\none Engine.generate passes {len(funcs)} distinct kvlab functions in {len(files)} files "
        f"(goal <= 60; {len(codes)} code objects with comprehensions and generator expressions):"
    )
    for f in funcs:
        print(f"  {f}")


if __name__ == "__main__":
    main()
