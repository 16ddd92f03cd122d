"""The doctor's outputs: a terminal summary, ``summary.json``, PNG figures, ``report.html`` and fixed logs."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Diagnosis


def pct(x: float | None) -> str:
    """0.1234 -> '12.3 %'."""
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _esc(s: str) -> str:
    return s.replace("\n", "⏎")


def nothing_why(d: Diagnosis) -> str:
    """Why a log gave no request to replay, in words."""
    if not d.lines:
        return "the log has no requests (it is empty or blank)"
    return f"every one of its {d.lines} non-blank lines is malformed"


def format_summary(d: Diagnosis) -> str:
    """The terminal summary: counts, hit rates per block size, culprits with their measured fixes."""
    out = []
    bs = d.block_size
    out.append(f"kvlab doctor: {d.source}")
    out.append(f"  tokenizer/template: {d.model}")
    out.append(f"  lines: {d.lines} read, {d.requests} requests replayed, {len(d.bad)} malformed (skipped, listed below)")
    if d.requests:
        lens = d.prep.lengths
        out.append(f"  prompt tokens: {sum(lens)} in all, mean {sum(lens) / len(lens):.0f}, max {max(lens)}")
    for b in d.bad[:10]:
        out.append(f"    {b}")
    if len(d.bad) > 10:
        out.append(f"    ... {len(d.bad) - 10} more in summary.json")
    for n in d.notes:
        out.append(f"  note: {n}")
    if not d.requests:
        out.append(f"  nothing to replay: {nothing_why(d)}.")
        return "\n".join(out)
    out.append("")
    salted = " (salted per tenant)" if d.tenant_field else ""
    out.append(f"hit rate, replayed in log order with vLLM's rules{salted}:")
    head = f"  {'block':>5}  {'unbounded cache':>15}  {'capacity':>22}"
    if d.tenant_field:
        head += f"  {'no salts':>9}"
    out.append(head)
    for r in d.table:
        cap = (f"{pct(r['capacity_hit_rate'])} ({r['capacity_blocks']} blocks)" if r.get("capacity_blocks") is not None
               else "(no --capacity-blocks)")
        line = f"  {r['block_size']:>5}  {pct(r['unbounded_hit_rate']):>15}  {cap:>22}"
        if d.tenant_field:
            line += f"  {pct(r['unsalted_hit_rate']):>9}"
        out.append(line)
    out.append(f"  ceiling (token-granular cache, no eviction, no salts): {pct(d.ceiling['hit_rate'])}")
    if d.vllm:
        v = d.vllm
        out.append(f"  vLLM /metrics ({v['file']}): queries {v['queries']}, hits {v['hits']}, hit rate {pct(v['hit_rate'])}"
                   f"  vs replay {pct(d.row()['capacity_hit_rate'] if 'capacity_hit_rate' in d.row() else d.row()['unbounded_hit_rate'])}")
    ok = all(c["equal"] for c in d.spot_checks)
    out.append(f"  check: first {d.spot_checks[0]['requests'] if d.spot_checks else 0} requests replayed through "
               f"kvlab.cache.BlockManager too: {'identical' if ok else 'DIFFERENT'}")
    out.append("")
    out.append("where prompts stop matching every earlier prompt (most common token positions):")
    for p in d.top_points:
        out.append(f"  token {p['position']:>5}: {p['requests']:>5} requests  …{_esc(p['before'])[-40:]}⟦{_esc(p['after_request'])[:24]}"
                   f" | earlier: {_esc(p['after_partner'])[:24]}⟧")
    out.append("")
    cap_key = d.cap_key
    base = d.baseline[cap_key]["hit_rate"]
    kept = [c for c in d.culprits if c.chained is not None and not c.no_effect]
    out.append(f"culprits, in fix order (block size {bs}; hit rate with the "
               f"{'given capacity' if cap_key == 'capacity' else 'unbounded cache'}; as logged {pct(base)}):")
    if not kept:
        out.append("  none found")
    for n, c in enumerate(kept, 1):
        pos = f"token ~{c.position}" if c.position is not None else ""
        out.append(f"  {n}. {c.title}  [{c.where}{', ' + pos if pos else ''}]")
        for e in c.evidence[:4]:
            out.append(f"       {_esc(e)[:160]}")
        out.append(f"     fix: {c.fix_text}")
        b, a = c.before[cap_key], c.chained[cap_key]
        out.append(f"     measured: {pct(b['hit_rate'])} -> {pct(a['hit_rate'])} "
                   f"({100 * (a['hit_rate'] - b['hit_rate']):+.1f} points); prefill tokens {b['computed_tokens']} -> "
                   f"{a['computed_tokens']}")
        if c.alone:
            out.append(f"     this fix alone on the log as logged: {pct(base)} -> {pct(c.alone[cap_key]['hit_rate'])}")
        if c.fixed_log:
            out.append(f"     the log with this fix and the ones above: {c.fixed_log}")
    weak = [c for c in d.culprits if c.no_effect]
    if weak:
        out.append(f"  candidates checked and dropped (fixing them saves less than {100 * d.min_effect:.1f} % of the "
                   "prompt tokens' prefill, unbounded cache):")
        for c in weak:
            if c.chained is None:
                out.append(f"     - {c.title}: {c.details.get('quick look', 'not measured')}")
            else:
                out.append(f"     - {c.title}: {pct(c.before['unbounded']['hit_rate'])} -> "
                           f"{pct(c.chained['unbounded']['hit_rate'])}")
    info = [c for c in d.culprits if not c.measurable]
    if info:
        out.append("  evidence only (no automatic rewrite):")
        for c in info:
            out.append(f"     - {c.title}: " + "; ".join(_esc(e)[:100] for e in c.evidence[:2]))
    if len(d.chain) > 1:
        last = d.chain[-1]
        out.append("")
        out.append(f"all fixes together: {pct(d.chain[0][cap_key + '_hit_rate'])} -> {pct(last[cap_key + '_hit_rate'])}, "
                   f"prefill tokens {d.chain[0][cap_key + '_computed_tokens']} -> {last[cap_key + '_computed_tokens']}")
    if d.system_only:
        s = d.system_only
        out.append(f"sharing only the system prompt (article 5.4) on the fixed log: {pct(s['hit_rate_system_only'])} "
                   f"vs sharing the history too: {pct(s['hit_rate_history_shared'])}")
    out.append("")
    out.append("time (s): " + ", ".join(f"{k} {v:.2f}" for k, v in d.timings.items()))
    return "\n".join(out)


def to_json(d: Diagnosis) -> dict:
    """Every number of the diagnosis as plain JSON."""
    def culprit(c):
        return {"kind": c.kind, "title": c.title, "position": c.position, "where": c.where, "evidence": c.evidence,
                "fix": c.fix_text, "affected": c.affected, "measurable": c.measurable,
                "kept": c.chained is not None and not c.no_effect, "before": c.before, "chained": c.chained,
                "alone": c.alone, "fixed_log": c.fixed_log}
    lens = d.prep.lengths
    enc = d.enc
    tok = {} if enc is None else {"pieces": enc.pieces_total, "pieces_tokenized": enc.pieces_tokenized,
                                  "chars_tokenized": enc.chars_tokenized, "split_at_lines": enc.lines,
                                  "split_at_special_tokens": enc.segmented}
    return {"source": d.source, "model": d.model, "lines": d.lines, "requests": d.requests,
            "prompt_tokens": {"total": sum(lens), "mean": sum(lens) / len(lens) if lens else 0, "max": max(lens, default=0)},
            "tokenizer": tok,
            "malformed": [{"line": b.line, "error": b.error, "text": b.text} for b in d.bad],
            "block_sizes": d.block_sizes, "capacity_blocks": {str(k): v for k, v in d.capacity_blocks.items()},
            "table": d.table, "ceiling": d.ceiling, "top_divergence_points": d.top_points,
            "culprits": [culprit(c) for c in d.culprits], "baseline": d.baseline, "chain": d.chain,
            "remaining_divergence_points": d.final_top_points, "system_only": d.system_only, "vllm": d.vllm,
            "spot_checks": d.spot_checks, "scan": d.scan, "timings": d.timings, "notes": d.notes}


def figures(d: Diagnosis, out_dir: Path) -> dict[str, Path]:
    """hit_rates.png, divergence.png, fixes.png (needs matplotlib; {} without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    paths = {}
    for name, fig in (("hit_rates", fig_hit_rates(d)), ("divergence", fig_divergence(d)), ("fixes", fig_fixes(d))):
        if fig is None:
            continue
        p = out_dir / f"{name}.png"
        with open(p, "xb") as f:  # created new, never written over an existing file
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths[name] = p
    return paths


def fig_hit_rates(d: Diagnosis):
    """Bars: hit rate per block size (unbounded, capacity, no salts) and the token-level ceiling."""
    import matplotlib.pyplot as plt

    if not d.requests:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    series = [("unbounded cache", "unbounded_hit_rate")]
    if any(r.get("capacity_hit_rate") is not None for r in d.table):
        series.append(("given capacity", "capacity_hit_rate"))
    if d.tenant_field:
        series.append(("no salts", "unsalted_hit_rate"))
    w = 0.8 / len(series)
    xs = range(len(d.table))
    for k, (label, key) in enumerate(series):
        ax.bar([x + k * w for x in xs], [100 * (r.get(key) or 0) for r in d.table], w, label=label)
    ax.axhline(100 * d.ceiling["hit_rate"], color="k", ls="--", lw=1, label="ceiling (token-granular)")
    ax.set_xticks([x + w * (len(series) - 1) / 2 for x in xs], [str(r["block_size"]) for r in d.table])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("prefix-cache hit rate of the log, replayed")
    ax.legend(fontsize=8)
    return fig


def fig_divergence(d: Diagnosis):
    """Histogram of divergence positions, the most common points marked."""
    import matplotlib.pyplot as plt

    if not d.requests:
        return None
    h = d.div.histogram()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    if h:
        xs = sorted(h)
        ax.bar(xs, [h[x] for x in xs], width=max(1, (max(xs) - min(xs)) / 300))
        for p in d.top_points[:3]:
            ax.annotate(f"{p['position']}", (p["position"], p["requests"]), fontsize=8, ha="center", va="bottom")
        ax.set_yscale("log")
    ax.set_xlabel("token position where a prompt stops matching every earlier prompt")
    ax.set_ylabel("requests")
    ax.set_title("divergence points")
    return fig


def fig_fixes(d: Diagnosis):
    """Hit rate after each fix, applied one after the other."""
    import matplotlib.pyplot as plt

    if len(d.chain) < 2:
        return None
    key = "capacity_hit_rate" if "capacity_hit_rate" in d.chain[0] else "unbounded_hit_rate"
    fig, ax = plt.subplots(figsize=(6.4, 0.5 + 0.42 * len(d.chain)))
    labels = [("as logged" if k == 0 else f"+ {r['kind']}") for k, r in enumerate(d.chain)]
    vals = [100 * r[key] for r in d.chain]
    ax.barh(range(len(vals)), vals, color=["0.6"] + ["C0"] * (len(vals) - 1))
    for y, v in enumerate(vals):
        ax.text(v + 0.5, y, f"{v:.1f} %", va="center", fontsize=8)
    ax.set_yticks(range(len(vals)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"hit rate (%), block size {d.block_size}")
    ax.set_xlim(0, 105)
    ax.set_title("fixes applied one after the other")
    return fig


def write_report(d: Diagnosis, out_dir: str | Path, fixed: bool = True) -> dict[str, Path]:
    """summary.json, figures, fixed logs and report.html under ``out_dir``; return the paths.

    ``out_dir`` is checked first (``kvlab.doctor.outdir``: OutDirError if it is a file, holds an input,
    or holds files the doctor did not write); the earlier run's files are deleted, every new file is
    created new, and ``kvlab_doctor_manifest.json`` lists them.
    """
    import time

    from .core import fixed_logs
    from .outdir import check_out_dir, clear, write_manifest, written

    out = Path(out_dir)
    stale = check_out_dir(out, d.inputs)
    out.mkdir(parents=True, exist_ok=True)
    clear(out, stale)
    try:
        t = time.perf_counter()
        paths: dict[str, Path] = {}
        if fixed and d.requests:
            paths.update({f"fixed: {k}": v for k, v in fixed_logs(d, out / "fixed").items()})
        d.timings["write fixed logs"] = time.perf_counter() - t
        t = time.perf_counter()
        figs = figures(d, out)
        paths.update(figs)
        d.timings["figures"] = time.perf_counter() - t
        with open(out / "summary.json", "x", encoding="utf-8") as f:
            f.write(json.dumps(to_json(d), indent=1, default=str))
        paths["summary.json"] = out / "summary.json"
        with open(out / "report.html", "x", encoding="utf-8") as f:
            f.write(to_html(d, figs))
        paths["report.html"] = out / "report.html"
    finally:  # what was written, even when a write failed half-way: the next run deletes it
        write_manifest(out, written(out))
    return paths


def to_html(d: Diagnosis, figs: dict[str, Path]) -> str:
    """A self-contained HTML page (figures linked as PNG files next to it)."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>kvlab doctor: {e(d.source)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "td.l,th.l{text-align:left}pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}"
             ".diff{background:#fde2e2}</style></head><body>",
             f"<h1>Why is my hit rate low?</h1><p>log <code>{e(d.source)}</code>, tokenizer and chat template "
             f"<code>{e(d.model)}</code>: {d.lines} lines, {d.requests} requests replayed, "
             f"<b>{len(d.bad)} malformed</b> (skipped, listed at the end).</p>"]
    for n in d.notes:
        parts.append(f"<p><i>note: {e(n)}</i></p>")
    if d.requests:
        parts.append("<h2>Hit rate, replayed in log order with vLLM's rules</h2><table><tr><th>block size</th>"
                     "<th>unbounded cache</th><th>capacity (blocks)</th><th>hit rate at capacity</th>"
                     + ("<th>no salts</th>" if d.tenant_field else "") + "<th>requests sharing &lt; 1 block</th></tr>")
        for r in d.table:
            parts.append(f"<tr><td>{r['block_size']}</td><td>{pct(r['unbounded_hit_rate'])}</td>"
                         f"<td>{r.get('capacity_blocks') or '-'}</td><td>{pct(r.get('capacity_hit_rate'))}</td>"
                         + (f"<td>{pct(r['unsalted_hit_rate'])}</td>" if d.tenant_field else "")
                         + f"<td>{r['short_requests']}</td></tr>")
        parts.append(f"</table><p>Ceiling (a token-granular cache with unlimited room, no salts): "
                     f"<b>{pct(d.ceiling['hit_rate'])}</b>. Spot check: the first "
                     f"{d.spot_checks[0]['requests'] if d.spot_checks else 0} requests replayed through "
                     f"<code>kvlab.cache.BlockManager</code> give "
                     f"{'identical' if all(c['equal'] for c in d.spot_checks) else '<b>different</b>'} counts.</p>")
        if d.vllm:
            parts.append(f"<p>vLLM <code>/metrics</code> ({e(d.vllm['file'])}): queries {d.vllm['queries']}, hits "
                         f"{d.vllm['hits']}, hit rate <b>{pct(d.vllm['hit_rate'])}</b> (series: {e(str(d.vllm['series']))}).</p>")
        if "hit_rates" in figs:
            parts.append("<img src='hit_rates.png'>")
        parts.append("<h2>Where prompts stop matching</h2>")
        if "divergence" in figs:
            parts.append("<img src='divergence.png'>")
        parts.append("<table><tr><th>token</th><th>requests</th><th class=l>text before</th>"
                     "<th class=l>this request goes on</th><th class=l>the earlier prompt went on</th></tr>")
        for p in d.top_points:
            parts.append(f"<tr><td>{p['position']}</td><td>{p['requests']}</td><td class=l><code>{e(_esc(p['before']))}</code></td>"
                         f"<td class='l diff'><code>{e(_esc(p['after_request']))}</code></td>"
                         f"<td class=l><code>{e(_esc(p['after_partner']))}</code></td></tr>")
        parts.append("</table>")
        cap_key = "capacity" if d.baseline.get("capacity") else "unbounded"
        base = d.baseline[cap_key]
        parts.append(f"<h2>Culprits</h2><p>Measured at block size {d.block_size}, "
                     f"{'the given capacity' if cap_key == 'capacity' else 'an unbounded cache'}; as logged: "
                     f"<b>{pct(base['hit_rate'])}</b>, {base['computed_tokens']} prompt tokens prefilled.</p>")
        for n, c in enumerate(d.kept, 1):
            parts.append(f"<h3>{n}. {e(c.title)}</h3><p>{e(c.where)}"
                         + (f", token ~{c.position}" if c.position is not None else "") + f"; {c.affected} requests</p><ul>")
            parts += [f"<li>{e(x)}</li>" for x in c.evidence]
            parts.append("</ul>")
            for a, b in c.examples[:1]:
                parts.append(f"<pre>request: {e(a)}</pre><pre>earlier: {e(b)}</pre>")
            parts.append(f"<p><b>Fix:</b> {e(c.fix_text)}</p>")
            b, a = c.before[cap_key], c.chained[cap_key]
            parts.append(f"<p>Measured after the fixes listed before it: {pct(b['hit_rate'])} &rarr; "
                         f"<b>{pct(a['hit_rate'])}</b> ({100 * (a['hit_rate'] - b['hit_rate']):+.1f} points), prefill "
                         f"tokens {b['computed_tokens']} &rarr; {a['computed_tokens']}"
                         + (f"; this fix alone on the log as logged: {pct(c.alone[cap_key]['hit_rate'])}" if c.alone else "")
                         + "</p>")
            if c.fixed_log:
                parts.append(f"<p>The log with this fix and the ones above it: <code>{e(c.fixed_log)}</code></p>")
        weak = [c for c in d.culprits if c.no_effect]
        if weak:
            parts.append(f"<h3>Candidates checked and dropped</h3><p>Fixing them saves less than {100 * d.min_effect:.1f} % "
                         "of the prompt tokens' prefill (unbounded cache).</p><ul>")
            for c in weak:
                got = (c.details.get("quick look", "not measured") if c.chained is None else
                       f"{pct(c.before['unbounded']['hit_rate'])} &rarr; {pct(c.chained['unbounded']['hit_rate'])}")
                parts.append(f"<li>{e(c.title)}: {got}</li>")
            parts.append("</ul>")
        info = [c for c in d.culprits if not c.measurable]
        if info:
            parts.append("<h3>Evidence only (no automatic rewrite)</h3><ul>")
            parts += [f"<li>{e(c.title)}: {e('; '.join(c.evidence[:3]))}</li>" for c in info]
            parts.append("</ul>")
        if len(d.chain) > 1:
            parts.append("<h2>All fixes, one after the other</h2>")
            if "fixes" in figs:
                parts.append("<img src='fixes.png'>")
            parts.append("<table><tr><th class=l>step</th><th>hit rate (unbounded)</th><th>prefill tokens</th>"
                         + ("<th>hit rate (capacity)</th><th>prefill tokens</th>" if cap_key == "capacity" else "") + "</tr>")
            for r in d.chain:
                parts.append(f"<tr><td class=l>{e(r['step'])}</td><td>{pct(r['unbounded_hit_rate'])}</td>"
                             f"<td>{r['unbounded_computed_tokens']}</td>"
                             + (f"<td>{pct(r['capacity_hit_rate'])}</td><td>{r['capacity_computed_tokens']}</td>"
                                if cap_key == "capacity" else "") + "</tr>")
            parts.append("</table>")
            parts.append("<p>What still diverges after every fix:</p><table><tr><th>token</th><th>requests</th>"
                         "<th class=l>before</th><th class=l>this request</th><th class=l>earlier prompt</th></tr>")
            for p in d.final_top_points:
                parts.append(f"<tr><td>{p['position']}</td><td>{p['requests']}</td><td class=l><code>{e(_esc(p['before']))}</code>"
                             f"</td><td class=l><code>{e(_esc(p['after_request']))}</code></td>"
                             f"<td class=l><code>{e(_esc(p['after_partner']))}</code></td></tr>")
            parts.append("</table>")
    if d.bad:
        parts.append("<h2>Malformed lines (skipped)</h2><ul>")
        parts += [f"<li>line {b.line}: {e(b.error)} <code>{e(b.text)}</code></li>" for b in d.bad]
        parts.append("</ul>")
    parts.append("<h2>Time</h2><table>" + "".join(f"<tr><td class=l>{e(k)}</td><td>{v:.2f} s</td></tr>"
                                                   for k, v in d.timings.items()) + "</table>")
    parts.append("</body></html>")
    return "\n".join(parts)
