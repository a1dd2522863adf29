"""Results of ``leantune bench e2e`` / ``max-context``: agreement flags, ratios, markdown table, PNG bar charts.

Works on any machine: it only reads the JSON files that the GPU runs wrote into an output directory, so results of
several invocations (each bounded by the device's per-command limit) accumulate into one table.

- Agreement (issue 7): with one seed every implementation starts from the same weights and tokens, so its first-step
  loss and global LoRA-gradient norm must match the reference implementation's (``hf+peft``) of the same model,
  seq and batch (same gradient-checkpointing setting preferred; checkpointing does not change the math) within bf16
  tolerance: |x - ref| <= rtol * |ref| with loss rtol 1e-2, grad-norm rtol 3e-2. Otherwise the row is flagged.
- Ratios: tokens/s and peak GiB of each implementation over ``hf+peft``'s for the same (model, layers, seq, batch,
  gc); max context over ``hf+peft``'s longest fitting length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BASELINE = "hf+peft"
IMPL_ORDER = ("hf+peft", "hf+peft+liger", "leantune")
LOSS_RTOL, GRAD_RTOL = 1e-2, 3e-2


# ------------------------------------------------------------------------------------------------------------ input
def load_results(out: Path) -> tuple[list[dict], list[dict]]:
    """(e2e run rows, max-context rows) from every ``*.json`` in ``out`` and its subfolders (ceilings and probe
    scratch skipped); max-context results of the same model and implementation from several invocations are merged
    (:func:`merge_max_context`)."""
    runs, maxctx = [], []
    for path in sorted(Path(out).rglob("*.json")):
        if path.name in ("ceilings.json", "probe.json") or path.name.startswith("ops"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or "impl" not in data:
            continue
        (maxctx if data.get("kind") == "max_context" else runs).append(data)
    return sort_rows(runs), sorted(merge_max_context(maxctx), key=lambda r: (r["model"], _impl_rank(r["impl"])))


def merge_max_context(results: list[dict]) -> list[dict]:
    """One result per (model, layers, impl): the probes of every invocation pooled (each call of the device is
    time-bounded, so one bisection may span several). best = the longest length that fit, first_fail = the shortest
    that ran out of memory (probes that neither fit nor failed, e.g. timeouts, decide nothing); complete when they
    are one step apart (the smallest step among the merged runs) or when a single run says so. Raises ValueError
    when the pooled probes contradict each other (a length fits that is longer than one that failed)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r.get("layers"), r["impl"]), []).append(r)
    merged = []
    for (model, _layers, impl), group in groups.items():
        if len(group) == 1:
            merged.append(group[0])
            continue
        probes = sorted({(int(s), ok) for r in group for s, ok in r["probes"]}, key=lambda p: p[0])
        fit = [s for s, ok in probes if ok is True]
        fail = [s for s, ok in probes if ok is False]
        best, first_fail = max(fit, default=None), min(fail, default=None)
        if best is not None and first_fail is not None and best >= first_fail:
            raise ValueError(f"max-context results of {model} {impl} contradict each other: {best} fits but "
                             f"{first_fail} does not")
        step = min(r["step"] for r in group)
        complete = best is not None and first_fail is not None and first_fail - best <= step
        merged.append({**group[0], "lo": min(r["lo"] for r in group), "hi": max(r["hi"] for r in group),
                       "step": step, "best": best, "first_fail": first_fail, "complete": complete,
                       "probes": [[s, ok] for s, ok in probes], "merged_from": len(group),
                       "probe_details": [d for r in group for d in r.get("probe_details", [])]})
    return merged


def _impl_rank(impl: str) -> int:
    return IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER)


def config_key(row: dict) -> tuple:
    """What makes two rows the same workload: model, layer override, seq, batch, gradient checkpointing."""
    return (row["model"], row.get("layers"), row["seq"], row["batch"], bool(row["gc"]))


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["model"], r.get("layers") or 0, r["seq"], r["batch"], not r["gc"],
                                       _impl_rank(r["impl"])))


# -------------------------------------------------------------------------------------------------------- agreement
def rel_diff(value: float | None, reference: float | None) -> float:
    """|value - reference| / |reference| (NaN when either is missing or not finite; |diff| when reference is 0)."""
    if value is None or reference is None or not math.isfinite(value) or not math.isfinite(reference):
        return math.nan
    return abs(value - reference) / abs(reference) if reference else abs(value - reference)


def flag_agreement(rows: list[dict], *, reference: str = BASELINE, loss_rtol: float = LOSS_RTOL,
                   grad_rtol: float = GRAD_RTOL) -> list[dict]:
    """Set ``row["agreement"]`` on every ok row: "reference", "ok", "no reference" or "FLAG: <what>" (a NaN
    difference, e.g. a non-finite loss, is flagged). Returns ``rows`` (modified in place)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    for row in rows:
        if row.get("status") != "ok":
            row["agreement"] = None
            continue
        if row["impl"] == reference:
            row["agreement"] = "reference"
            continue
        same = [r for r in ok if r["impl"] == reference and config_key(r)[:4] == config_key(row)[:4]]
        same.sort(key=lambda r: r["gc"] != row["gc"])  # prefer the same checkpointing setting
        if not same:
            row["agreement"] = "no reference"
            continue
        ref = same[0]
        d_loss, d_grad = rel_diff(row["first_loss"], ref["first_loss"]), rel_diff(row["grad_norm"], ref["grad_norm"])
        row["loss_rel_diff"], row["grad_norm_rel_diff"] = d_loss, d_grad
        problems = []
        if not d_loss <= loss_rtol:  # NaN fails too
            problems.append(f"loss rel {d_loss:.2e} > {loss_rtol:g}")
        if not d_grad <= grad_rtol:
            problems.append(f"grad-norm rel {d_grad:.2e} > {grad_rtol:g}")
        row["agreement"] = "FLAG: " + "; ".join(problems) if problems else "ok"
    return rows


# ----------------------------------------------------------------------------------------------------------- ratios
def ratio(value: float | None, baseline: float | None) -> float:
    """value / baseline; NaN when either is missing, not finite, or the baseline is 0."""
    if value is None or baseline is None or not math.isfinite(value) or not math.isfinite(baseline) or not baseline:
        return math.nan
    return value / baseline


def compare(rows: list[dict], *, baseline: str = BASELINE) -> list[dict]:
    """One dict per ok non-baseline row with a baseline of the same workload: tokens/s, peak and peak-minus-frozen
    ratios (implementation / baseline)."""
    base = {config_key(r): r for r in rows if r["impl"] == baseline and r.get("status") == "ok"}
    out = []
    for r in rows:
        b = base.get(config_key(r))
        if r["impl"] == baseline or r.get("status") != "ok" or b is None:
            continue
        out.append({"name": r["name"], "impl": r["impl"], "key": config_key(r),
                    "tokens_per_s": ratio(r.get("tokens_per_s"), b.get("tokens_per_s")),
                    "peak_gib": ratio(r.get("peak_gib"), b.get("peak_gib")),
                    "peak_minus_frozen_gib": ratio(r.get("peak_minus_frozen_gib"), b.get("peak_minus_frozen_gib"))})
    return out


def compare_max_context(maxctx: list[dict], *, baseline: str = BASELINE) -> dict[tuple, float]:
    """{(model, layers, impl): best / baseline's best} for every implementation with a baseline of the same model."""
    base = {(r["model"], r.get("layers")): r.get("best") for r in maxctx if r["impl"] == baseline}
    return {(r["model"], r.get("layers"), r["impl"]): ratio(r.get("best"), base.get((r["model"], r.get("layers"))))
            for r in maxctx if (r["model"], r.get("layers")) in base}


def format_compare(rows: list[dict], maxctx: list[dict], *, baseline: str = BASELINE) -> str:
    lines = [f"ratios vs {baseline} (same model, seq, batch, gradient checkpointing):"]
    for c in compare(rows, baseline=baseline):
        lines.append(f"  {c['name']}: tokens/s x{c['tokens_per_s']:.2f}, peak GiB x{c['peak_gib']:.2f}, "
                     f"peak - frozen x{c['peak_minus_frozen_gib']:.2f}")
    for (model, layers, impl), x in compare_max_context(maxctx, baseline=baseline).items():
        if impl != baseline:
            lines.append(f"  max context {model}{f' L{layers}' if layers else ''} {impl}: x{x:.2f}")
    if len(lines) == 1:
        lines.append("  (nothing to compare: no implementation has a baseline run of the same workload)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------- markdown
def _num(x, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pct(fraction) -> str:
    return "—" if fraction is None or not math.isfinite(fraction) else f"{100 * fraction:.1f}%"


def _workload(r: dict) -> str:
    layers = f" ({r['layers']} layers)" if r.get("layers") else ""
    return f"{r['model']}{layers}"


def markdown(rows: list[dict], maxctx: list[dict] | None = None, *, baseline: str = BASELINE) -> str:
    """results.md: a header (date, GPU, versions, ceiling), the e2e table and the max-context table."""
    maxctx = maxctx or []
    ratios = {(c["key"], c["impl"]): c for c in compare(rows, baseline=baseline)}
    lines = []
    first = next((r for r in rows if r.get("status") == "ok"), None)
    if first is not None:
        v = first.get("versions", {})
        rate = first.get("matmul_flop_per_s")
        lines += [f"{first.get('date', '?')}, {first.get('gpu', '?')}, "
                  + ", ".join(f"{k} {val}" for k, val in v.items())
                  + f". bf16 matmul ceiling {_num(rate and rate / 1e12, '.0f')} TFLOP/s (8192^3, measured in the "
                    "same invocation). MFU = tokens/s * (4P + 3A) / ceiling; HFU adds the checkpointing recompute "
                    "(2P_layers + A).", ""]
    if rows:
        lines += ["| model | seq x batch | GC | impl | tokens/s | x HF | peak GiB | peak - frozen GiB | MFU | HFU "
                  "| step ms | first loss | LoRA grad norm | agreement |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {_workload(r)} | {r['seq']} x {r['batch']} | {'on' if r['gc'] else 'off'} | {r['impl']} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}: {str(r.get('error', ''))[:80].replace('|', '/')} "
                         "| | | | | | | | | |")
            continue
        c = ratios.get((config_key(r), r["impl"]))
        lines.append(
            f"{head} {_num(r['tokens_per_s'], '.0f')} | {_num(c and c['tokens_per_s'], '.2f')} | "
            f"{_num(r.get('peak_gib'), '.2f')} | {_num(r.get('peak_minus_frozen_gib'), '.2f')} | "
            f"{_pct(r.get('mfu'))} | {_pct(r.get('hfu'))} | "
            f"{_num(r.get('median_step_ms'), '.0f')} | {_num(r['first_loss'], '.4f')} | "
            f"{_num(r['grad_norm'], '.4g')} | {r.get('agreement') or ''} |")
    if maxctx:
        mx = compare_max_context(maxctx, baseline=baseline)
        lines += ["", "Max context (batch 1, gradient checkpointing on; bisection, one process per probe):", "",
                  "| model | impl | longest fitting seq | first not fitting | x HF | probes (seq: fits) |",
                  "|---|---|---|---|---|---|"]
        for r in maxctx:
            probes = ", ".join(f"{s}: {'y' if ok else ('n' if ok is False else '?')}" for s, ok in r["probes"])
            best = _num(r.get("best"), "d") + ("" if r.get("complete") else " (incomplete)")
            if r.get("best") is not None and r.get("first_fail") is None and r.get("complete"):
                best += f" (= --hi {r['hi']}: all fit)"
            lines.append(f"| {_workload(r)} | {r['impl']} | {best} | {_num(r.get('first_fail'), 'd')} | "
                         f"{_num(mx.get((r['model'], r.get('layers'), r['impl'])), '.2f')} | {probes} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------ plots
def plot(rows: list[dict], out: Path) -> list[Path]:
    """tokens_per_s.png and peak_gib.png: bars grouped by workload, one colour per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    keys = list(dict.fromkeys(config_key(r) for r in ok))
    impls = sorted({r["impl"] for r in ok}, key=_impl_rank)
    labels = [f"{m}{f' L{layers}' if layers else ''}\n{s}x{b} GC {'on' if gc else 'off'}"
              for m, layers, s, b, gc in keys]
    paths = []
    for field, title, name in (("tokens_per_s", "tokens/s (higher is better)", "tokens_per_s.png"),
                               ("peak_gib", "peak GiB (lower is better)", "peak_gib.png")):
        fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(keys)), 4.0))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            by_key = {config_key(r): r.get(field) for r in ok if r["impl"] == impl}
            values = [by_key.get(k) if by_key.get(k) is not None else math.nan for k in keys]
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in range(len(keys))], values, width, label=impl)
        ax.set_xticks(range(len(keys)), labels, fontsize=8)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        path = Path(out) / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_max_context(maxctx: list[dict], out: Path) -> Path | None:
    """max_context.png: longest fitting sequence per implementation (thousands of tokens), one group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [r for r in maxctx if r.get("best")]
    if not found:
        return None
    fig, ax = plt.subplots(figsize=(6.0, 3.5))
    labels = [f"{_workload(r)}\n{r['impl']}" for r in found]
    bars = ax.bar(range(len(found)), [r["best"] / 1024 for r in found], 0.6)
    ax.bar_label(bars, [f"{r['best']:,}" for r in found], fontsize=8)
    ax.set_xticks(range(len(found)), labels, fontsize=8)
    ax.set_ylabel("tokens / 1024")
    ax.set_title("longest fitting sequence, batch 1, GC on (higher is better)")
    fig.tight_layout()
    path = Path(out) / "max_context.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(out: Path, *, compare_ratios: bool = False, log=print) -> str:
    """Load every result in ``out``, flag agreement, write results.md and the PNGs; returns the markdown."""
    rows, maxctx = load_results(out)
    flag_agreement(rows)
    text = markdown(rows, maxctx)
    (Path(out) / "results.md").write_text(text)
    log(text)
    try:
        plot(rows, out)
        plot_max_context(maxctx, out)
    except ImportError as exc:  # the GPU machine may lack matplotlib: `leantune bench report` redraws anywhere
        log(f"PNG charts skipped ({exc}); run `leantune bench report --out {out}` where matplotlib is installed")
    if compare_ratios:
        log(format_compare(rows, maxctx))
    return text
