"""Render records with the chat template and tokenize them piece by piece; token ids live in
``str``s (``tokstr``)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .logio import Record

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # "name" or "org/name"
LINE_SPLIT = re.compile(r"(?<=\n)(?=\S)")  # after a run of newlines, before a non-space character
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def tokstr(ids: Sequence[int]) -> str:
    """Token ids -> the str that holds them (one code point per token)."""
    return "".join(map(chr, ids))


def ids(s: str) -> list[int]:
    """The str of ``tokstr`` -> token ids."""
    return [ord(c) for c in s]


def check_model(model: str | os.PathLike | None) -> None:
    """Raise FileNotFoundError for a ``--model`` that names a path that is not there (cheap: loads
    nothing)."""
    from kvlab.engine.smollm2 import is_alias
    if model is None or is_alias(model):
        return
    name = os.fspath(model)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(
                f"--model {name}: not a folder (give the model's folder, not a file in it)"
            )
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"--model {name}: the folder has no tokenizer files "
                                    "(tokenizer.json / tokenizer_config.json)")
        return
    if not HUB_ID.fullmatch(name) or ".." in name:
        raise FileNotFoundError(f"--model {name}: no such folder")


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """The folder (or hub id) of ``model``: None = the bundled model, "smollm2", a local folder or
    an id."""
    if model is None:
        from kvlab.engine.models import BUNDLED_MODEL
        return str(BUNDLED_MODEL)
    from kvlab.engine.smollm2 import ensure_smollm2, is_alias
    if is_alias(model):
        return str(ensure_smollm2(verbose=False))
    check_model(model)
    path = Path(os.fspath(model)).expanduser()
    return str(path) if path.exists() else os.fspath(model)


def model_config(model: str | os.PathLike | None) -> dict:
    """The config.json of ``model`` (for KV bytes per token)."""
    path = Path(resolve_model_path(model)) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text())


class PromptEncoder:
    """Chat template + tokenizer of one model, with a cache of tokenized pieces."""

    def __init__(self, model: str | os.PathLike | None = None, tokenizer: Any = None) -> None:
        if tokenizer is None:
            from transformers import AutoTokenizer
            path = resolve_model_path(model)
            try:  # a hub id only from the local cache: the doctor downloads nothing
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except OSError as e:
                if Path(path).exists():
                    raise
                raise FileNotFoundError(
                    f"--model {model}: no such folder, and no Hugging Face model of that id "
                    f"in the local cache ({type(e).__name__})"
                ) from e
        self.tok = tokenizer
        self.name = str(model) if model is not None else "bundled (kvlab-passphrase-qwen2)"
        self.notes: list[str] = []
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        self.template = template
        if not template:
            self.notes.append("the tokenizer has no chat template: messages are rendered as ChatML")
        self.renders_tools = bool(template) and "tools" in template
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self.added = {
            text: int(i) for i, t in decoder.items() if (text := getattr(t, "content", str(t)))
        }
        longest_first = sorted(self.added, key=len, reverse=True)
        self._split = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if self.added else None
        )
        self.cache: dict[str, str] = {}  # piece -> its token str
        self._offset_cache: dict[str, tuple[str, list[tuple[int, int]]]] = {}
        # split at added tokens, and after newline runs (checked on a first batch)
        self.segmented = self.lines = True
        self._checked = False
        # rewritten records spliced into their origin's text (prepare)
        self.splice_ok, self.splice_checked = True, 0
        # what add_special_tokens=True puts before a plain prompt (e.g. BOS)
        self.prompt_prefix = tokstr(tokenizer("", add_special_tokens=True)["input_ids"])
        # looked up; sent to the tokenizer
        self.pieces_total = self.pieces_tokenized = self.chars_tokenized = 0

    # --- rendering --------------------------------------------------------------------------------
    def tools_block(self, tools: list[dict]) -> str:
        """How the doctor shows tools to a template that has no tools section: one JSON object a
        line."""
        return "\n\n# Tools\n" + "\n".join(
            json.dumps(t, ensure_ascii=False, sort_keys=False) for t in tools
        )

    def effective_messages(self, rec: Record) -> list[dict]:
        """The messages as the template sees them (tools in the system message if the template has
        no tools)."""
        msgs = rec.messages or []
        if rec.tools and not self.renders_tools:
            msgs = [dict(m) for m in msgs]
            if msgs and msgs[0]["role"] in ("system", "developer"):
                msgs[0]["content"] = msgs[0]["content"] + self.tools_block(rec.tools)
            else:
                msgs.insert(0, {"role": "system", "content": self.tools_block(rec.tools).lstrip()})
        return msgs

    def render(
        self, rec: Record, add_generation_prompt: bool = True, messages: list[dict] | None = None
    ) -> str:
        """A record's prompt text: the chat template applied to its messages, or its plain
        prompt."""
        if rec.kind == "prompt":
            return rec.prompt or ""
        if rec.kind != "messages":
            raise ValueError("token-id records have no text")
        msgs = self.effective_messages(rec) if messages is None else messages
        kwargs: dict[str, Any] = {"tools": rec.tools} if rec.tools and self.renders_tools else {}
        if not self.template:
            kwargs["chat_template"] = CHATML
        return self.tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def try_render(self, rec: Record, **kwargs: Any) -> str | None:
        """``render``, or None for a record the chat template refuses (jinja raises TemplateError
        and friends)."""
        try:
            return self.render(rec, **kwargs)
        except Exception:  # noqa: BLE001 - a template's own raise (jinja's TemplateError, or any error
            # its Python callbacks raise) means "this record does not render": the caller skips it
            return None

    # --- tokenizing -------------------------------------------------------------------------------
    def _batch(self, texts: list[str], offsets: bool = False) -> list:
        """Token strs of texts (no special tokens added); with ``offsets``, (token str, char
        offsets) pairs."""
        if not texts:
            return []
        if (backend := getattr(self.tok, "backend_tokenizer", None)) is not None:
            fast = None if offsets else getattr(backend, "encode_batch_fast", None)
            encs = (fast or backend.encode_batch)(texts, add_special_tokens=False)
            return [(tokstr(e.ids), list(e.offsets)) if offsets else tokstr(e.ids) for e in encs]
        out = self.tok(texts, add_special_tokens=False, return_offsets_mapping=offsets)
        if not offsets:
            return [tokstr(i) for i in out["input_ids"]]
        return [
            (tokstr(i), [tuple(o) for o in off])
            for i, off in zip(out["input_ids"], out["offset_mapping"])
        ]

    def _parts(self, text: str) -> list[str]:
        """A text cut at the added tokens (whole once piece-wise tokenization is off)."""
        return (
            [p for p in self._split.split(text) if p]
            if self.segmented and self._split is not None
            else [text]
        )

    def _lines(self, part: str) -> list[str]:
        """A part cut after runs of newlines (while that tokenizes the same)."""
        return [x for x in LINE_SPLIT.split(part) if x] if self.lines and "\n" in part else [part]

    def encode(self, texts: Sequence[str], plain_prompt: Sequence[bool] | None = None) -> list[str]:
        """Token strs of rendered prompts (no special tokens added; a plain prompt gets the
        tokenizer's BOS/EOS)."""
        texts = list(texts)
        if not self._checked and texts:
            self._check(texts[::max(1, len(texts) // 48)][:48])
        # two levels: the parts between added tokens (a whole message often repeats as is), then a
        # new part's lines
        added, cache = self.added if self.segmented else {}, self.cache
        split = [self._parts(t) for t in texts]
        lines_of = {
            p: self._lines(p) for ps in split for p in ps if p not in added and p not in cache
        }
        todo = sorted({x for ls in lines_of.values() for x in ls if x not in cache})
        self.chars_tokenized += sum(map(len, todo))
        self.pieces_tokenized += len(todo)
        self.pieces_total += sum(map(len, split))
        cache.update(zip(todo, self._batch(todo)))
        for p, ls in lines_of.items():
            cache[p] = "".join(cache[x] for x in ls)
        out = ["".join(chr(added[p]) if p in added else cache[p] for p in ps) for ps in split]
        plain = [False] * len(out) if plain_prompt is None else plain_prompt
        return [self.prompt_prefix + s if pl else s for s, pl in zip(out, plain)]

    def _check(self, sample: list[str]) -> None:
        """Compare piece-wise with whole-prompt tokenization on a sample: stop cutting at lines,
        then at all."""
        self._checked = True
        whole = self._batch(sample)
        if self.encode(sample) == whole:
            return
        self.lines = False
        self.cache.clear()
        self.segmented = self.encode(sample) == whole
        if not self.segmented:
            self.cache.clear()
        self.notes.append(
            "this tokenizer merges across line breaks: "
            "prompts are cut only at special tokens (slower)"
            if self.segmented
            else "piece-wise tokenization differs from whole prompts for this "
            "tokenizer: every prompt is tokenized whole (slower)"
        )

    def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[str, list[tuple[int, int]]]]:
        """Token strs and character offsets of texts (piece-wise like ``encode``, pieces cached)."""
        texts, added, known = list(texts), self.added, self._offset_cache
        if not (self.segmented and self._checked):
            return self._batch(texts, offsets=True)
        split = [
            [x for p in self._parts(t) for x in ([p] if p in added else self._lines(p))]
            for t in texts
        ]
        todo = sorted({p for ps in split for p in ps if p not in added and p not in known})
        # piece -> (its token str, its offsets)
        known.update(zip(todo, self._batch(todo, offsets=True)))
        out = []
        for ps in split:
            offs, pos = [], 0
            for p in ps:
                offs.extend(
                    [(pos, pos + len(p))]
                    if p in added
                    else ((pos + a, pos + b) for a, b in known[p][1])
                )
                pos += len(p)
            out.append(("".join(chr(added[p]) if p in added else known[p][0] for p in ps), offs))
        return out

    def decode(self, s: str) -> str:
        """Text of a token str."""
        return self.tok.decode(ids(s), skip_special_tokens=False)

    def token_id(self, text: str) -> int:
        """The id of a text that is one token (e.g. a newline); the first token otherwise."""
        i = self.tok(text, add_special_tokens=False)["input_ids"]
        return int(i[0])
