"""kvlab.vllm.bridge: the error path and the JSON parsing always run; the real vLLM comparison runs
when the vLLM venv exists (``make vllm-env``) and is skipped with the reason otherwise."""

import json
import random
import sys
from pathlib import Path

import pytest

from kvlab.built.nb06 import (
    add_vllm_pools,
    bench_block_pools,
    block_pool_job,
    compare_runs,
    divergence_rows,
    first_difference,
    generate_job,
    hit_rate,
    run_many,
    ttft_rows,
    workload_job,
)
from kvlab.cache import AllBlocksCleared, BlockManager, BlockStored
from kvlab.lessons.nb06_vllm import check_cached_tokens, check_ttft_ideal
from kvlab.vllm import bridge as vb

# --- always: no vLLM needed ----------------------------------------------------------------------


def test_missing_env_gives_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_VLLM_VENV", str(tmp_path / "nowhere"))
    monkeypatch.delenv("KVLAB_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("KVLAB_SKIP_VLLM", raising=False)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(vb.VllmNotFoundError) as e:
        vb.run_vllm(tmp_path, [[1, 2, 3]])
    assert "make vllm-env" in str(e.value) and "nowhere" in str(e.value)
    status = vb.vllm_status()
    assert not status.available and "make vllm-env" in status.message


def test_interpreter_without_vllm_is_reported_as_missing(tmp_path):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.symlink_to(sys.executable)  # kvlab's interpreter: no vllm module there
    with pytest.raises(vb.VllmNotFoundError, match="no `vllm` module.*make vllm-env"):
        vb.run_worker({"kind": "info"}, python=fake, timeout=120)
    assert not vb.vllm_status(fake).available


def test_worker_errors_come_back_as_messages(tmp_path):
    # the worker itself runs in any interpreter; an unknown job kind is reported, not a traceback
    with pytest.raises(vb.VllmWorkerError, match="unknown job kind"):
        vb.run_worker({"kind": "nonsense"}, python=sys.executable, timeout=120)


@pytest.mark.parametrize(
    "text, match",
    [
        ("not json", "no valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            json.dumps(
                {
                    "error": "ValueError: block_size must be a multiple of 32",
                    "traceback": "Traceback ...\nValueError: x",
                }
            ),
            "vLLM failed: ValueError: block_size must be a multiple of 32",
        ),
    ],
)
def test_parse_result_errors(text, match):
    with pytest.raises(vb.VllmWorkerError, match=match):
        vb.parse_result(text, log="INFO engine started\nsomething broke")


def test_parse_result_ok():
    payload = {
        "output_ids": [[5, 6]],
        "num_cached_tokens": [32],
        "prefix_cache": {"queries": 70, "hits": 32},
        "timings": {"startup_s": 1.0, "cold_s": 0.1},
    }
    res = vb.parse_result(json.dumps(payload))
    assert res == payload and hit_rate(res) == pytest.approx(32 / 70)


def test_bad_arguments_fail_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="arrival"):
        vb.run_vllm(tmp_path, [[1]], arrival="later")
    with pytest.raises(ValueError, match="multiple of 16"):
        vb.run_vllm(tmp_path, [[1]], block_size=12)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        vb.run_vllm(tmp_path, [[1]], python=sys.executable)


def test_compare_rows_and_first_difference():
    k = {"output_ids": [[1, 2, 3], [4]], "num_cached_tokens": [0, 32]}
    v = {"output_ids": [[1, 2, 3], [5]], "num_cached_tokens": [0, 32]}
    rows = compare_runs([[0] * 40, [0] * 40], k, v, hf=[[1, 2, 3], [4]])
    assert [r["kvlab_eq_vllm"] for r in rows] == [True, False]
    assert (
        all(r["cached_equal"] for r in rows)
        and rows[1]["kvlab_eq_hf"]
        and not rows[1]["vllm_eq_hf"]
    )
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 2], [1, 2]) is None


def test_kvlab_side_of_the_block_pool_bench_runs_alone():
    from kvlab.lessons.traces import shared_prefix_trace

    trace = shared_prefix_trace(
        12, prefix_lens=(64, 96), suffix_len=(4, 20), output_len=(2, 8), seed=1
    )
    res = bench_block_pools(trace, {"small": 64}, block_size=32, reps=1, vllm=False)["small"]
    assert (
        res["vllm"] is None
        and res["kvlab"]["blocks_per_s"] > 0
        and 0 < res["kvlab"]["hit_rate"] < 1
    )
    # kvlab with every freed block at the back (free_order="lru"): still a valid replay of the same
    # trace
    again = bench_block_pools(
        trace, {"small": 64}, block_size=32, reps=1, vllm=False, free_order="lru"
    )["small"]
    assert (
        again["kvlab"]["query_tokens"] == res["kvlab"]["query_tokens"]
        and again["free_order"] == "lru"
    )


def test_tables_and_checkers():
    res = {"ttft": {"uncached_s": 0.2, "cached_s": 0.05, "num_cached_tokens": [128, 128]}}
    (row,) = ttft_rows({"kvlab": res, "vLLM": None}, prompt_tokens=160)
    assert row["ratio cached/uncached"] == pytest.approx(0.25) and row[
        "ideal ratio"
    ] == pytest.approx(32 / 160)
    rows = divergence_rows(
        [[1, 2, 3], [4, 5]], {"a": [[1, 2, 3], [4, 6]], "b": None}, margins=[[5, 5, 5], [3, 0.01]]
    )
    assert [r["first difference at"] for r in rows] == [None, 1] and rows[1][
        "fp32 margin there"
    ] == 0.01
    assert check_cached_tokens(192, prompt_tokens=250, shared_tokens=200, block_size=32)
    assert not check_cached_tokens(200, prompt_tokens=250, shared_tokens=200, block_size=32)
    # last token recomputed
    assert check_cached_tokens(224, prompt_tokens=250, shared_tokens=250, block_size=32)
    assert check_ttft_ideal(0.2, 160, 128) and not check_ttft_ideal(None, 160, 128)


def test_feature_table_names_both_sides():
    import json

    nb = json.loads(
        (
            Path(__file__).resolve().parents[2] / "notebooks" / "06_vllm_side_by_side.ipynb"
        ).read_text()
    )
    md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    lines = md.splitlines()
    start = lines.index("| feature | vLLM | kvlab |")
    rows = [
        [c.strip() for c in ln.split("|")[1:-1]] for ln in lines[start + 2 :] if ln.startswith("|")
    ]
    assert len(rows) >= 10 and all(len(r) == 3 for r in rows)
    assert any(r[1] == "no" for r in rows) and any(r[2] == "no" for r in rows)


# --- with real vLLM (skipped without the venv) ----------------------------------------------------

STATUS = vb.vllm_status()
needs_vllm = pytest.mark.skipif(
    not STATUS.available,
    reason="vLLM is optional (~3.5 GB, `make vllm-env` creates it): "
    + STATUS.message.splitlines()[0],
)


def _shared_prefix_prompts(bundled) -> tuple[list[list[int]], list[int]]:
    """Three questions on one passphrase example and one other example (token ids); the stop ids."""
    from kvlab.engine.models import eos_ids
    from kvlab.lessons import passphrase as P

    model, tok = bundled
    base = P.make_example(7, "heldout", n_filler=12, lang="en", history="none")
    prompts = [tok(P.with_question(base, q).prompt_text, add_special_tokens=False)["input_ids"]
               for q in P.ASK_EN[:3]]
    prompts.append(
        tok(P.make_example(8, "heldout", n_filler=6).prompt_text, add_special_tokens=False)[
            "input_ids"
        ]
    )
    return prompts, sorted(eos_ids(model, tok))


def _ample_trace():
    """A shared-prefix trace whose first request ends one token past a block boundary."""
    import dataclasses

    from kvlab.lessons.traces import shared_prefix_trace

    trace = shared_prefix_trace(
        16, prefix_lens=(64, 160), suffix_len=(4, 40), output_len=(2, 40), seed=2
    )
    # prompt + output one past a block boundary: the last token's K/V is never written
    r0 = trace[0]
    trace[0] = dataclasses.replace(r0, output=(r0.output * 64)[: 65 - len(r0.prompt) % 32])
    return trace


def _tight_trace():
    from kvlab.lessons.traces import realistic_trace

    return realistic_trace(30, seed=1)


@pytest.fixture(scope="module")
def vllm_runs(bundled):
    """Every vLLM job of this file in ONE worker (``run_many``: vLLM's import is paid once, not
    four times), by name; each test below checks its own job's result."""
    if not STATUS.available:
        pytest.skip(STATUS.message.splitlines()[0])
    from kvlab.engine.models import BUNDLED_MODEL

    prompts, stop = _shared_prefix_prompts(bundled)
    # the workload job takes the generate job's engine settings, so it reuses its engine
    gen = generate_job(BUNDLED_MODEL, prompts, 32, 12, stop_token_ids=stop, repeat=False)
    # what bench_block_pools(trace, {name: n}, block_size=32, reps=1) sends to the worker
    ops, nb, bs = _ops(), 14, 16  # a small pool: later prompts evict earlier blocks
    jobs = {
        "generate": gen,
        "workload": workload_job(prompts[:3], 4, like=gen),
        "pool_ample": block_pool_job(_ample_trace(), 200, 32, 16, 1),
        "pool_tight": block_pool_job(_tight_trace(), 120, 32, 16, 1),
        "kv_events": {"kind": "kv_events", "ops": ops, "num_blocks": nb, "block_size": bs},
    }
    return dict(zip(jobs, run_many(list(jobs.values()))))


@needs_vllm
def test_vllm_matches_kvlab_and_hf(bundled, vllm_runs):
    """A small shared-prefix workload: identical greedy tokens, cached-token counts and hit rate."""
    from kvlab.engine.reference import hf_generate

    model, tok = bundled
    prompts, stop = _shared_prefix_prompts(bundled)
    ours = vb.run_kvlab(
        model, tok, prompts, block_size=32, max_tokens=12, stop_token_ids=stop, repeat=False
    )
    # one worker, two jobs (vllm_runs): the workload job reuses the generate job's engine
    theirs, wl = vllm_runs["generate"], vllm_runs["workload"]
    hf = [hf_generate(model, tok, p, max_new_tokens=12) for p in prompts]
    assert theirs["output_ids"] == ours["output_ids"] == hf
    assert theirs["num_cached_tokens"] == ours["num_cached_tokens"]
    # the shared system prompt really was served from the cache
    assert ours["num_cached_tokens"][1] > 0
    assert theirs["prefix_cache"] == ours["prefix_cache"]
    shared, isolated = wl["modes"]["shared"], wl["modes"]["isolated"]
    assert shared["reused_engine"] and isolated["reused_engine"] and wl["isolation"] == "salt"
    # all at once: the later requests hit the first one's blocks
    assert max(shared["num_cached_tokens"]) > 0
    # a cache_salt per request: no request hits another's
    assert isolated["num_cached_tokens"] == [0, 0, 0]
    assert isolated["output_ids"] == shared["output_ids"] == [h[:4] for h in hf[:3]]


@needs_vllm
def test_vllm_block_pool_replays_the_same_trace(vllm_runs):
    trace = _ample_trace()
    assert (len(trace[0].prompt) + len(trace[0].output)) % 32 == 1
    # bench_block_pools(trace, {"ample": 200}, block_size=32, reps=1), its vLLM job run in vllm_runs
    res = bench_block_pools(trace, {"ample": 200}, block_size=32, reps=1, vllm=False)
    res = add_vllm_pools(res, [vllm_runs["pool_ample"]])["ample"]
    assert res["vllm"]["cached_tokens"] == res["kvlab"]["cached_tokens"]
    assert res["vllm"]["blocks_per_s"] > 0
    # blocks/s on the same numerator
    assert res["vllm"]["table_blocks"] == res["kvlab"]["table_blocks"]
    # under eviction the two agree: kvlab's pool reuses never-hittable tail blocks first, as vLLM
    # does (its default)
    res = bench_block_pools(_tight_trace(), {"tight": 120}, block_size=32, reps=1, vllm=False)
    res = add_vllm_pools(res, [vllm_runs["pool_tight"]])["tight"]
    assert (
        res["kvlab"]["evictions"] > 0
        and res["vllm"]["cached_tokens"] == res["kvlab"]["cached_tokens"]
    )


def test_vllm_source_is_read_from_the_venv():
    if not STATUS.available:
        pytest.skip(STATUS.message.splitlines()[0])
    src = vb.vllm_source("vllm.v1.core.block_pool", "BlockPool.free_blocks")
    assert src.lstrip().startswith("def free_blocks")


def test_worker_file_is_standalone():
    """The worker runs where kvlab is not installed: it must not import kvlab."""
    text = Path(vb.WORKER).read_text()
    assert "import kvlab" not in text and "from kvlab" not in text
    assert 'if __name__ == "__main__":' in text


def test_comparison_words_call_close_numbers_a_tie_and_one_run_ranks_nothing():
    import pandas as pd

    from kvlab.built.nb06 import kvlab_vs_vllm_sentences
    from kvlab.lessons.common import ratio_word

    assert ratio_word(1.04, "higher", "lower").startswith("about the same")
    assert ratio_word(0.96, "higher", "lower").startswith("about the same")
    assert (
        ratio_word(1.2, "higher", "lower") == "higher"
        and ratio_word(0.8, "higher", "lower") == "lower"
    )
    cmp = pd.DataFrame(
        [
            {
                "mode": "shared",
                "kvlab tok/s": 20.9,
                "vLLM tok/s": 22.3,
                "throughput kvlab / vLLM": 20.9 / 22.3,
                "kvlab TTFT (ms)": 391.0,
                "vLLM TTFT (ms)": 405.0,
                "TTFT kvlab / vLLM": 391 / 405,
            }
        ]
    )
    (line,) = kvlab_vs_vllm_sentences(cmp)
    # one run of each: the ratios, and no word that ranks them
    assert "(kvlab / vLLM 0.94x)" in line and "(0.97x)" in line
    assert "one run each, no spread: not a ranking" in line
    assert not any(w in line for w in ("higher", "lower", "longer", "shorter", "about the same"))
    (recorded,) = kvlab_vs_vllm_sentences(cmp, "medians of 3 repeats")
    assert recorded.endswith("medians of 3 repeats, no spread: not a ranking")


# --- KV events: the same stream as real vLLM (skipped without its venv) ---------------------------

def _ops(seed: int = 0, block_size: int = 16) -> list[dict]:
    """A workload of prompts sharing prefixes, decodes, frees (tail blocks evicted), and a reset."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(2 * block_size + 5)]
    ops, live, n = [], [], 0
    for turn in range(14):
        if live and (turn % 3 == 2 or len(live) > 2):
            ops.append({"op": "free", "id": live.pop(0)})
        rid = f"r{n}"
        n += 1
        prompt = (system if turn % 4 else system[:block_size]) + [
            rng.randrange(1, 500) for _ in range(rng.randint(3, 40))
        ]
        ops.append({"op": "alloc", "id": rid, "prompt": prompt})
        for _ in range(rng.randint(1, 20)):
            ops.append({"op": "append", "id": rid, "token": rng.randrange(1, 500)})
        live.append(rid)
        if turn == 9:
            for r in live:
                ops.append({"op": "free", "id": r})
            live = []
            ops.append({"op": "reset"})
    ops += [{"op": "free", "id": r} for r in live]
    return ops


def kvlab_events(ops: list[dict], num_blocks: int, block_size: int) -> list[list[dict]]:
    """The ops on kvlab's BlockManager; events after each op in the worker's JSON shape (hashes as
    hex)."""
    bm = BlockManager(num_blocks, block_size, enable_kv_events=True)
    out = []
    for op in ops:
        if op["op"] == "alloc":
            bm.allocate(op["id"], op["prompt"])
        elif op["op"] == "append":
            bm.append(op["id"], op["token"])
        elif op["op"] == "free":
            bm.free(op["id"])
        else:
            assert bm.reset_prefix_cache()
        evs = []
        for e in bm.take_events():
            d = {"kind": type(e).__name__}
            if not isinstance(e, AllBlocksCleared):
                d["block_hashes"] = [h.hex() for h in e.block_hashes]
            if isinstance(e, BlockStored):
                d.update(
                    parent_block_hash=None
                    if e.parent_block_hash is None
                    else e.parent_block_hash.hex(),
                    token_ids=list(e.token_ids),
                    block_size=e.block_size,
                )
            evs.append(d)
        out.append(evs)
    return out


def canonical(stream: list[list[dict]]) -> list[list[tuple]]:
    """Hash values replaced by the order in which each was first stored: comparable across hash
    functions."""
    names: dict[str, int] = {}

    def name(h):
        if h is None:
            return None
        return names.setdefault(h, len(names))

    out = []
    for evs in stream:
        row = []
        for e in evs:
            if e["kind"] == "BlockStored":
                row.append(
                    (
                        "stored",
                        name(e["parent_block_hash"]),
                        tuple(name(h) for h in e["block_hashes"]),
                        tuple(e["token_ids"]),
                        e["block_size"],
                    )
                )
            elif e["kind"] == "BlockRemoved":
                row.append(("removed", tuple(name(h) for h in e["block_hashes"])))
            else:
                row.append(("cleared",))
        out.append(row)
    return out


@needs_vllm
def test_kvlab_and_vllm_event_streams_agree(vllm_runs):
    # the same ops, pool and block size as vllm_runs' kv_events job
    ops, nb, bs = _ops(), 14, 16  # a small pool: later prompts evict earlier blocks
    ours = kvlab_events(ops, nb, bs)
    theirs = vllm_runs["kv_events"]["events"]
    assert len(theirs) == len(ours)
    flat = [e for evs in ours for e in evs]
    kinds = {e["kind"] for e in flat}
    # the workload exercises all three
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= kinds, kinds
    assert canonical(theirs) == canonical(ours)
    assert any(e["kind"] == "BlockStored" and e["parent_block_hash"] for e in flat)
    their_hashes = {h for evs in theirs for e in evs for h in e.get("block_hashes", [])}
    # values differ by design
    assert not their_hashes & {h for e in flat for h in e.get("block_hashes", [])}
