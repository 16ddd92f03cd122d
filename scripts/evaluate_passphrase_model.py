"""Evaluate a passphrase model on held-out prompts (passphrases never seen in training).

    python scripts/evaluate_passphrase_model.py [--model PATH] [--n 300] [--device auto]

Prints greedy exact recall, recall per kind of conversation history, and recall when another
request's prefix K/V is swapped in. The last line is
``recall=<x> swapped_recall=<y> swapped_answers_other=<z>``; the exit code is 1 when
recall < 0.95 or swapped_recall > 0.05 (the series relies on both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.engine.models import BUNDLED_MODEL, load_model  # noqa: E402
from kvlab.lessons import passphrase as P  # noqa: E402
from kvlab.lessons.nb00_passphrase import evaluate  # noqa: E402

MARK = "## Measured by scripts/evaluate_passphrase_model.py"


def update_card(folder: Path, report, args) -> None:
    """Replace the measured section of the model card with this evaluation's numbers."""
    card = folder / "README.md"
    text = card.read_text() if card.exists() else ""
    text = text.split(MARK)[0].rstrip() + "\n\n" + MARK + "\n\n"
    text += f"On {report.n} held-out prompts (seeds {args.start}..{args.start + report.n - 1}), greedy, float32:\n\n"
    text += "| measure | value |\n|---|---|\n"
    text += f"| recall | {report.recall:.3f} |\n"
    for kind, r in report.by_history.items():
        text += f"| recall, history={kind} | {r:.3f} |\n"
    text += f"| recall with another request's prefix K/V swapped in ({report.n_swapped} prompts) | {report.swapped_recall:.3f} |\n"
    text += f"| ... answering the other request's passphrase instead | {report.swapped_answers_other:.3f} |\n"
    card.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or HF id (default: the bundled model)")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--start", type=int, default=0, help="first held-out seed")
    ap.add_argument("--update-card", action="store_true", help="write the result into the model card (README.md)")
    args = ap.parse_args()

    model, tok = load_model(args.model, device=args.device, dtype="float32")
    examples = P.make_examples(args.n, "heldout", start=args.start)
    report = evaluate(model, tok, examples, progress=sys.stderr.isatty())
    print(f"held-out examples: {report.n} (seeds {args.start}..{args.start + args.n - 1})")
    for kind, r in report.by_history.items():
        print(f"  recall with history={kind:6s}: {r:.3f}")
    print(f"swapped-prefix examples: {report.n_swapped}")
    if args.update_card:
        update_card(Path(args.model) if args.model else BUNDLED_MODEL, report, args)
    print(report.line())
    return 0 if report.recall >= 0.95 and report.swapped_recall <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
