"""Sampling: every accepted ``SamplingParams`` samples a real token, and only real values are
accepted.

``sample_next`` must never build a NaN distribution, whatever the logits' sign and the temperature
(issue 24: every logit negative and a tiny temperature made every score -inf). ``SamplingParams``
takes an allow-list per field: no bool for a number, stop ids as a collection kept as a tuple.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.engine.sampling import SamplingParams, sample_next

VOCAB = 64
TEMPERATURES = [5e-324, 1e-300, 1e-45, 1e-38, 1e-30, 1e-6, 0.7, 1.0, 3.0, 1e30, 1e300]
FILTERS = [
    (1.0, 0),
    (0.9, 0),
    (1e-300, 0),
    (1.0, 1),
    (1.0, 5),
    (0.5, 3),
    (5e-324, 1),
    (1.0, VOCAB + 3),
]


def _logits(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(VOCAB, generator=g)
    return {
        "mixed": base * 10,
        "all_negative": -50
        - base.abs() * 10,  # every logit < 0: a tiny temperature sends all to -inf
        "very_negative": -1e30 - base.abs() * 1e29,
        "huge": 1e30 + base.abs() * 1e29,
        "equal": torch.full((VOCAB,), -3.0),
        "some_masked": torch.where(
            base > 0, base * 5, torch.tensor(float("-inf"))
        ),  # -inf entries, as a mask gives
    }[kind]


@pytest.mark.parametrize(
    "kind", ["mixed", "all_negative", "very_negative", "huge", "equal", "some_masked"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_temperature_and_filter_samples_a_real_token(kind, dtype):
    # float16 turns +-1e30 into +-inf: +inf is the most likely token
    logits = _logits(kind).to(dtype)
    for temperature, (top_p, top_k) in itertools.product(TEMPERATURES, FILTERS):
        gen = torch.Generator().manual_seed(1)
        if logits.max() == float("-inf"):  # nothing can be sampled: a clear error, never a NaN draw
            with pytest.raises(ValueError, match="no token"):
                sample_next(logits, True, temperature, top_p, top_k, gen)
            continue
        token = sample_next(logits, True, temperature, top_p, top_k, gen)
        assert 0 <= token < VOCAB and logits[token] > float("-inf"), (
            kind,
            dtype,
            temperature,
            top_p,
            top_k,
        )
        if temperature <= 1e-30 and int((logits == logits.max()).sum()) == 1:
            assert token == int(logits.argmax())  # the t -> 0 limit: the most likely token


def test_tiny_temperature_with_negative_logits_is_the_greedy_token():
    """The case of issue 24: the stable path ran only on NaN/+inf scores, not when all became
    -inf."""
    logits = torch.tensor([-5.0, -1.0, -3.0, -2.0])
    for temperature in (1e-300, 1e-45):
        assert sample_next(logits, True, temperature, 1.0, 0, torch.Generator().manual_seed(0)) == 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(-3e38, 3e38), min_size=1, max_size=40),  # finite in float32
    st.floats(5e-324, 1e300),
    st.floats(5e-324, 1.0),
    st.integers(0, 50),
    st.integers(0, 2**32),
)
def test_sampling_never_fails_on_finite_logits(values, temperature, top_p, top_k, seed):
    # accepted ...
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    logits = torch.tensor(values)
    token = sample_next(
        logits, True, sp.temperature, sp.top_p, sp.top_k, torch.Generator().manual_seed(seed)
    )
    assert 0 <= token < len(values)  # ... so it samples


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_p", "top_k", "seed"])
@pytest.mark.parametrize("value", [True, False])
def test_no_bool_is_taken_for_a_number(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_ignore_eos_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=bad)


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -0.1, 1.5, 0.0, "0.5", torch.tensor(0.5)]
)
def test_top_p_out_of_range_or_not_a_number(bad):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=bad)


@pytest.mark.parametrize("stops", [[7, 3], (7, 3), range(7, 2, -4), {7}, frozenset({3})])
def test_stop_token_ids_collections_become_a_tuple(stops):
    sp = SamplingParams(stop_token_ids=stops)
    assert type(sp.stop_token_ids) is tuple and sorted(sp.stop_token_ids) == sorted(stops)
    hash(sp)  # frozen and hashable: a list inside would make it unhashable


@pytest.mark.parametrize(
    "make",
    [
        lambda: iter([7]),
        lambda: (t for t in [7]),
        lambda: map(int, "7"),
        lambda: 7,
        lambda: "7",
        lambda: b"\x07",
        lambda: {7: 1},
        lambda: torch.tensor([7]),
    ],
)
def test_stop_token_ids_that_validation_would_consume_or_coerce_are_refused(make):
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=make())


def test_stop_token_ids_must_be_non_negative_ints():
    for bad in ([1.0], [True], [-1], ["5"]):
        with pytest.raises(ValueError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)


# --- vLLM's fields (issue 52): penalties, min_p, min_tokens, logit_bias, logprobs -----------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.1),
        ("frequency_penalty", -2.1),
        ("presence_penalty", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("min_tokens", 17),
        ("min_tokens", 1.0),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("logprobs", True),
    ],
)
def test_vllm_fields_out_of_range_are_refused(field, value):
    with pytest.raises((TypeError, ValueError), match=field.split("_")[0]):
        SamplingParams(**{field: value})


def test_vllm_fields_at_their_neutral_values_process_nothing():
    sp = SamplingParams(
        presence_penalty=0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        min_p=0.0,
        min_tokens=0,
        logit_bias={},
        logprobs=None,
    )
    assert not sp.processes_logits and sp.logit_bias == ()
    assert SamplingParams(logit_bias={7: 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))


def test_process_logits_is_vllms_formula():
    from kvlab.engine.sampling import process_logits

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0, 1.0])
    sp = SamplingParams(
        max_tokens=8,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={5: 10.0},
        min_tokens=3,
        stop_token_ids=[2],
    )
    out = process_logits(sp, logits, prompt_ids=[0, 1], output_ids=[3, 3], eos_ids={4})
    # bias on 5; min_tokens: eos 4 and stop 2 masked; repetition on prompt {0,1} and output {3}; 3
    # counted twice
    want = [2.0 / 2, -1.0 * 2, float("-inf"), 3.0 / 2 - 0.5 * 2 - 0.25, float("-inf"), 11.0]
    assert out.tolist() == want
    # three tokens out: eos free again
    assert process_logits(sp, logits, [0, 1], [3, 3, 3], {4})[4] == -4.0


def test_greedy_without_processing_is_the_argmax_and_logprobs_are_recorded():
    from types import SimpleNamespace

    from kvlab.engine.sampling import sample

    logits = torch.tensor([0.1, 2.0, 1.5, -3.0])
    seq = SimpleNamespace(
        sampling=SamplingParams(logprobs=2),
        prompt_ids=[0],
        output_ids=[],
        generator=None,
        logprobs=None,
    )
    assert sample(seq, logits, 1) == 1
    rec = seq.logprobs[0]
    lp = logits.log_softmax(-1)
    assert rec.token == 1 and rec.rank == 1 and abs(rec.logprob - float(lp[1])) < 1e-6
    assert [t for t, _ in rec.top] == [1, 2]
    seq.sampling = SamplingParams(logit_bias={2: 1.0})
    assert sample(seq, logits, 1) == 2  # processed: the argmax of the biased logits, not ``top``


def test_cached_vs_scratch_prompt_logprobs_catches_a_corrupted_cache(lm):
    from kvlab.engine import Engine
    from kvlab.engine.logprobs import cached_vs_scratch

    model, tok = lm
    ids = tok(
        "The office opens at nine and the passphrase for the vault is written on the card. " * 3
    )["input_ids"]

    def make():
        return Engine(model, tok, num_blocks=64, block_size=16)

    clean = cached_vs_scratch(make, ids, len(ids) // 2)
    bad = cached_vs_scratch(make, ids, len(ids) // 2, corrupt=lambda e: e.store.v_pages.mul_(1.05))
    print(
        f"prompt_logprobs, {clean['num_prompt_tokens']} tokens, "
        f"{clean['num_cached_tokens']} cached: max abs "
        f"difference from scratch {clean['max_abs_diff']:.3g}; "
        f"with the cached V 5% off {bad['max_abs_diff']:.3g}"
    )
    assert (
        clean["num_cached_tokens"] >= 16
        and clean["max_abs_diff"] < 1e-4 < 1e-3 < bad["max_abs_diff"]
    )
