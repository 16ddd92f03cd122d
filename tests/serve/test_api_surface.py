"""The request surface of ``kvlab serve`` (issue 52), in-process: every vLLM sampling field
implemented or refused.

Each implemented field is checked against an oracle written here, independently of the engine: a
greedy decode that runs the model's own forward over the whole sequence each step and applies vLLM's
formula for the field (``vllm/v1/sample``: logit_bias and min_tokens, then the penalties, then
argmax). A field is never accepted and ignored: neutral values leave the tokens alone, ``null``
means the default, the rest is a 400 naming the field. ``prompt_logprobs`` of a prompt served half
from the cache equal those of the same prompt from scratch (the largest difference is printed), and
both equal the log-softmax of one plain forward.
"""

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from starlette.testclient import TestClient  # noqa: E402

from kvlab.engine import Engine  # noqa: E402
from kvlab.serve import ServeConfig, create_app  # noqa: E402

MODEL = "kvlab-passphrase-qwen2"
ENGINE_KW = dict(num_blocks=128, block_size=16, max_num_seqs=8)
PROMPT = "The passphrase is"
EOS = 2  # the bundled model's <|im_end|>
LONG = (
    "Remember this carefully. The office opens at nine and the passphrase for the vault "
    "is written on the card in the drawer. The passphrase is"
)


@pytest.fixture(scope="module")
def served(bundled):
    """(client, engine, model, tokenizer): the app over a fresh engine on the bundled model."""
    model, tok = bundled
    engine = Engine(model, tok, **ENGINE_KW)
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as client:
        yield client, engine, model, tok


def _post(client, path: str = "/v1/completions", **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _refused(client, param: str, path: str = "/v1/completions", **body) -> str:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param in err["message"] or err["param"] == param
    return err["message"]


def _ids(served, prompt: str) -> list[int]:
    return served[3](prompt)["input_ids"]


@torch.no_grad()
def _oracle(served, prompt_ids: list[int], max_tokens: int, process=None, stop=()) -> list[int]:
    """Greedy tokens from the model's own forward over the whole sequence, each step's logits
    through ``process``."""
    _, engine, model, _ = served
    engine.runner.detach()  # idle engine: the model's own attention
    ids, out = list(prompt_ids), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if process is not None:
            logits = process(logits.clone(), prompt_ids, out)
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            break
    return out


@torch.no_grad()
def _prompt_logprobs_oracle(served, ids: list[int]) -> list[float]:
    _, engine, model, _ = served
    engine.runner.detach()
    lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def _greedy(served, prompt=LONG, max_tokens=8, **fields) -> dict:
    fields = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
    return _post(served[0], prompt=prompt, max_tokens=max_tokens, **fields)


def _tokens(answer: dict, i: int = 0) -> list[int]:
    return answer["choices"][i]["token_ids"]


# ------------------------------------------------------------------------ neutral values, nulls,
# refusals
NEUTRAL = dict(
    n=1,
    presence_penalty=0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    min_p=0.0,
    min_tokens=0,
    stop_token_ids=[],
    include_stop_str_in_output=False,
    skip_special_tokens=True,
    logit_bias={},
    best_of=1,
    echo=False,
    top_k=-1,
    top_p=1.0,
    seed=3,
    user="u",
    stream=False,
    suffix=None,
)
NULLS = {
    k: None
    for k in (
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "logit_bias",
        "best_of",
        "echo",
        "logprobs",
        "prompt_logprobs",
        "top_k",
        "top_p",
        "seed",
        "user",
        "stream",
        "stream_options",
        "suffix",
        "stop",
        "ignore_eos",
        "cache_salt",
        "max_tokens",
    )
}


def test_neutral_values_and_nulls_leave_greedy_tokens_alone(served):
    base = _tokens(_greedy(served))
    assert _tokens(_greedy(served, **NEUTRAL)) == base
    nulls = {k: v for k, v in NULLS.items() if k not in ("max_tokens", "ignore_eos")}
    assert _tokens(_greedy(served, **nulls)) == base
    assert (
        len(
            _post(
                served[0], prompt=LONG, temperature=0, **{"max_tokens": None, "ignore_eos": None}
            )["choices"][0]["text"]
        )
        > 0
    )
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    a = _post(served[0], "/v1/chat/completions", **chat)
    b = _post(
        served[0],
        "/v1/chat/completions",
        **chat,
        n=None,
        logprobs=None,
        top_logprobs=None,
        presence_penalty=None,
        frequency_penalty=None,
        logit_bias=None,
        max_completion_tokens=None,
    )
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 17),
        ("n", 0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 100),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"999999": 1}),
        ("stop_token_ids", [999999]),
        ("best_of", 2),
        ("suffix", "tail"),
        ("stream_options", {"include_usage": True}),
        ("tools", []),
        ("response_format", {}),
    ],
)
def test_out_of_range_or_unsupported_is_refused_naming_the_field(served, field, value):
    _refused(served[0], field, prompt=PROMPT, max_tokens=4, **{field: value})


def test_chat_caps(served):
    msgs = [{"role": "user", "content": "hi"}]
    _refused(
        served[0],
        "top_logprobs",
        "/v1/chat/completions",
        messages=msgs,
        logprobs=True,
        top_logprobs=21,
    )
    _refused(served[0], "top_logprobs", "/v1/chat/completions", messages=msgs, top_logprobs=2)
    _refused(served[0], "n", "/v1/chat/completions", messages=msgs, n=17)
    _refused(served[0], "echo", "/v1/chat/completions", messages=msgs, echo=True)


def test_echo_with_a_huge_prompt_is_refused(bundled):
    model, tok = bundled
    engine = Engine(model, tok, **ENGINE_KW)
    with TestClient(
        create_app(engine, ServeConfig(model_name=MODEL, max_prompt_logprob_tokens=32))
    ) as client:
        msg = _refused(client, "echo", prompt=LONG * 2, max_tokens=1, echo=True, logprobs=1)
        assert "at most 32" in msg
        _refused(client, "echo", prompt=LONG * 2, max_tokens=1, prompt_logprobs=0)
        assert _post(client, prompt=LONG * 2, max_tokens=1, echo=True)["choices"][0][
            "text"
        ].startswith(LONG * 2)


def test_too_many_choices_are_refused(served):
    _refused(served[0], "n", prompt=[PROMPT] * 8, n=9, max_tokens=1)
    _refused(served[0], "prompt", prompt=[PROMPT] * 65, max_tokens=1)


# ------------------------------------------------------------------------ each sampling field
# against the oracle
def _vllm_penalties(rep=1.0, freq=0.0, pres=0.0):
    def process(logits, prompt, out):
        logits[EOS] -= 100  # the logit_bias below: the bundled model otherwise repeats its eos
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        return logits
    return process


@pytest.mark.parametrize(
    "fields,kw",
    [
        (dict(repetition_penalty=1.8), dict(rep=1.8)),
        (dict(repetition_penalty=0.5), dict(rep=0.5)),
        (dict(frequency_penalty=2.0), dict(freq=2.0)),
        (dict(presence_penalty=2.0), dict(pres=2.0)),
        (
            dict(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=1.3),
            dict(rep=1.3, freq=0.7, pres=-1.0),
        ),
    ],
)
def test_penalties_follow_vllms_formula(served, fields, kw):
    n = 12
    got = _tokens(_greedy(served, max_tokens=n, **fields, logit_bias={str(EOS): -100}))
    assert got == _oracle(served, _ids(served, LONG), n, _vllm_penalties(**kw))
    # the field changed the answer: it was not ignored
    assert got != _tokens(_greedy(served, max_tokens=n, logit_bias={str(EOS): -100}))


def test_logit_bias_is_added_to_the_logits(served):
    base = _tokens(_greedy(served, max_tokens=6))
    banned, favoured = base[0], base[2]
    bias = {str(banned): -100, str(favoured): 5.0}

    def process(logits, prompt, out):
        logits[banned] -= 100
        logits[favoured] += 5.0
        return logits
    got = _tokens(_greedy(served, max_tokens=6, logit_bias=bias))
    assert got == _oracle(served, _ids(served, LONG), 6, process) and got[0] != banned


def test_min_tokens_holds_back_eos_and_stop_ids(served):
    _, engine, _, _ = served
    eos = sorted(engine.eos_ids)
    free = _post(served[0], prompt=PROMPT, max_tokens=10, temperature=0, return_token_ids=True)
    assert free["choices"][0]["token_ids"][-1] in eos  # it stops early on its own
    stop_id = 986

    def process(logits, prompt, out):
        if len(out) < 6:
            logits[eos + [stop_id]] = float("-inf")
        return logits

    got = _post(
        served[0],
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        return_token_ids=True,
        min_tokens=6,
        stop_token_ids=[stop_id],
    )
    ids = got["choices"][0]["token_ids"]
    want = _oracle(served, _ids(served, PROMPT), 10, process, stop=set(eos) | {stop_id})
    assert ids == want and len(ids) >= 6


def test_stop_token_ids_end_the_answer(served):
    base = _tokens(_greedy(served, max_tokens=8))
    stop = base[3]
    got = _greedy(served, max_tokens=8, stop_token_ids=[stop])
    assert (
        _tokens(got) == base[: base.index(stop) + 1]
        and got["choices"][0]["finish_reason"] == "stop"
    )
    # its text is left out of the answer, as vLLM's detokenizer does
    assert got["choices"][0]["text"] == served[3].decode(
        base[: base.index(stop)], skip_special_tokens=True
    )


def test_min_p_keeps_only_likely_tokens(served):
    # min_p = 1 keeps only the top token: seeded sampling at a high temperature becomes greedy
    greedy = _tokens(_greedy(served, max_tokens=8))
    sampled = [_tokens(_greedy(served, max_tokens=8, temperature=5.0, seed=s)) for s in range(3)]
    assert any(s != greedy for s in sampled)  # without min_p the temperature matters
    for s in range(3):
        assert _tokens(_greedy(served, max_tokens=8, temperature=5.0, seed=s, min_p=1.0)) == greedy


def test_include_stop_str_in_output_and_skip_special_tokens(served):
    full = _post(served[0], prompt=LONG, max_tokens=8, temperature=0, ignore_eos=True)["choices"][
        0
    ]["text"]
    stop = full[2:4]
    cut = _post(served[0], prompt=LONG, max_tokens=8, temperature=0, ignore_eos=True, stop=[stop])
    kept = _post(served[0], prompt=LONG, max_tokens=8, temperature=0, ignore_eos=True, stop=[stop],
                 include_stop_str_in_output=True)
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert kept["choices"][0]["text"] == full[: full.index(stop) + len(stop)]
    tok = served[3]
    # the bundled model repeats its eos (a special token) once ignore_eos lets it go on
    ans = _post(
        served[0],
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        return_token_ids=True,
        ignore_eos=True,
        skip_special_tokens=False,
    )["choices"][0]
    assert EOS in ans["token_ids"] and ans["text"] == tok.decode(
        ans["token_ids"], skip_special_tokens=False
    )
    assert ans["text"] != tok.decode(ans["token_ids"], skip_special_tokens=True)
    # the eos or stop token that ends an answer is not in its text (vLLM), unless
    # include_stop_str_in_output
    for include in (False, True):
        ans = _post(served[0], prompt=PROMPT, max_tokens=10, temperature=0, return_token_ids=True,
                    skip_special_tokens=False, include_stop_str_in_output=include)["choices"][0]
        ids = ans["token_ids"] if include else ans["token_ids"][:-1]
        assert ans["finish_reason"] == "stop" and ans["text"] == tok.decode(
            ids, skip_special_tokens=False
        )


# ------------------------------------------------------------------------ n, lists of prompts,
# logprobs, echo
def test_n_and_a_list_of_prompts(served):
    one = _tokens(_greedy(served, prompt=PROMPT, max_tokens=4))
    other = _tokens(_greedy(served, prompt=LONG, max_tokens=4))
    ans = _greedy(served, prompt=[PROMPT, LONG], max_tokens=4, n=2)
    assert [c["index"] for c in ans["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in ans["choices"]] == [one, one, other, other]
    assert ans["usage"]["prompt_tokens"] == len(_ids(served, PROMPT)) + len(_ids(served, LONG))
    assert ans["usage"]["completion_tokens"] == 16
    ids_prompt = _greedy(served, prompt=[_ids(served, PROMPT), _ids(served, LONG)], max_tokens=4)
    assert [c["token_ids"] for c in ids_prompt["choices"]] == [one, other]
    # sampled: each choice its own seed (seed + index, as vLLM's children), so the choices differ
    sampled = _greedy(served, prompt=LONG, max_tokens=8, n=3, temperature=1.5, seed=7)
    assert len({tuple(c["token_ids"]) for c in sampled["choices"]}) > 1
    assert sampled["choices"][1]["token_ids"] == _tokens(
        _greedy(served, prompt=LONG, max_tokens=8, temperature=1.5, seed=8)
    )


def test_completion_logprobs_are_the_raw_log_softmax(served):
    ans = _greedy(served, max_tokens=5, logprobs=3)["choices"][0]
    lp = ans["logprobs"]
    ids = _ids(served, LONG) + ans["token_ids"]
    full = _prompt_logprobs_oracle(served, ids)
    want = full[-5:]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"], want)) < 1e-4
    # the chosen token + the top 3 (OpenAI's k + 1)
    assert all(len(t) in (3, 4) for t in lp["top_logprobs"])
    assert lp["tokens"] == [served[3].decode([t]) for t in ans["token_ids"]]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(5)]
    zero = _greedy(served, max_tokens=2, logprobs=0)["choices"][0]["logprobs"]
    # logprobs: 0 gives the chosen token's, not nothing
    assert [len(t) for t in zero["top_logprobs"]] == [1, 1]


def test_echo_with_logprobs_is_what_lm_eval_reads(served):
    ids = _ids(served, LONG)
    ans = _post(served[0], prompt=LONG, max_tokens=1, temperature=0, logprobs=1, echo=True)[
        "choices"
    ][0]
    lp = ans["logprobs"]
    assert ans["text"].startswith(LONG) and len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _prompt_logprobs_oracle(served, ids)
    diff = max(abs(a - b) for a, b in zip(lp["token_logprobs"][1 : len(ids)], want))
    print(f"echo logprobs vs one plain forward: max abs difference {diff:.3g}")
    assert diff < 1e-4


def test_prompt_logprobs_of_a_cache_hit_equal_those_from_scratch(bundled):
    """The check that catches a prefix-cache bug in numbers: positions after the hit read the cached
    K/V."""
    model, tok = bundled
    engine = Engine(model, tok, **ENGINE_KW)
    ids = tok(LONG * 2)["input_ids"]
    def prompt_logprobs(prompt_ids):
        ans = _post(client, prompt=prompt_ids, max_tokens=1, temperature=0, prompt_logprobs=2)
        recs = ans["choices"][0]["prompt_logprobs"]
        return [None if r is None else r[str(t)]["logprob"] for r, t in zip(recs, prompt_ids)], ans[
            "usage"
        ]

    half = len(ids) // 2
    runs = {}
    for name in ("from scratch", "half cached", "half cached, cache corrupted"):
        engine = Engine(model, tok, **ENGINE_KW)
        with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as client:
            # the first half alone fills the cache; the whole prompt then hits it
            if name != "from scratch":
                prompt_logprobs(ids[:half])
            if name.endswith("corrupted"):  # a prefix-cache bug: the cached K are 1% off
                engine.store.k_pages.mul_(1.01)
            runs[name] = prompt_logprobs(ids)
    cached_tokens = {
        name: usage["prompt_tokens_details"]["cached_tokens"] for name, (_, usage) in runs.items()
    }
    assert cached_tokens["from scratch"] == 0 and cached_tokens["half cached"] >= half - 16 > 0
    scratch = runs["from scratch"][0]
    model_lp = _prompt_logprobs_oracle((None, engine, model, tok), ids)
    diffs = {
        name: max(abs(a - b) for a, b in zip(lps[1:], scratch[1:]))
        for name, (lps, _) in runs.items()
    }
    print(
        f"prompt_logprobs of {len(ids)} tokens, cached tokens {cached_tokens}: "
        "max abs difference from scratch "
        + ", ".join(f"{name} {d:.3g}" for name, d in diffs.items())
        + "; from scratch vs one plain forward "
        + f"{max(abs(a - b) for a, b in zip(scratch[1:], model_lp)):.3g}"
    )
    assert all(lps[0] is None for lps, _ in runs.values())
    assert (
        diffs["half cached"] < 1e-4
        and max(abs(a - b) for a, b in zip(scratch[1:], model_lp)) < 1e-4
    )
    assert diffs["half cached, cache corrupted"] > 1e-3  # the check sees a cache bug


def test_chat_logprobs_and_n(served):
    msgs = [{"role": "user", "content": "What is the passphrase?"}]
    ans = _post(
        served[0],
        "/v1/chat/completions",
        messages=msgs,
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        n=2,
        return_token_ids=True,
    )
    assert [c["index"] for c in ans["choices"]] == [0, 1]
    c = ans["choices"][0]
    content = c["logprobs"]["content"]
    assert [e["token"] for e in content] == [served[3].decode([t]) for t in c["token_ids"]]
    assert all(
        len(e["top_logprobs"]) == 2
        and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        for e in content
    )
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert ans["usage"]["completion_tokens"] == 10


def test_streams_carry_every_choice_and_the_same_answer(served):
    body = dict(
        prompt=[PROMPT, LONG],
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        n=2,
        logprobs=1,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    # usage counts cached prompt tokens, which depend on what ran before: warm the cache first so
    # the stream and the plain request meet the same cache, whichever tests ran before this one
    _post(served[0], **plain)
    with served[0].stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    full = _post(served[0], **plain)
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    texts, lps = {}, {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    assert events[-1]["usage"] == full["usage"]
    for c in full["choices"]:
        assert texts[c["index"]] == c["text"]
        assert len(lps[c["index"]]) == len(c["logprobs"]["token_logprobs"])


# ------------------------------------------------------------------------ /tokenize, /detokenize,
# /version
def test_tokenize_detokenize_version(served):
    client, engine, _, tok = served
    t = _post(client, "/tokenize", prompt=LONG, return_token_strs=True)
    assert t["tokens"] == tok(LONG)["input_ids"] and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == engine.max_model_len and t[
        "token_strs"
    ] == tok.convert_ids_to_tokens(t["tokens"])
    msgs = [{"role": "user", "content": "hi"}]
    chat = _post(client, "/tokenize", messages=msgs)
    assert (
        chat["tokens"]
        == tok(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        and chat["token_strs"] is None
    )
    assert _post(client, "/detokenize", tokens=t["tokens"])["prompt"] == tok.decode(t["tokens"])
    _refused(client, "tokens", "/detokenize", tokens=[10**9])
    _refused(client, "prompt", "/tokenize")
    v = client.get("/version")
    assert v.status_code == 200 and isinstance(v.json()["version"], str)


def test_n_choices_share_the_prompts_blocks(bundled):
    """n choices are n requests of one prompt admitted together: all but the first hit its full
    blocks."""
    model, tok = bundled
    engine = Engine(model, tok, **ENGINE_KW)
    ids = tok(LONG * 2)["input_ids"]
    full = len(ids) // ENGINE_KW["block_size"] * ENGINE_KW["block_size"]
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as client:
        _post(client, prompt=ids, max_tokens=2, temperature=0, n=4)
        stats = engine.stats()
    assert stats["requests"] == 4 and stats["hit_tokens"] == 3 * full > 0
    # the shared blocks once, a tail each
    assert stats["blocks_taken"] == full // ENGINE_KW["block_size"] + 4


def test_echo_with_max_tokens_0_answers_the_prompt_alone(served):
    ans = _post(served[0], prompt=LONG, max_tokens=0, temperature=0, echo=True, logprobs=1)[
        "choices"
    ][0]
    assert ans["text"] == LONG and len(ans["logprobs"]["tokens"]) == len(_ids(served, LONG))
    assert ans["logprobs"]["token_logprobs"][0] is None and ans["finish_reason"] == "length"
    _refused(served[0], "max_tokens", prompt=LONG, max_tokens=0)
