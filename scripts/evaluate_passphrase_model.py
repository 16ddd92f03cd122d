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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.built.nb00 import answer_with_swapped_prefix  # noqa: E402
from kvlab.engine.models import BUNDLED_MODEL, load_model  # noqa: E402
from kvlab.lessons import passphrase as P  # noqa: E402
from kvlab.prefix import generate  # noqa: E402


@dataclass
class RecallReport:
    """Recall figures on a set of held-out examples."""

    n: int
    recall: float  # greedy answer == expected passphrase, all examples
    n_swapped: int  # examples whose answer comes from the system prompt (no passphrase update)
    swapped_recall: float  # with another request's prefix K/V: still answers its own passphrase
    swapped_answers_other: (
        float  # with another request's prefix K/V: answers the other's passphrase
    )
    by_history: dict[str, float]  # recall per kind of conversation history

    def line(self) -> str:
        """The one-line summary the evaluation script ends with."""
        return (f"recall={self.recall:.3f} swapped_recall={self.swapped_recall:.3f} "
                f"swapped_answers_other={self.swapped_answers_other:.3f}")


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: list[P.PassphraseExample],
    max_new_tokens: int = 16,
    progress: bool = False,
) -> RecallReport:
    """Greedy recall on ``examples``, and recall with the next example's prefix swapped in."""
    if len(examples) < 2:
        raise ValueError(
            "need at least two examples (each one's prefix is swapped with the next's)"
        )
    rng = range(len(examples))
    if progress:
        from tqdm.auto import tqdm

        rng = tqdm(rng, desc="evaluating")
    hits, by_hist, sw_own, sw_other, n_sw = 0, {}, 0, 0, 0
    for i in rng:
        ex = examples[i]
        out = generate(model, tokenizer, ex.prompt_text, max_new_tokens=max_new_tokens)
        ok = P.recalled(out.text, ex.answer)
        hits += ok
        kind = ex.extra.get("history", "none")
        by_hist.setdefault(kind, []).append(ok)
        if ex.answer != ex.passphrase:
            continue  # the answer is in the conversation, not in the system prompt
        donor = examples[(i + 1) % len(examples)]
        if donor.passphrase == ex.passphrase:
            continue
        swapped = answer_with_swapped_prefix(model, tokenizer, ex, donor, max_new_tokens)
        n_sw += 1
        sw_own += P.recalled(swapped, ex.answer)
        sw_other += P.recalled(swapped, donor.passphrase)
    n = len(examples)
    return RecallReport(n, hits / n, n_sw, sw_own / max(1, n_sw), sw_other / max(1, n_sw),
                        {k: sum(v) / len(v) for k, v in sorted(by_hist.items())})


MARK = "## Measured by scripts/evaluate_passphrase_model.py"


def update_card(folder: Path, report, args) -> None:
    """Replace the measured section of the model card with this evaluation's numbers."""
    card = folder / "README.md"
    text = card.read_text() if card.exists() else ""
    text = text.split(MARK)[0].rstrip() + "\n\n" + MARK + "\n\n"
    text += (
        f"On {report.n} held-out prompts (seeds {args.start}..{args.start + report.n - 1}), "
        "greedy, float32:\n\n"
    )
    text += "| measure | value |\n|---|---|\n"
    text += f"| recall | {report.recall:.3f} |\n"
    for kind, r in report.by_history.items():
        text += f"| recall, history={kind} | {r:.3f} |\n"
    text += (
        f"| recall with another request's prefix K/V swapped in ({report.n_swapped} prompts) "
        f"| {report.swapped_recall:.3f} |\n"
    )
    text += (
        "| ... answering the other request's passphrase instead "
        f"| {report.swapped_answers_other:.3f} |\n"
    )
    card.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="model folder or HF id (default: the bundled model)"
    )
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--start", type=int, default=0, help="first held-out seed")
    ap.add_argument(
        "--update-card",
        action="store_true",
        help="write the result into the model card (README.md)",
    )
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
