"""The doctor's outputs (text, HTML, figures), all rendered from one JSON-able dict
(``Diagnosis.data()``)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any


def pct(x: float | None) -> str:
    """0.1234 -> '12.3 %'."""
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _esc(s: str) -> str:
    return s.replace("\n", "⏎")


def _head(s: str, n: int) -> str:
    """The start of ``s``, cut at a space at or before ``n`` characters (a number is never cut in
    two)."""
    if len(s) <= n:
        return s
    cut = s.rfind(" ", 0, n + 1)
    return s[:cut if cut > 0 else len(s)] + "…"


def _tail(s: str, n: int) -> str:
    """The end of ``s``, cut at a space or line break at or after ``len(s) - n``."""
    if len(s) <= n:
        return s
    cut = max(s.find(" ", len(s) - n), s.find("⏎", len(s) - n))
    return s[cut:] if cut >= 0 else s


def nothing_why(lines: int) -> str:
    """Why a log gave no request to replay, in words (``lines``: its non-blank lines)."""
    return (f"every one of its {lines} non-blank lines is malformed" if lines
            else "the log has no requests (it is empty or blank)")


def _groups(data: dict) -> tuple[list[dict], list[dict], list[dict], int, bool]:
    """The culprits kept (in fix order), dropped and evidence-only; the spot check's requests and
    agreement."""
    cs, checks = data["culprits"], data["spot_checks"]
    return (
        [c for c in cs if c["kept"]],
        [c for c in cs if c["no_effect"]],
        [c for c in cs if not c["measurable"]],
        checks[0]["requests"] if checks else 0,
        all(c["equal"] for c in checks),
    )


def _at(c: dict) -> str:
    return f", token ~{c['position']}" if c["position"] is not None else ""


def render_text(data: dict) -> str:
    """The terminal summary: counts, hit rates per block size, culprits with their measured
    fixes."""
    pt, k, tf, bad = data["prompt_tokens"], data["cap_key"], data["tenant_field"], data["malformed"]
    out = [
        f"kvlab doctor: {data['source']}",
        f"  tokenizer/template: {data['model']}",
        f"  lines: {data['lines']} read, {data['requests']} requests replayed, {len(bad)} "
        "malformed (skipped, listed below)",
    ]
    out += [
        f"  prompt tokens: {pt['total']} in all, mean {pt['mean']:.0f}, max {pt['max']}"
    ] * bool(data["requests"])
    out += [f"    line {b['line']}: {b['error']}: {b['text']!r}" for b in bad[:10]]
    out += [f"    ... {len(bad) - 10} more in summary.json"] * (len(bad) > 10)
    out += [f"  note: {n}" for n in data["notes"]]
    if not data["requests"]:
        return "\n".join(out + [f"  nothing to replay: {nothing_why(data['lines'])}."])
    out += [
        "",
        f"hit rate, replayed in log order with vLLM's rules{' (salted per tenant)' if tf else ''}:",
        f"  {'block':>5}  {'unbounded cache':>15}  {'capacity':>22}"
        + (f"  {'no salts':>9}" if tf else ""),
    ]
    for r in data["table"]:
        cap = (
            f"{pct(r['capacity_hit_rate'])} ({r['capacity_blocks']} blocks)"
            if r.get("capacity_blocks") is not None
            else "(no --capacity-blocks)"
        )
        out.append(f"  {r['block_size']:>5}  {pct(r['unbounded_hit_rate']):>15}  {cap:>22}"
                   + (f"  {pct(r['unsalted_hit_rate']):>9}" if tf else ""))
    out.append(
        "  ceiling (token-granular cache, no eviction, no salts): "
        f"{pct(data['ceiling']['hit_rate'])}"
    )
    base = data["baseline"][k]["hit_rate"]
    if v := data["vllm"]:
        out.append(f"  vLLM /metrics ({v['file']}): queries {v['queries']}, hits {v['hits']}, "
                   f"hit rate {pct(v['hit_rate'])}  vs replay {pct(base)}")
    kept, weak, info, n, equal = _groups(data)
    out += [f"  check: first {n} requests replayed through kvlab.cache.BlockManager too: "
            f"{'identical' if equal else 'DIFFERENT'}", "",
            "where prompts stop matching every earlier prompt (most common token positions):"]
    out += [
        f"  token {p['position']:>5}: {p['requests']:>5} requests  …{_tail(_esc(p['before']), 40)}"
        f"⟦{_head(_esc(p['after_request']), 24)} | earlier: {_head(_esc(p['after_partner']), 24)}⟧"
        for p in data["top_divergence_points"]
    ]
    out += [
        "",
        f"culprits, in fix order (block size {data['block_size']}; hit rate with the "
        f"{'given capacity' if k == 'capacity' else 'unbounded cache'}; as logged {pct(base)}):",
    ]
    out += ["  none found"] * (not kept)
    for c in kept:
        b, a = c["before"][k], c["chained"][k]
        out += [
            f"  {c['fix_order']}. {c['title']}  [{c['where']}{_at(c)}]",
            *(f"       {_head(_esc(e), 160)}" for e in c["evidence"][:4]),
            f"     fix: {c['fix']}",
            f"     measured: {pct(b['hit_rate'])} -> {pct(a['hit_rate'])} "
            f"({100 * c['change']:+.1f} points); prefill tokens {b['computed_tokens']} -> "
            f"{a['computed_tokens']}",
        ]
        if c["alone"]:
            out.append(
                f"     this fix alone on the log as logged: {pct(base)} -> "
                f"{pct(c['alone'][k]['hit_rate'])}"
            )
        out += [
            f"     the log with this fix and the ones above: {c['fixed_log']}"
        ] * bool(c["fixed_log"])
    out += [
        f"  candidates checked and dropped (fixing them saves less than {pct(data['min_effect'])} "
        "of the prompt tokens' prefill, unbounded cache):"
    ] * bool(weak)
    out += [f"     - {c['title']}: {_dropped(c)}" for c in weak]
    out += ["  evidence only (no automatic rewrite):"] * bool(info)
    out += [
        f"     - {c['title']}: " + "; ".join(_head(_esc(e), 100) for e in c["evidence"][:2])
        for c in info
    ]
    if len(chain := data["chain"]) > 1:
        out += [
            "",
            f"all fixes together: {pct(chain[0][k + '_hit_rate'])} -> "
            f"{pct(chain[-1][k + '_hit_rate'])}, prefill tokens {chain[0][k + '_computed_tokens']} "
            f"-> {chain[-1][k + '_computed_tokens']}",
        ]
    if s := data["system_only"]:
        out.append(
            "sharing only the system prompt (article 5.4) on the fixed log: "
            f"{pct(s['hit_rate_system_only'])} vs sharing the history too: "
            f"{pct(s['hit_rate_history_shared'])}"
        )
    out += ["", "time (s): " + ", ".join(f"{name} {v:.2f}" for name, v in data["timings"].items())]
    return "\n".join(out)


def _dropped(c: dict) -> str:
    """What a dropped candidate's fix measured (or why it was not measured)."""
    if c["chained"] is None:
        return c["quick_look"] or "not measured"
    return (f"{pct(c['before']['unbounded']['hit_rate'])} -> "
            f"{pct(c['chained']['unbounded']['hit_rate'])}")


def _row(*cells: object, th: bool = False, left: tuple[int, ...] = ()) -> str:
    """One HTML table row (cells escaped by the caller); ``left``: the indexes of left-aligned
    cells."""
    tag = "th" if th else "td"
    return (
        "<tr>"
        + "".join(
            f"<{tag}{' class=l' if j in left else ''}>{x}</{tag}>" for j, x in enumerate(cells)
        )
        + "</tr>"
    )


def _points_table(e, points: list[dict], head: str) -> list[str]:
    top = (
        f"<table><tr><th>token</th><th>requests</th><th class=l>{head}</th><th class=l>this "
        "request goes on</th><th class=l>the earlier prompt went on</th></tr>"
    )
    return (
        [top]
        + [
            f"<tr><td>{p['position']}</td><td>{p['requests']}</td>"
            f"<td class=l><code>{e(_esc(p['before']))}</code></td>"
            f"<td class='l diff'><code>{e(_esc(p['after_request']))}</code></td>"
            f"<td class=l><code>{e(_esc(p['after_partner']))}</code></td></tr>"
            for p in points
        ]
        + ["</table>"]
    )


def render_html(data: dict, figs: dict[str, Path]) -> str:
    """A self-contained HTML page (figures linked as PNG files next to it)."""
    e, pt, k, tf = html.escape, data["prompt_tokens"], data["cap_key"], data["tenant_field"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvlab doctor: "
        f"{e(data['source'])}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4}"
        "table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td.l,th.l{text-align:left}pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}"
        ".diff{background:#fde2e2}</style></head><body>",
        f"<h1>Why is my hit rate low?</h1><p>log <code>{e(data['source'])}</code>, tokenizer and "
        f"chat template <code>{e(data['model'])}</code>: {data['lines']} lines, {data['requests']} "
        f"requests replayed, <b>{len(data['malformed'])} malformed</b> (skipped, "
        "listed at the end)."
        + (
            f" Prompt tokens: {pt['total']} in all, mean {pt['mean']:.0f}, max {pt['max']}."
            if data["requests"]
            else f" Nothing to replay: {e(nothing_why(data['lines']))}."
        )
        + "</p>",
    ]
    parts += [f"<p><i>note: {e(n)}</i></p>" for n in data["notes"]]
    if data["requests"]:
        parts += _html_findings(data, figs, e, k, tf)
    if bad := data["malformed"]:
        parts += [
            "<h2>Malformed lines (skipped)</h2><ul>",
            *(
                f"<li>line {b['line']}: {e(b['error'])} <code>{e(b['text'])}</code></li>"
                for b in bad
            ),
            "</ul>",
        ]
    parts.append(
        "<h2>Time</h2><table>"
        + "".join(_row(e(name), f"{v:.2f} s", left=(0,)) for name, v in data["timings"].items())
        + "</table></body></html>"
    )
    return "\n".join(parts)


def _html_findings(data: dict, figs: dict[str, Path], e, k: str, tf: str | None) -> list[str]:
    """The HTML report's sections past its header: hit rates, divergence points, culprits, fixes."""
    parts = ["<h2>Hit rate, replayed in log order with vLLM's rules</h2><table>"
             + _row("block size", "unbounded cache", "capacity (blocks)", "hit rate at capacity",
                    *(("no salts",) if tf else ()), "requests sharing &lt; 1 block", th=True)]
    parts += [_row(r["block_size"], pct(r["unbounded_hit_rate"]), r.get("capacity_blocks") or "-",
                   pct(r.get("capacity_hit_rate")), *((pct(r["unsalted_hit_rate"]),) if tf else ()),
                   r["short_requests"]) for r in data["table"]]
    kept, weak, info, n, equal = _groups(data)
    parts.append(
        f"</table><p>Ceiling (a token-granular cache with unlimited room, no salts): "
        f"<b>{pct(data['ceiling']['hit_rate'])}</b>. Spot check: the first {n} requests replayed "
        "through <code>kvlab.cache.BlockManager</code> give "
        f"{'identical' if equal else '<b>different</b>'} "
        "counts.</p>"
    )
    base = data["baseline"][k]
    if v := data["vllm"]:
        parts.append(
            f"<p>vLLM <code>/metrics</code> ({e(v['file'])}): queries {v['queries']}, hits "
            f"{v['hits']}, hit rate <b>{pct(v['hit_rate'])}</b> (series: {e(str(v['series']))}) vs "
            f"the replay's {pct(base['hit_rate'])}.</p>"
        )
    parts += ["<img src='hit_rates.png'>"] * ("hit_rates" in figs) + [
        "<h2>Where prompts stop matching</h2>"
    ]
    parts += ["<img src='divergence.png'>"] * ("divergence" in figs)
    parts += _points_table(e, data["top_divergence_points"], "text before")
    parts.append(
        f"<h2>Culprits</h2><p>Measured at block size {data['block_size']}, "
        f"{'the given capacity' if k == 'capacity' else 'an unbounded cache'}; as logged: "
        f"<b>{pct(base['hit_rate'])}</b>, {base['computed_tokens']} prompt tokens prefilled.</p>"
    )
    for c in kept:
        b, a = c["before"][k], c["chained"][k]
        parts.append(f"<h3>{c['fix_order']}. {e(c['title'])}</h3><p>{e(c['where'])}{_at(c)}; "
                     f"{c['affected']} requests</p><ul>")
        parts += [f"<li>{e(x)}</li>" for x in c["evidence"]] + ["</ul>"]
        parts += [f"<pre>request: {e(x)}</pre><pre>earlier: {e(y)}</pre>" for x, y in c["examples"]]
        parts.append(
            f"<p><b>Fix:</b> {e(c['fix'])}</p><p>Measured after the fixes listed before it: "
            f"{pct(b['hit_rate'])} &rarr; <b>{pct(a['hit_rate'])}</b> ({100 * c['change']:+.1f} "
            f"points), prefill tokens {b['computed_tokens']} &rarr; {a['computed_tokens']}"
            + (
                f"; this fix alone on the log as logged: {pct(c['alone'][k]['hit_rate'])}"
                if c["alone"]
                else ""
            )
            + "</p>"
        )
        if c["fixed_log"]:
            parts.append(
                "<p>The log with this fix and the ones above it: "
                f"<code>{e(c['fixed_log'])}</code></p>"
            )
    if weak:
        parts.append(
            f"<h3>Candidates checked and dropped</h3><p>Fixing them saves less than "
            f"{pct(data['min_effect'])} of the prompt tokens' prefill (unbounded cache).</p><ul>"
        )
        parts += [f"<li>{e(c['title'])}: {e(_dropped(c))}</li>" for c in weak] + ["</ul>"]
    if info:
        parts.append("<h3>Evidence only (no automatic rewrite)</h3><ul>")
        parts += [
            f"<li>{e(c['title'])}: {e('; '.join(c['evidence'][:3]))}</li>" for c in info
        ] + ["</ul>"]
    if len(data["chain"]) > 1:
        cap = k == "capacity"
        parts += ["<h2>All fixes, one after the other</h2>"]
        parts += ["<img src='fixes.png'>"] * ("fixes" in figs)
        parts.append("<table>" + _row("step", "hit rate (unbounded)", "prefill tokens", *(
            ("hit rate (capacity)", "prefill tokens") if cap else ()), th=True, left=(0,)))
        parts += [
            _row(
                e(r["step"]),
                pct(r["unbounded_hit_rate"]),
                r["unbounded_computed_tokens"],
                *((pct(r["capacity_hit_rate"]), r["capacity_computed_tokens"]) if cap else ()),
                left=(0,),
            )
            for r in data["chain"]
        ]
        parts += ["</table><p>What still diverges after every fix:</p>"]
        parts += _points_table(e, data["remaining_divergence_points"], "before")
    if s := data["system_only"]:
        parts.append(f"<p>Sharing only the system prompt (article 5.4) on the fixed log: "
                     f"{pct(s['hit_rate_system_only'])} vs sharing the history too: "
                     f"{pct(s['hit_rate_history_shared'])}.</p>")
    return parts


def figures(data: dict, out_dir: Path) -> dict[str, Path]:
    """hit_rates.png, divergence.png, fixes.png (needs matplotlib; {} without it)."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    figs = {
        "hit_rates": fig_hit_rates(data),
        "divergence": fig_divergence(data),
        "fixes": fig_fixes(data),
    }
    paths = {name: out_dir / f"{name}.png" for name, fig in figs.items() if fig is not None}
    for name, path in paths.items():
        with open(path, "xb") as f:  # created new, never written over an existing file
            figs[name].savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(figs[name])
    return paths


def fig_hit_rates(d: Any):
    """Bars: hit rate per block size (unbounded, capacity, no salts) and the token-level ceiling."""
    import matplotlib.pyplot as plt
    data = d if isinstance(d, dict) else d.data()  # a Diagnosis or its data()
    if not data["requests"]:
        return None
    table = data["table"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    series = [("unbounded cache", "unbounded_hit_rate")]
    series += [("given capacity", "capacity_hit_rate")] * any(
        r.get("capacity_hit_rate") is not None for r in table
    )
    series += [("no salts", "unsalted_hit_rate")] * bool(data["tenant_field"])
    w, xs = 0.8 / len(series), range(len(table))
    for k, (label, key) in enumerate(series):
        ax.bar([x + k * w for x in xs], [100 * (r.get(key) or 0) for r in table], w, label=label)
    ax.axhline(
        100 * data["ceiling"]["hit_rate"],
        color="k",
        ls="--",
        lw=1,
        label="ceiling (token-granular)",
    )
    ax.set_xticks(
        [x + w * (len(series) - 1) / 2 for x in xs], [str(r["block_size"]) for r in table]
    )
    ax.set(
        xlabel="block size (tokens)",
        ylabel="hit rate (%)",
        title="prefix-cache hit rate of the log, replayed",
    )
    ax.legend(fontsize=8)
    return fig


def fig_divergence(d: Any):
    """Histogram of divergence positions, the most common points marked."""
    import matplotlib.pyplot as plt
    data = d if isinstance(d, dict) else d.data()  # a Diagnosis or its data()
    if not data["requests"]:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    if data["divergence_histogram"]:  # (position, requests) pairs, sorted
        xs, counts = zip(*data["divergence_histogram"])
        ax.bar(xs, counts, width=max(1, (xs[-1] - xs[0]) / 300))
        for p in data["top_divergence_points"][:3]:
            ax.annotate(
                f"{p['position']}",
                (p["position"], p["requests"]),
                fontsize=8,
                ha="center",
                va="bottom",
            )
        ax.set_yscale("log")
    ax.set(
        xlabel="token position where a prompt stops matching every earlier prompt",
        ylabel="requests",
        title="divergence points",
    )
    return fig


def fix_labels(chain: list[dict]) -> list[str]:
    """One label per step of the fix chain; a kind that occurs twice is told apart by its field or
    title."""
    kinds = [r["kind"] for r in chain]
    out = []
    for k, r in enumerate(chain):
        if k == 0:
            out.append("as logged")
        elif kinds.count(r["kind"]) == 1:
            out.append(f"+ {r['kind']}")
        else:
            what = r["step"].rsplit(": ", 1)[-1].strip() if ": " in r["step"] else r["step"]
            out.append(f"+ {r['kind']}: {what[:28]}")
    return out


def fig_fixes(d: Any):
    """Hit rate after each fix, applied one after the other; two fixes of one kind labelled
    apart."""
    import matplotlib.pyplot as plt
    data = d if isinstance(d, dict) else d.data()  # a Diagnosis or its data()
    if len(chain := data["chain"]) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 0.8 + 0.42 * len(chain)))
    vals = [100 * r[f"{data['cap_key']}_hit_rate"] for r in chain]
    ax.barh(range(len(vals)), vals, color=["0.6"] + ["C0"] * (len(vals) - 1))
    for y, v in enumerate(vals):
        ax.text(v + 0.5, y, f"{v:.1f} %", va="center", fontsize=8)
    ax.set_yticks(range(len(vals)), fix_labels(chain))
    ax.invert_yaxis()
    ax.set(xlabel=f"hit rate (%), block size {data['block_size']}", xlim=(0, 110),
           title="fixes applied one after the other")
    fig.tight_layout()
    return fig
