"""kvlab.doctor: planted culprits are named at the right place, fixed logs replay to the numbers
reported, bad input is reported, and the CLI runs end to end."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.cache import BlockManager
from kvlab.doctor import diagnose, read_log, write_log, write_report
from kvlab.doctor.divergence import divergence, lcp
from kvlab.doctor.replay import replay_block_manager, replay_tokens
from kvlab.doctor.tokenization import PromptEncoder, tokstr
from kvlab.doctor.vllm_metrics import parse_metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = (
    "You answer questions about orders, returns and invoices. Be brief and polite; "
    "never invent a policy. "
    "If you do not know, say so and offer a human agent. Quote the order number when you have it. "
    "Refunds above the limit go to a supervisor. Keep the customer's language."
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": f"{n} tool", "parameters": {"type": "object"}},
    }
    for n in ("read_file", "run_tests", "search_code", "apply_patch")
]
USERS = ["Alice", "Bruno", "Chen", "Dara", "Elif", "Farid"]


@pytest.fixture(scope="module")
def enc():
    """The bundled model's tokenizer and chat template, loaded once."""
    return PromptEncoder()


def planted_log(n: int = 90, seed: int = 0) -> list[dict]:
    """Support requests with a timestamp line and a per-user line on top; coding requests with
    shuffled tools."""
    rng = random.Random(seed)
    log = []
    for i in range(n):
        if i % 3 == 2:
            tools = list(TOOLS)
            rng.shuffle(tools)
            log.append(
                {
                    "messages": [
                        {"role": "system", "content": "You are a coding assistant. " + RULES},
                        {"role": "user", "content": f"Fix bug number {i} please."},
                    ],
                    "tools": tools,
                    "user": f"dev{i % 4}",
                }
            )
            continue
        user = USERS[i % len(USERS)]
        ts = f"2024-05-{1 + i % 28:02d} {i % 24:02d}:{(7 * i) % 60:02d}:{(13 * i) % 60:02d}"
        system = (
            f"You are the support assistant of Acme.\nCurrent time: {ts}\nCustomer: {user}\n{RULES}"
        )
        log.append(
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Where is my order {1000 + i}?"},
                ],
                "user": user,
            }
        )
    return log


def token_position(enc: PromptEncoder, text: str, char: int) -> int:
    """Index of the token that holds character ``char`` of ``text``."""
    out = enc.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return next(t for t, (_, end) in enumerate(out["offset_mapping"]) if end > char)


def direct_hits(
    enc: PromptEncoder, path: Path, block_size: int, capacity: int | None
) -> tuple[int, int]:
    """Replay a JSONL log through kvlab.cache.BlockManager with HF's own apply_chat_template +
    tokenizer."""
    tok = enc.tok
    prompts = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "token_ids" in rec:
            prompts.append(rec["token_ids"])
            continue
        msgs = [dict(m) for m in rec["messages"]]
        # the bundled template has no tools section: the doctor appends them to the system message
        if rec.get("tools"):
            msgs[0]["content"] += "\n\n# Tools\n" + "\n".join(
                json.dumps(t, ensure_ascii=False) for t in rec["tools"]
            )
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    nb = capacity or sum(-(-len(p) // block_size) for p in prompts)
    bm = BlockManager(nb, block_size)  # vLLM's free order, as the doctor's replay
    hits = 0
    for i, p in enumerate(prompts):
        hits += bm.allocate(i, p)
        bm.free(i)
    return hits, sum(map(len, prompts))


def test_planted_culprits_named_at_their_position(enc, tmp_path):
    log = planted_log()
    d = diagnose(log, encoder=enc, block_sizes=(16, 32), capacity_blocks=60, alone=True)
    assert d.requests == len(log) and not d.bad
    kinds = {c.kind: c for c in d.kept}
    # the timestamp: a per-request field labelled as a timestamp, at the token where its value
    # starts
    ts = next(c for c in d.kept if c.kind == "volatile")
    assert "timestamp" in ts.title and "Current time" in ts.title
    text = enc.render(read_log(log[:1])[0][0])
    assert ts.position == token_position(enc, text, text.index("2024-"))
    # the user's name: one value per user
    pu = kinds["per-user"]
    assert "Customer" in pu.title and pu.position == token_position(enc, text, text.index("Alice"))
    # the tools: same set, varying order
    assert "tools-order" in kinds
    # every fix kept made the unbounded cache hit more (a 60-block cache may lose a little on one
    # step: LRU), and the fixes one after the other end far above the log as logged
    for c in d.kept:
        assert c.chained["unbounded"]["hit_tokens"] > c.before["unbounded"]["hit_tokens"]
    assert d.chain[-1]["unbounded_hit_rate"] > d.chain[0]["unbounded_hit_rate"] + 0.3
    assert d.chain[-1]["capacity_hit_rate"] > d.chain[0]["capacity_hit_rate"] + 0.3
    # the fixed logs replay, through BlockManager with HF's own template and tokenizer, to the
    # numbers reported
    write_report(d, tmp_path)
    for c in d.kept:
        for cap in (None, 60):
            hits, queries = direct_hits(enc, Path(c.fixed_log), 16, cap)
            got = c.chained["capacity" if cap else "unbounded"]
            assert (hits, queries) == (got["hit_tokens"], got["query_tokens"]), c.title
    # and each fix alone, applied to the log as logged, replays to its "alone" numbers
    for c in d.kept:
        path = tmp_path / "alone.jsonl"
        if c.fix is not None:
            write_log(c.fix(d.prep.records), path)
            hits, queries = direct_hits(enc, path, 16, 60)
            assert (hits, queries) == (
                c.alone["capacity"]["hit_tokens"],
                c.alone["capacity"]["query_tokens"],
            ), c.title
    hits, _ = direct_hits(enc, tmp_path / "fixed" / "all_fixes.jsonl", 16, 60)
    assert hits == round(d.chain[-1]["capacity_hit_rate"] * d.chain[-1]["capacity_query_tokens"])
    # the as-logged numbers too
    hits, queries = direct_hits_log(enc, log, tmp_path)
    assert (hits, queries) == (d.row(16)["unbounded_hit_tokens"], d.row(16)["query_tokens"])


def direct_hits_log(enc, log, tmp_path):
    path = tmp_path / "as_logged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
    return direct_hits(enc, path, 16, None)


def test_malformed_lines_reported_and_counted(enc, tmp_path):
    good = planted_log(12)
    lines = [json.dumps(r) for r in good[:4]]
    lines += [
        '{"messages": [',
        "[1, 2, 3]",
        '{"user": "x"}',
        '{"messages": [{"role": "user"}]}',
        '{"messages": [{"role": "wizard", "content": "hi"}]}',
        '{"prompt": 7}',
        '{"token_ids": [1, -2]}',
        '{"prompt": "a", "token_ids": [1]}',
        "",
    ]
    lines += [json.dumps(r) for r in good[4:]]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    d = diagnose(path, encoder=enc, block_sizes=(16,))
    assert d.requests == len(good)
    # the blank line 13 is not a request
    assert [b.line for b in d.bad] == [5, 6, 7, 8, 9, 10, 11, 12]
    errors = " | ".join(b.error for b in d.bad)
    for words in (
        "invalid JSON",
        "expected a JSON object",
        "no 'messages', 'prompt' or 'token_ids'",
        "messages[0] has no 'content'",
        "'wizard' is not one of",
        "'prompt' is int",
        "'token_ids'[1] = -2",
        "more than one prompt field",
    ):
        assert words in errors, words
    text = d.summary()
    assert f"{len(good)} requests replayed, 8 malformed" in text and "line 5: invalid JSON" in text


def test_empty_log(enc, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    d = diagnose(path, encoder=enc)
    assert d.requests == 0 and d.lines == 0 and not d.culprits
    assert "nothing to replay" in d.summary()
    paths = write_report(d, tmp_path / "out")
    assert (
        paths["report.html"].exists()
        and json.loads(paths["summary.json"].read_text())["requests"] == 0
    )


def test_nothing_shared(enc):
    rng = random.Random(3)
    log = [
        {"token_ids": [1000 + i] + [rng.randrange(900) for _ in range(rng.randrange(20, 80))]}
        for i in range(50)
    ]
    d = diagnose(log, block_sizes=(16, 32), capacity_blocks=40)
    assert d.ceiling["hit_rate"] == 0.0
    assert all(r["unbounded_hit_rate"] == 0.0 and r["capacity_hit_rate"] == 0.0 for r in d.table)
    assert not d.kept
    assert d.spot_checks and all(c["equal"] for c in d.spot_checks)


def test_token_id_log_with_a_planted_span():
    rng = random.Random(5)
    head, rest = [rng.randrange(500) for _ in range(20)], [rng.randrange(500) for _ in range(120)]
    log = [
        {
            "token_ids": head
            + [600 + i, 700 + i % 50, 800]
            + rest
            + [rng.randrange(500) for _ in range(10)],
            "user": f"u{i}",
        }
        for i in range(60)
    ]
    d = diagnose(log, block_sizes=(16,))
    span = next(c for c in d.kept if "token span" in c.title)
    assert span.position == 20
    assert d.chain[-1]["unbounded_hit_rate"] > 0.6 > d.chain[0]["unbounded_hit_rate"]


@pytest.mark.parametrize("free_order", ["vllm", "lru"])
def test_fast_replay_equals_block_manager(free_order):
    rng = random.Random(11)
    for trial in range(120):
        bs = rng.choice([1, 2, 4, 8])
        stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
        prompts = []
        for _ in range(rng.randrange(5, 50)):
            p = rng.choice(stems)[: rng.randrange(0, 30)] + [
                rng.randrange(3) for _ in range(rng.randrange(1, 20))
            ]
            if prompts and rng.random() < 0.3:
                p = [ord(c) for c in rng.choice(prompts)]
            if rng.random() < 0.2:
                p = p[: len(p) // bs * bs] or p  # block-aligned prompts: the n-1 rule and twins
            prompts.append(tokstr(p))
        cap = rng.choice([None, 4, 8, 12, 20, 40, 200])
        conc = rng.choice([1, 1, 2, 3])
        salts = [rng.choice([None, "a", "b"]) for _ in prompts] if rng.random() < 0.5 else None
        pub = (
            [rng.randrange(0, len(p) + 1) for p in prompts]
            if salts and rng.random() < 0.5
            else None
        )
        fast = replay_tokens(prompts, bs, cap, salts, pub, conc, free_order)
        ref = replay_block_manager(prompts, bs, cap, salts, pub, conc, free_order=free_order)
        assert (fast.per_request, fast.too_big) == (ref.per_request, ref.too_big), trial


def test_divergence_is_the_longest_match_with_any_earlier_prompt():
    rng = random.Random(2)
    prompts = [tokstr([rng.randrange(3) for _ in range(rng.randrange(1, 12))]) for _ in range(200)]
    d = divergence(prompts)
    for i, s in enumerate(prompts):
        best = max((lcp(s, t) for t in prompts[:i]), default=0)
        assert d.position[i] == best
        if i:
            assert lcp(s, prompts[d.partner[i]]) == best


def test_multiturn_window_and_tenant_salts(enc):
    log = []
    for c in range(24):
        tenant = ["acme", "globex", "initech"][c % 3]
        hist = []
        for t in range(4):
            hist.append(
                {"role": "user", "content": f"conversation {c} question {t}: " + "details " * 6}
            )
            kept = hist[-3:]  # the app keeps the last 3 messages only
            log.append(
                {
                    "messages": [{"role": "system", "content": "Operator rules. " + RULES * 2}]
                    + list(kept),
                    "session": f"s{c}",
                    "tenant": tenant,
                }
            )
            hist.append({"role": "assistant", "content": f"answer {t} " + "words " * 8})
    d = diagnose(log, encoder=enc, block_sizes=(16,), capacity_blocks=400, tenant_field="tenant")
    mt = next(c for c in d.culprits if c.kind == "multi-turn")
    assert mt.details["rebuilt"] > 0 and "window" in " ".join(mt.evidence)
    # salts give up the shared system prompt
    assert d.row()["unsalted_hit_rate"] > d.row()["unbounded_hit_rate"]
    ten = next(c for c in d.culprits if c.kind == "tenant-salt")
    assert ten.chained is not None
    # public prefix wins some back
    assert ten.chained["unbounded"]["hit_tokens"] > ten.before["unbounded"]["hit_tokens"]


def test_vllm_metrics_parser():
    text = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 150.0
vllm:num_requests_running{model_name="m"} 2.0
"""
    m = parse_metrics(text)
    assert (m["queries"], m["hits"], m["hit_rate"]) == (1500.0, 450.0, 0.3)
    assert (
        parse_metrics('vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.25\n')["hit_rate"] == 0.25
    )
    assert parse_metrics("")["hit_rate"] is None


def test_doctor_reads_kvlab_serve_metrics():
    """The doctor reads ``kvlab serve``'s /metrics (vLLM's counters under ``kvlab:``) like
    vLLM's."""
    pytest.importorskip("prometheus_client")
    from kvlab.serve.metrics import ServeMetrics

    metrics = ServeMetrics("m")
    metrics.on_finish(
        prompt_tokens=100, completion_tokens=4, cached_tokens=0, finish_reason="length", e2e=0.1
    )
    metrics.on_finish(
        prompt_tokens=120, completion_tokens=4, cached_tokens=96, finish_reason="length", e2e=0.1
    )
    m = parse_metrics(metrics.render().decode())
    assert (m["queries"], m["hits"]) == (220.0, 96.0) and m["hit_rate"] == 96 / 220
    assert m["source_names"] == [
        "kvlab:prefix_cache_queries_total",
        "kvlab:prefix_cache_hits_total",
    ]


def test_cli_end_to_end(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in planted_log(45)) + "not json\n")
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(
        'vllm:prefix_cache_queries_total{engine="0"} 2000\n'
        'vllm:prefix_cache_hits_total{engine="0"} 100\n'
    )
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlab.doctor",
            str(log),
            "--block-size",
            "16",
            "32",
            "--capacity-blocks",
            "50",
            "--vllm-metrics",
            str(metrics),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "45 requests replayed, 1 malformed" in proc.stdout
        and "line 46: invalid JSON" in proc.stdout
    )
    assert "vLLM /metrics" in proc.stdout and "5.0 %" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 45 and summary["malformed"][0]["line"] == 46
    assert (out / "report.html").exists() and (out / "hit_rates.png").exists()
    assert any(
        c["kept"] and c["fixed_log"] and Path(c["fixed_log"]).exists() for c in summary["culprits"]
    )
    bad = subprocess.run(
        [sys.executable, "-m", "kvlab.doctor", str(tmp_path / "missing.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_doctor_imports_no_lesson_code_and_token_logs_need_no_torch():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(('kvlab.lessons', 'torch', 'transformers')):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import kvlab.doctor, kvlab.doctor.__main__
from kvlab.doctor import diagnose
d = diagnose([{"token_ids": [1, 2, 3] * 10 + [i]} for i in range(20)], block_sizes=(4,))
print(round(d.row()["unbounded_hit_rate"], 3),
      sorted(m for m in sys.modules if m.startswith(("kvlab.lessons", "torch"))))
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "[]" and float(res.stdout.split()[0]) > 0.8
