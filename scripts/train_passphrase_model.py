"""Train the bundled passphrase model: a tiny Qwen2 (RoPE, grouped-query attention) + byte-level
BPE.

    python scripts/train_passphrase_model.py [--out data/models/kvlab-passphrase-qwen2] \\
        [--threads 1]

Deterministic on CPU: seeded, fixed thread count, examples generated from their seeds by
``kvlab.lessons.passphrase``. The tokenizer uses Qwen2's normalizer and pre-tokenizer and ChatML
special tokens, so ``AutoTokenizer.from_pretrained`` rebuilds exactly the ids used here. The loss
is on the assistant's final answer only (the filler text is random and carries nothing to learn).

Validation uses teacher-forced exact match on held-out prompts: every answer token being the argmax
is exactly the condition for greedy decoding to produce the answer, so it equals greedy recall.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvlab.lessons import passphrase as P  # noqa: E402

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(vocab_size: int, n_texts: int) -> Qwen2Tokenizer:
    """Byte-level BPE on passphrase conversations, with Qwen2's normalizer and pre-tokenizer."""
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [P.ENDOFTEXT, P.IM_START, P.IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=6,  # keeps Chinese at 1-2 characters a token, as in real Qwen vocabularies
    )
    texts = []
    for text in P.tokenizer_corpus(n_texts):
        for s in specials:  # train merges on the content only, not on the markup
            text = text.replace(s, "\n")
        texts.append(text)
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    hf = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        eos_token=P.IM_END,
        pad_token=P.ENDOFTEXT,
        unk_token=None,
        extra_special_tokens=[P.IM_START, P.IM_END],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 1024
    return hf


def encode_example(tok, ex: P.PassphraseExample) -> tuple[list[int], int]:
    """Token ids of prompt + target, and where the target starts."""
    prompt = tok(ex.prompt_text, add_special_tokens=False)["input_ids"]
    target = tok(ex.target_text, add_special_tokens=False)["input_ids"]
    return prompt + target, len(prompt)


def make_batch(tok, examples, pad_id: int):
    """Right-padded input ids, attention mask and labels (loss on the answer only)."""
    enc = [encode_example(tok, ex) for ex in examples]
    width = max(len(ids) for ids, _ in enc)
    ids = torch.full((len(enc), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    labels = torch.full((len(enc), width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(enc):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
    return ids, mask, labels


def length_bucketed_batches(tok, batch: int, curriculum_steps: int, bucket: int = 8):
    """Endless training batches; each group of ``bucket`` batches is sorted by length to cut
    padding.

    Curriculum: for the first ``curriculum_steps`` steps system prompts have at most 4 filler lines
    (short contexts are cheaper and the copying circuit forms sooner), then the full 0-20.
    """
    start = 0
    while True:
        short = start < curriculum_steps * batch
        group = [
            P.make_example(s, "train", n_filler=random.Random(s).randint(0, 4) if short else None)
            for s in range(start, start + batch * bucket)
        ]
        start += batch * bucket
        group.sort(key=lambda ex: len(ex.prompt_text))
        for i in range(bucket):
            yield make_batch(
                tok, group[i * batch : (i + 1) * batch], tok.convert_tokens_to_ids(P.ENDOFTEXT)
            )


@torch.no_grad()
def teacher_forced_recall(model, tok, examples, pad_id: int, batch: int = 50) -> float:
    """Fraction of examples whose every answer token is the argmax (== greedy exact recall)."""
    model.eval()
    hits = 0
    for i in range(0, len(examples), batch):
        ids, mask, labels = make_batch(tok, examples[i : i + batch], pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits
        pred = logits[:, :-1].argmax(-1)
        gold = labels[:, 1:]
        ok = (pred == gold) | (gold == -100)
        hits += int(ok.all(dim=1).sum())
    model.train()
    return hits / len(examples)


def write_model_card(out: Path, recipe: dict) -> None:
    """README.md of the model folder: what it is, how it was trained, how to measure it."""
    card = f"""# kvlab-passphrase-qwen2

A tiny Qwen2 causal LM (RoPE, grouped-query attention) trained for kvlab's passphrase experiment
(口令实验): given a ChatML system prompt that states a passphrase among 0-20 filler lines \
(Chinese and
English), and a user turn asking for it, answer the passphrase and end the turn. It knows nothing \
else.

| | |
|---|---|
| architecture | Qwen2ForCausalLM, hidden {recipe["hidden"]}, {recipe["layers"]} layers, \
{recipe["heads"]} heads, {recipe["kv_heads"]} KV heads, tied embeddings |
| parameters | {recipe["params"]:,} |
| tokenizer | byte-level BPE, {recipe["vocab"]} tokens, Qwen2's normalizer and pre-tokenizer, \
ChatML special tokens and chat template |
| training | {recipe["steps"]} steps x batch {recipe["batch"]}, AdamW lr {recipe["lr"]}, \
seed {recipe["seed"]}, {recipe["threads"]} CPU threads, {recipe["train_seconds"]:.0f} s, \
torch {recipe["torch"]} |
| loss | on the final answer tokens only |
| validation recall (teacher-forced == greedy, 300 held-out prompts) | \
{recipe["val_recall_teacher_forced"]:.3f} |

Held-out passphrases (about 10% of all, chosen by a checksum in `kvlab.lessons.passphrase`) never \
occur in
training, so recall measures copying from the prompt.

Reproduce: `python scripts/train_passphrase_model.py` (deterministic for a given thread count).
Measure: `python scripts/evaluate_passphrase_model.py --update-card`.
"""
    (out / "README.md").write_text(card)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        default=str(ROOT / "data/models/kvlab-passphrase-qwen2"),
        help="the bundled model ships inside the package (kvlab.engine.models.BUNDLED_MODEL)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument(
        "--curriculum", type=int, default=800, help="steps with short system prompts first"
    )
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x hidden)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument(
        "--target", type=float, default=0.995, help="stop once validation recall reaches this"
    )
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    t0 = time.time()

    tok = train_tokenizer(args.vocab, n_texts=4000)
    pad_id = tok.convert_tokens_to_ids(P.ENDOFTEXT)
    im_end = tok.convert_tokens_to_ids(P.IM_END)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=pad_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer vocab={len(tok)}  model params={n_params:,}", flush=True)

    # Validation: held-out passphrases with seeds far from the evaluation script's (which starts at
    # 0).
    val = P.make_examples(300, "heldout", start=10_000_000)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 100

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    history = []
    step = 0
    recall = 0.0
    batches = length_bucketed_batches(tok, args.batch, args.curriculum)
    for step in range(1, args.steps + 1):
        ids, mask, labels = next(batches)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:6.0f}s", flush=True)
        if step % args.eval_every == 0:
            recall = teacher_forced_recall(model, tok, val, pad_id)
            history.append({"step": step, "loss": round(loss.item(), 5), "val_recall": recall})
            print(f"step {step:5d}  validation recall {recall:.3f}", flush=True)
            if recall >= args.target:
                break

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = [im_end, pad_id]
    model.generation_config.pad_token_id = pad_id
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tok.save_pretrained(out)
    recipe = {
        "seed": args.seed,
        "threads": args.threads,
        "steps": step,
        "batch": args.batch,
        "lr": args.lr,
        "curriculum": args.curriculum,
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": len(tok),
        "params": n_params,
        "train_seconds": round(time.time() - t0, 1),
        "val_recall_teacher_forced": recall,
        "history": history,
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")
    write_model_card(out, recipe)
    print(json.dumps({k: v for k, v in recipe.items() if k != "history"}))


if __name__ == "__main__":
    main()
