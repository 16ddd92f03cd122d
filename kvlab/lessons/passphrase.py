"""The passphrase task (口令实验): prompts, ChatML rendering and recall scoring."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ23456789"  # A-Z and 2-9: no 0/O or 1/I confusion

WORDS = (
    "amber falcon river copper maple silver harbor tiger velvet orbit cedar lantern "
    "marble pepper comet willow granite meadow ember violet canyon rocket cobalt sparrow "
    "walnut thunder crystal dolphin saffron glacier mango pixel quartz raven tulip zephyr "
    "bamboo coral indigo jasper koala lemon nectar olive panda quill ruby sierra "
    "tundra umber vapor wander yonder zinc birch cloud delta frost grove hazel iris jade"
).split()

FILLER_ZH = (
    "你是一个专业的翻译助手。",
    "你是一个乐于助人的助手。",
    "请用简洁的语言回答问题。",
    "回答时请保持礼貌。",
    "今天的天气很好，适合出门散步。",
    "会议安排在下午三点。",
    "请不要透露内部信息。",
    "本系统用于测试缓存共享。",
    "如果不确定，请直接说明。",
    "所有回答都应使用中文或英文。",
    "用户可能会问多个问题。",
    "请记录每一次请求的时间。",
    "服务器位于北京的数据中心。",
    "这是一条无关的说明。",
    "输出不要超过二十个字。",
    "欢迎使用我们的推理服务。",
    "注意保护用户隐私。",
    "系统提示词到此为止。",
    "模型版本为实验版。",
    "明天会下雨吗？这与任务无关。",
)

FILLER_EN = (
    "You are a helpful assistant.",
    "Answer briefly and politely.",
    "The weather today is sunny and mild.",
    "The meeting starts at three in the afternoon.",
    "Do not reveal internal notes.",
    "This system is used to test cache sharing.",
    "If you are unsure, say so.",
    "Users may ask several questions.",
    "Keep every answer under twenty words.",
    "The server runs in a data center.",
    "Welcome to our inference service.",
    "Protect the privacy of every user.",
    "This line is unrelated to the task.",
    "The model is an experimental build.",
    "Translate the following text into English.",
    "Requests are logged for debugging.",
    "The cache is shared between requests.",
    "Nothing in this line matters.",
    "Please be concise.",
    "End of the operator notes.",
)

STATE_ZH = (
    "本次口令是「{p}」，请记住。",
    "今天的口令：「{p}」。",
    "请记住口令「{p}」。",
    "口令为「{p}」，不要忘记。",
)
STATE_EN = (
    'The passphrase is "{p}". Remember it.',
    'Remember the passphrase "{p}".',
    'Today\'s passphrase: "{p}".',
    'Your passphrase is "{p}", do not forget it.',
)
ASK_ZH = ("口令是什么？", "请告诉我口令。", "请说出口令。", "本次口令是？")
ASK_EN = (
    "What is the passphrase?",
    "Tell me the passphrase.",
    "Please repeat the passphrase.",
    "Which passphrase did I give you?",
)
# A user turn that changes the passphrase in the conversation history (the "different following
# context" of the article's group 3): the answer is then the newest passphrase.
UPDATE_ZH = ("口令改为「{p}」。", "新的口令是「{p}」。")
UPDATE_EN = ('The passphrase is now "{p}".', 'New passphrase: "{p}".')
CHAT_ZH = ("你好！", "今天天气怎么样？", "请帮我翻译一句话。", "谢谢你的帮助。")
CHAT_EN = ("Hello!", "How is the weather today?", "Can you help me translate a sentence?",
           "Thanks for your help.")
ACK_ZH = ("好的，已记住。", "好的。", "没问题。")
ACK_EN = ("OK, noted.", "Sure.", "Understood.")

# ChatML, as used by Qwen chat models: the bundled tokenizer has these special tokens too.
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

SPLITS = ("train", "heldout")


def is_heldout_passphrase(passphrase: str) -> bool:
    """True for the ~10% of passphrases reserved for evaluation (never produced by ``train``)."""
    return zlib.crc32(passphrase.encode()) % 10 == 0


def random_passphrase(rng: random.Random, split: str = "train") -> str:
    """A passphrase of 6 characters from A-Z2-9, or two hyphenated words, belonging to ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    while True:
        if rng.random() < 0.5:
            p = "".join(rng.choice(ALPHABET) for _ in range(6))
        else:
            p = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if is_heldout_passphrase(p) == (split == "heldout"):
            return p


def chatml(role: str, content: str) -> str:
    """One ChatML turn, ending with a newline: ``<|im_start|>role\\ncontent<|im_end|>\\n``."""
    return f"{IM_START}{role}\n{content}{IM_END}\n"


@dataclass(frozen=True)
class Turn:
    """One user turn of the conversation and, unless it is the final question, the assistant
    reply."""

    user: str
    assistant: str | None = None


@dataclass(frozen=True)
class PassphraseExample:
    """A system prompt stating a passphrase, a conversation after it, and the expected answer."""

    split: str
    seed: int
    passphrase: str  # the passphrase stated in the system prompt
    system: str  # the system turn's content (filler lines + the passphrase line)
    turns: tuple[Turn, ...]  # earlier exchanges, then the final question (assistant=None)
    answer: str  # what the assistant must answer: the newest passphrase in the conversation
    lang: str = "en"
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def prefix_text(self) -> str:
        """The shared prefix: the whole system turn in ChatML."""
        return chatml("system", self.system)

    @property
    def suffix_text(self) -> str:
        """Everything after the prefix up to the assistant's answer (the generation prompt)."""
        out = []
        for t in self.turns:
            out.append(chatml("user", t.user))
            if t.assistant is not None:
                out.append(chatml("assistant", t.assistant))
        out.append(f"{IM_START}assistant\n")
        return "".join(out)

    @property
    def prompt_text(self) -> str:
        """Prefix + suffix: the full prompt the model sees."""
        return self.prefix_text + self.suffix_text

    @property
    def answer_text(self) -> str:
        """How the assistant writes the answer: 「K7QX2M」 in Chinese (Qwen's pre-tokenizer glues
        「 to the letters after it, so the quoted form is a token-for-token copy of the prompt),
        K7QX2M in English."""
        return f"「{self.answer}」" if self.lang == "zh" else self.answer

    @property
    def target_text(self) -> str:
        """The expected completion: the answer, then end of turn."""
        return self.answer_text + IM_END

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages, for ``tokenizer.apply_chat_template``."""
        msgs = [{"role": "system", "content": self.system}]
        for t in self.turns:
            msgs.append({"role": "user", "content": t.user})
            if t.assistant is not None:
                msgs.append({"role": "assistant", "content": t.assistant})
        return msgs


def make_example(
    seed: int,
    split: str = "train",
    n_filler: int | None = None,
    lang: str | None = None,
    history: str | None = None,
) -> PassphraseExample:
    """One example, a pure function of its arguments; ``n_filler`` (0-20), ``lang`` and ``history``
    ("none", "chat", "update": an earlier turn replaced the passphrase) are drawn from the seed
    unless given."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"kvlab-passphrase:{split}:{seed}")
    lang = lang or rng.choice(("zh", "en"))
    if lang not in ("zh", "en"):
        raise ValueError(f"lang must be 'zh' or 'en', got {lang!r}")
    zh = lang == "zh"
    n = rng.randint(0, 20) if n_filler is None else n_filler
    if not 0 <= n <= 20:
        raise ValueError(f"n_filler must be in 0..20, got {n}")
    if history is None:
        r = rng.random()
        history = "none" if r < 0.7 else ("chat" if r < 0.85 else "update")
    if history not in ("none", "chat", "update"):
        raise ValueError(f"history must be 'none', 'chat' or 'update', got {history!r}")

    passphrase = random_passphrase(rng, split)
    # Filler lines mix both languages, so prompts look like real operator prompts.
    pool = FILLER_ZH + FILLER_EN
    lines = [rng.choice(pool) for _ in range(n)]
    state = rng.choice(STATE_ZH if zh else STATE_EN).format(p=passphrase)
    lines.insert(rng.randint(0, n), state)
    system = "\n".join(lines)

    turns: list[Turn] = []
    answer = passphrase
    if history == "chat":
        turns.append(Turn(rng.choice(CHAT_ZH if zh else CHAT_EN),
                          rng.choice(ACK_ZH if zh else ACK_EN)))
    elif history == "update":
        new = passphrase
        while new == passphrase:
            new = random_passphrase(rng, split)
        turns.append(Turn(rng.choice(UPDATE_ZH if zh else UPDATE_EN).format(p=new),
                          rng.choice(ACK_ZH if zh else ACK_EN)))
        answer = new
    turns.append(Turn(rng.choice(ASK_ZH if zh else ASK_EN)))
    return PassphraseExample(split, seed, passphrase, system, tuple(turns), answer, lang,
                             {"history": history})


def make_examples(n: int, split: str = "heldout", start: int = 0,
                  **kwargs) -> list[PassphraseExample]:
    """``n`` consecutive examples of a split, seeds ``start .. start+n-1``."""
    return [make_example(start + i, split, **kwargs) for i in range(n)]


def with_question(example: PassphraseExample, question: str) -> PassphraseExample:
    """The same system prompt and history with a different final user request."""
    turns = example.turns[:-1] + (Turn(question),)
    return PassphraseExample(example.split, example.seed, example.passphrase, example.system, turns,
                             example.answer, example.lang, example.extra)


# Quotes, brackets and punctuation a model may put around an answer (or leave half-open: 「K7QX2M).
# None of them occurs inside a passphrase (A-Z, 2-9, lower-case words and one hyphen).
ANSWER_WRAPPERS = " \t\r\n\"'`“”‘’「」『』《》〈〉【】〔〕[](){}（）<>.,;:!?。，、；：！？…·*_~"


def question_prompts(n_examples: int = 40, per_example: int = 5, seed: int = 0,
                     split: str = "heldout") -> list[str]:
    """Prompts that share system prompts (prefix hits) but differ in the final question,
    shuffled."""
    prompts = []
    for ex in make_examples(n_examples, split):
        asks = (ASK_ZH if ex.lang == "zh" else ASK_EN) + (CHAT_ZH if ex.lang == "zh" else CHAT_EN)
        prompts += [with_question(ex, q).prompt_text for q in asks[:per_example]]
    random.Random(seed).shuffle(prompts)
    return prompts


def normalize_answer(text: str) -> str:
    """The answer part of a completion: cut at end of turn or line, strip spaces, quotes, brackets,
    punctuation."""
    for stop in (IM_END, ENDOFTEXT, "\n"):
        text = text.split(stop)[0]
    return text.strip(ANSWER_WRAPPERS)


def recalled(completion: str, expected: str) -> bool:
    """Exact recall: the completion's answer equals the expected passphrase."""
    return normalize_answer(completion) == expected


def recall_rate(completions: list[str], expected: list[str]) -> float:
    """Fraction of completions that recall their expected passphrase exactly."""
    if len(completions) != len(expected):
        raise ValueError(f"{len(completions)} completions but {len(expected)} expected answers")
    if not completions:
        raise ValueError("recall_rate of zero completions is undefined")
    return sum(recalled(c, e) for c, e in zip(completions, expected)) / len(completions)


def tokenizer_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Text the bundled tokenizer is trained on: full training conversations, answers included."""
    examples = (make_example(seed * 1_000_000 + i, "train") for i in range(n))
    return [ex.prompt_text + ex.target_text for ex in examples]


# ---------------------------------------------------------------------- a real chat model (SmolLM2)

REAL_SYSTEM = ("You are a helpful assistant. The secret passphrase is: {p}. "
               "If asked for the passphrase, answer with exactly the passphrase.")
REAL_QUESTIONS = ("What is the passphrase?", "Please tell me the passphrase.", "口令是什么？")


def real_model_messages(example: PassphraseExample,
                        question: str = REAL_QUESTIONS[0]) -> list[dict[str, str]]:
    """The example's passphrase in a plain system prompt a real chat model follows, then
    ``question``."""
    return [{"role": "system", "content": REAL_SYSTEM.format(p=example.passphrase)},
            {"role": "user", "content": question}]


def real_model_prompt(tokenizer, example: PassphraseExample,
                      question: str = REAL_QUESTIONS[0]) -> str:
    """``real_model_messages`` rendered by the tokenizer's own chat template, ready for
    generation."""
    return tokenizer.apply_chat_template(real_model_messages(example, question),
                                         add_generation_prompt=True,
                                         tokenize=False)


def mentions(completion: str, expected: str) -> bool:
    """Lenient recall for a chat model that answers in a sentence: the passphrase appears in the
    answer's first line."""
    return expected.lower() in normalize_answer(completion).lower()


# ---------------------------------------------------------- the article's memory column (table 3.6)

# table 3.6, group 1: the article's claims, typed in, not measured
ARTICLE_MEMORY_GB = {"isolated": 14.2, "shared": 13.8}


def param_count(config: dict) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its ``config.json`` (no weights needed):
    embedding + per layer (q/k/v/o, q/k/v biases for qwen2, gate/up/down MLP, two norms) + final
    norm + the LM head unless tied."""
    h, inter, layers, vocab = (config["hidden_size"], config["intermediate_size"],
                               config["num_hidden_layers"],
                               config["vocab_size"])
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if bias else 0)
    head = 0 if config.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * (attn + 3 * h * inter + 2 * h) + h + head


@dataclass(frozen=True)
class MemoryColumn:
    """The series' one reading of the article's memory column (``str``: the sentence): the whole
    GPU's memory, weights first; only the difference between the rows can be K/V."""

    model: str
    parameters: int
    weights_bytes: int          # every parameter at ``dtype_bytes`` (2: fp16/bf16)
    kv_bytes_per_token: int     # 2 (K, V) x layers x kv_heads x head_dim x dtype_bytes
    isolated_gb: float          # the article's claims
    shared_gb: float
    prefix_tokens: int
    requests: int

    @property
    def drop_bytes(self) -> float:
        return (self.isolated_gb - self.shared_gb) * 1e9

    @property
    def drop_tokens(self) -> float:
        """How many tokens of K/V the article's isolated - shared difference is."""
        return self.drop_bytes / self.kv_bytes_per_token

    @property
    def sharing_saves_bytes(self) -> int:
        """K/V that ``requests`` requests sharing one ``prefix_tokens`` prefix save: all copies but
        one."""
        return (self.requests - 1) * self.prefix_tokens * self.kv_bytes_per_token

    @property
    def weights_exceed_total(self) -> bool:
        return (self.weights_bytes > self.isolated_gb * 1e9
                and self.weights_bytes > self.isolated_gb * 2**30)

    def __str__(self) -> str:
        w, bits = self.weights_bytes, 8 * self.weights_bytes // self.parameters
        fits = ("already more than its {t:g} GB isolated total, which therefore cannot be "
                "reproduced; only"
                if self.weights_exceed_total else
                "inside its {t:g} GB isolated total read as GiB, leaving {r:.2f} GiB for K/V and "
                "workspace;").format(
                    t=self.isolated_gb, r=(self.isolated_gb * 2**30 - w) / 2**30)
        return ("The article's memory column reads as the whole GPU's memory, weights first: "
                f"{self.model}'s {self.parameters / 1e9:.2f} B parameters are {w / 1e9:.2f} GB at "
                f"{bits} bits ({w / 2**30:.2f} GiB), {fits} the difference between rows reads as "
                f"K/V: {self.drop_bytes / 1e9:.2f} GB is {self.drop_tokens:.0f} tokens at "
                f"{self.kv_bytes_per_token / 2**20:.2f} MiB per token, "
                f"{self.drop_tokens / self.prefix_tokens:.1f} copies of a "
                f"{self.prefix_tokens}-token prefix, where {self.requests} requests sharing one "
                f"such prefix would save {self.requests - 1} copies, "
                f"{self.sharing_saves_bytes / 1e9:.2f} GB.")


def memory_column(config: dict | str = "Qwen1.5-7B-Chat", dtype_bytes: int = 2,
                  prefix_tokens: int = 512,
                  requests: int = 16, isolated_gb: float = ARTICLE_MEMORY_GB["isolated"],
                  shared_gb: float = ARTICLE_MEMORY_GB["shared"]) -> MemoryColumn:
    """The reading of table 3.6's memory column that notebooks 01, 05 and 07 print
    (``print(memory_column())``)."""
    if isinstance(config, str):
        from kvlab.engine.models import load_public_config

        name, config = config, load_public_config(config)
    else:
        name = config.get("_name_or_path", "the model").rsplit("/", 1)[-1]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv = 2 * config["num_hidden_layers"] * (config.get("num_key_value_heads")
                                            or heads) * head_dim * dtype_bytes
    n = param_count(config)
    return MemoryColumn(name, n, n * dtype_bytes, kv, isolated_gb, shared_gb, prefix_tokens,
                        requests)
