"""``kvlab serve`` under the clients people point at OpenAI-compatible servers (issue 52).

- the ``openai`` SDK (in-process, through Starlette's TestClient): completions, chat, streaming,
  ``n``, logprobs;
- vLLM's serving benchmark client (``vllm.benchmarks.serve``, run by the vLLM venv's python) against
  a ``python -m kvlab.serve`` subprocess on /v1/completions and /v1/chat/completions: 0 failed
  requests;
- lm-evaluation-harness's ``local-completions`` on a small multiple-choice task and a
  ``generate_until`` task written to local files (no dataset download): the same accuracy as
  lm-eval's ``hf`` model (transformers) on the same items, per-item log-likelihoods within 1e-4.

A client that is not installed skips its test with the reason (the vLLM venv: ``make vllm-env``;
lm-eval: the ``lmeval`` extra).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from kvlab.engine import Engine  # noqa: E402
from kvlab.engine.models import BUNDLED_MODEL  # noqa: E402
from kvlab.serve import ServeConfig, create_app, loadgen  # noqa: E402
from kvlab.vllm import bridge as vb  # noqa: E402

MODEL = "kvlab-passphrase-qwen2"
PROMPT = "The passphrase is"


# ------------------------------------------------------------------------ the openai SDK
@pytest.fixture(scope="module")
def sdk(bundled):
    openai = pytest.importorskip("openai")
    model, tok = bundled
    engine = Engine(model, tok, num_blocks=128, block_size=16, max_num_seqs=8)
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as http:
        yield (
            openai.OpenAI(
                base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
            ),
            tok,
        )


def test_openai_sdk_completions_n_logprobs_and_echo(sdk):
    client, tok = sdk
    r = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, "Hello"],
        max_tokens=4,
        temperature=0,
        n=2,
        logprobs=2,
        presence_penalty=None,
        frequency_penalty=None,
        logit_bias={},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[0].logprobs.token_logprobs
    assert all(len(t) >= 2 for t in r.choices[0].logprobs.top_logprobs)
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(PROMPT) and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(tok(PROMPT)["input_ids"]) + 1


def test_openai_sdk_chat_and_streaming(sdk):
    client, _ = sdk
    msgs = [{"role": "user", "content": "What is the passphrase?"}]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=2, logprobs=True, top_logprobs=3
    )
    assert (
        len(full.choices) == 2
        and full.choices[0].message.content == full.choices[1].message.content
    )
    content = full.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 3 for e in content)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    text, usage, n_lp = "", None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            n_lp += len(c.logprobs.content) if c.logprobs else 0
    assert text == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens // 2 == n_lp
    cstream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True, n=2
    )
    texts = {}
    for chunk in cstream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert set(texts) == {0, 1} and texts[0] == texts[1]


# ------------------------------------------------------------------------ a real server for the
# HTTP clients
@pytest.fixture(scope="module")
def http_server():
    """Base URL of a `python -m kvlab.serve` subprocess on the bundled model; stopped after the
    module."""
    port = loadgen.free_port()
    proc = loadgen.start_kvlab(
        port, ["--max-num-seqs", "8"], env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        loadgen.wait_healthy(base, proc, timeout=300)
        yield base
    finally:
        loadgen.stop(proc)


# ------------------------------------------------------------------------ vLLM's benchmark client
STATUS = vb.vllm_status()
needs_vllm = pytest.mark.skipif(
    not STATUS.available,
    reason="vLLM is optional (~3.5 GB, `make vllm-env` creates it): "
    + STATUS.message.splitlines()[0],
)

BENCH = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser()
add_cli_args(p)
args = p.parse_args(sys.argv[1:])
res = main(args)
print("KVLAB_RESULT "
      + json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float, str))}))
"""


def run_vllm_bench(
    base_url: str,
    model: str,
    tokenizer: str,
    endpoint: str,
    num_prompts: int = 16,
    concurrency: int = 4,
    input_len: int = 32,
    output_len: int = 8,
    timeout: float = 600,
) -> dict:
    """``vllm bench serve`` (its Python entry, in the vLLM venv) against ``base_url``: its result
    numbers."""
    backend = "openai-chat" if "chat" in endpoint else "openai"
    cmd = [
        str(vb.vllm_python()),
        "-c",
        BENCH,
        "--backend",
        backend,
        "--base-url",
        base_url,
        "--endpoint",
        endpoint,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--temperature",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KVLAB_RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("KVLAB_RESULT "):]) | {"stdout": out.stdout}


@needs_vllm
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_benchmark_client_gets_no_failure(http_server, endpoint):
    res = run_vllm_bench(http_server, MODEL, str(BUNDLED_MODEL), endpoint)
    print(
        f"vllm bench serve on kvlab serve {endpoint}: {res['completed']} completed, "
        f"{res['failed']} failed"
    )
    assert res["failed"] == 0 and res["completed"] == 16


# ------------------------------------------------------------------------ lm-evaluation-harness
ITEMS = [
    ("The passphrase is", [" written on the card", " a red bicycle", " seven"], 0),
    ("The office opens at", [" nine", " the moon", " purple"], 0),
    ("Remember this carefully. The vault", [" is locked", " sings loudly", " ate breakfast"], 0),
    ("Hello, how are", [" you", " tables", " quickly"], 0),
    ("One, two, three,", [" four", " banana", " yesterday"], 0),
    ("The card is in the", [" drawer", " ocean", " seven"], 0),
]


def _write_tasks(folder: Path) -> None:
    rows = [{"ctx": c, "choices": ch, "gold": g} for c, ch, g in ITEMS]
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'doc_to_text: "{{ctx}}"\n'
    )
    (folder / "kvlab_mc.yaml").write_text(
        "task: kvlab_mc\noutput_type: multiple_choice\n" + common + 'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: gold\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "kvlab_gen.yaml").write_text(
        "task: kvlab_gen\noutput_type: generate_until\n"
        + common
        + 'doc_to_target: "{{choices[gold]}}"\n'
        'target_delimiter: ""\ngeneration_kwargs:\n  until: ["\\n"]\n'
        "  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def _lm_eval(model: str, model_args: str, folder: Path) -> dict:
    lm_eval = pytest.importorskip(
        "lm_eval", reason="lm-evaluation-harness is optional: pip install -e '.[lmeval]'"
    )
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kvlab_mc", "kvlab_gen"],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
        batch_size=1,
    )


def _lls(result: dict) -> list[list[float]]:
    samples = sorted(result["samples"]["kvlab_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def test_lm_eval_local_completions_matches_hf(http_server, tmp_path):
    pytest.importorskip(
        "lm_eval", reason="lm-evaluation-harness is optional: pip install -e '.[lmeval]'"
    )
    _write_tasks(tmp_path)
    served = _lm_eval("local-completions", f"base_url={http_server}/v1/completions,model={MODEL},"
                      f"tokenizer={BUNDLED_MODEL},tokenizer_backend=huggingface,max_retries=1,num_concurrent=1",
                      tmp_path)
    hf = _lm_eval("hf", f"pretrained={BUNDLED_MODEL},dtype=float32,device=cpu", tmp_path)
    ll_served, ll_hf = _lls(served), _lls(hf)
    diff = max(abs(a - b) for x, y in zip(ll_served, ll_hf) for a, b in zip(x, y))
    acc = {
        name: r["results"]["kvlab_mc"]["acc,none"]
        for name, r in (("kvlab serve", served), ("hf", hf))
    }
    em = {
        name: r["results"]["kvlab_gen"]["exact_match,none"]
        for name, r in (("kvlab serve", served), ("hf", hf))
    }
    gens = {
        name: [
            s["resps"][0][0] for s in sorted(r["samples"]["kvlab_gen"], key=lambda s: s["doc_id"])
        ]
        for name, r in (("kvlab serve", served), ("hf", hf))
    }
    print(f"lm-eval on {len(ITEMS)} items: acc {acc}, exact_match {em}, "
          f"per-item log-likelihood max abs difference {diff:.3g}")
    assert len(ll_served) == len(ITEMS) and diff < 1e-4
    assert acc["kvlab serve"] == acc["hf"] and em["kvlab serve"] == em["hf"]
    assert gens["kvlab serve"] == gens["hf"]
