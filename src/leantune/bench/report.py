"""Results of ``leantune bench e2e`` / ``max-context`` / ``ops``: agreement flags, ratios, markdown tables, PNG charts.

Works on any machine: it reads only the runs' JSON files in an output directory (several calls add to one table).

- Agreement: with one seed every implementation starts from the same weights and tokens, so its first-step
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

from ..errors import LeantuneError
from .build import split_tile
from .harness import GRAPH_MAX_MS, table_cell
from .stepstats import STEP_FIELDS, plot_steps, steps_markdown
from .stepstats import num_cell as _num

BASELINE = "hf+peft"
QLORA_BASELINE = "hf+peft+bnb"  # QLoRA rows agree with and compare to this one (quantised weights differ from bf16)
IMPL_ORDER = ("hf+peft", "hf+peft+liger", "hf+peft+batched_mm", "hf+peft+eager_experts", "leantune", "leantune+graph",
              "leantune+offload", "leantune+offload+tiled", "hf+peft+bnb", "leantune+nf4", "leantune+nf4+graph",
              "leantune+nf4+offload+tiled", "leantune+fp8", "leantune+fp8+graph", "leantune+nf4fp8",
              "leantune+nf4fp8+graph", "hf+peft+torchao", "hf+peft+torchao+compile")
LOSS_RTOL, GRAD_RTOL = 1e-2, 3e-2


# ------------------------------------------------------------------------------------------------------------ input
class ReportError(LeantuneError):
    """Results that cannot make a trustworthy table: unreadable, malformed, duplicated or contradicting files."""


NOT_RESULTS = ("ceilings.json", "probe.json")  # scratch files of the runs (older runs wrote probe.json unhidden)
E2E_FIELDS = {"impl": str, "model": str, "name": str, "seq": int, "batch": int, "gc": bool, "status": str}
OK_REQUIRED = ("tokens_per_s", "first_loss", "grad_norm")  # every ok run has them (may be NaN / null)
OK_NUMBERS = OK_REQUIRED + ("peak_gib", "peak_minus_frozen_gib", "mfu", "hfu") + STEP_FIELDS
MAXCTX_FIELDS = {"impl": str, "model": str, "lo": int, "hi": int, "step": int, "probes": list}
OPS_FIELDS = {"date": str, "gpu": str, "versions": dict, "ceilings": dict, "rows": list}
OPS_ROW_FIELDS = {"op": str, "shape": str, "impl": str}
OPS_ROW_NUMBERS = ("ms", "floor_ms", "extra_peak_gib", "saved_gib")


def _is_ops_result(data) -> bool:
    return isinstance(data, dict) and "rows" in data and "impl" not in data


def _check_fields(path: Path, data: dict, fields: dict) -> None:
    for name, kind in fields.items():
        if name not in data:
            raise ReportError(f"{path}: missing field {name!r} (expected a `leantune bench` result)")
        value = data[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ReportError(f"{path}: field {name!r} must be {kind.__name__}, got {value!r}")


def _check_number(path: Path, data: dict, name: str, what: str = "field") -> None:
    value = data.get(name)
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise ReportError(f"{path}: {what} {name!r} must be a number or null, got {value!r}")


def _validate(path: Path, data: dict) -> None:
    layers = data.get("layers")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        raise ReportError(f"{path}: field 'layers' must be a positive int or null, got {layers!r}")
    if data.get("kind") == "max_context":
        _check_fields(path, data, MAXCTX_FIELDS)
        if data["step"] <= 0:
            raise ReportError(f"{path}: field 'step' must be positive, got {data['step']}")
        for probe in data["probes"]:
            if not (isinstance(probe, list) and len(probe) == 2 and type(probe[0]) is int and probe[0] > 0
                    and (probe[1] is None or type(probe[1]) is bool)):
                raise ReportError(f"{path}: every probe must be [seq > 0, true | false | null], got {probe!r}")
        return
    _check_fields(path, data, E2E_FIELDS)
    if data["status"] == "ok":
        for name in OK_REQUIRED:
            if name not in data:
                raise ReportError(f"{path}: missing field {name!r} (every ok run records it)")
        for name in OK_NUMBERS:
            _check_number(path, data, name)


def load_results(out: Path, log=print) -> tuple[list[dict], list[dict]]:
    """(e2e run rows, max-context rows) from every ``*.json`` in ``out`` and its subfolders; max-context results of
    the same model and implementation from several invocations are pooled (:func:`merge_max_context`).

    Op results (``leantune bench ops``) are left to :func:`load_op_results`; other JSON files that are not results
    (ceilings) are skipped with a note through ``log``.
    Raises ReportError naming the file for unreadable or malformed results, and for two e2e results of the same
    workload and implementation (the table would silently pick one: keep one file)."""
    runs, maxctx, seen = [], [], {}
    for path in sorted(Path(out).rglob("*.json")):
        if path.name in NOT_RESULTS or _hidden(path, out):  # a child's scratch or partial result
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ReportError(f"{path}: not a readable JSON file ({exc})") from None
        if _is_ops_result(data):  # `leantune bench ops`: see load_op_results
            continue
        if not isinstance(data, dict) or "impl" not in data:
            log(f"skipped {path}: not a `leantune bench` result (no 'impl', no 'rows')")
            continue
        _validate(path, data)
        data = {**data, "source": str(path)}
        if data.get("kind") == "max_context":
            maxctx.append(data)
            continue
        key = (config_key(data), data["impl"])
        if key in seen:
            raise ReportError(f"two results for {data['name']}: {seen[key]} and {path}; keep one (or move one out "
                              f"of {out})")
        seen[key] = path
        runs.append(data)
    return sort_rows(runs), sorted(merge_max_context(maxctx), key=lambda r: (r["model"], _impl_rank(r["impl"])))


def _hidden(path: Path, out: Path) -> bool:
    """A file or folder under ``out`` whose name starts with a dot: scratch of a run, or kept out of the report."""
    return any(part.startswith(".") for part in path.relative_to(out).parts)


def load_op_results(out: Path) -> list[tuple[Path, dict]]:
    """``(path, result)`` of every ``leantune bench ops`` JSON in ``out`` and its subfolders: the merged ``ops.json``
    of a folder stands for the ``ops_NAME.json`` beside it (its parts). Raises ReportError naming a malformed one."""
    found = []
    for path in sorted(Path(out).rglob("*.json")):
        if _hidden(path, out) or path.name.startswith("ops_") and (path.parent / "ops.json").is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # load_results names unreadable files
        if not _is_ops_result(data):
            continue
        _check_fields(path, data, OPS_FIELDS)
        for row in data["rows"]:
            if not isinstance(row, dict):
                raise ReportError(f"{path}: every row must be an object, got {row!r}")
            _check_fields(path, row, OPS_ROW_FIELDS)
            for name in OPS_ROW_NUMBERS:
                if row.get(name) is None:
                    raise ReportError(f"{path}: row of {row['op']} / {row['impl']} lacks {name!r}")
            for name in OPS_ROW_NUMBERS + ("graph_ms",):  # graph_ms: absent in runs before the column existed
                _check_number(path, row, name, "row field")
        for key in ("copy_bytes_per_s", "matmul_flop_per_s"):
            if not isinstance(data["ceilings"].get(key), int | float):
                raise ReportError(f"{path}: ceilings.{key} must be a number")
        found.append((path, data))
    return found


def merge_max_context(results: list[dict]) -> list[dict]:
    """One result per (model, layers, memory cap, impl), recomputed from the probes of every invocation (each
    device call is time-bounded, so one bisection may span several): best = the longest length that fit,
    first_fail = the shortest that ran out of memory (probes that neither fit nor failed, e.g. timeouts, decide
    nothing). complete when the two are at most one step apart (the smallest step among the runs), or when every
    probed length in [lo, hi] fit up to hi, or the first failed at lo (the bracket's ends, rounded to the step).
    Raises ReportError when probes contradict each other (a length fits that is longer than one that failed),
    naming the files."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((*_context_key(r), r["impl"]), []).append(r)
    merged = []
    for (model, _layers, _cap, impl), group in groups.items():
        probes = sorted({(s, ok) for r in group for s, ok in r["probes"]}, key=lambda p: p[0])
        fit = [s for s, ok in probes if ok is True]
        fail = [s for s, ok in probes if ok is False]
        best, first_fail = max(fit, default=None), min(fail, default=None)
        if best is not None and first_fail is not None and best >= first_fail:
            files = ", ".join(r.get("source", "?") for r in group)
            raise ReportError(f"max-context results of {model} {impl} contradict each other: {best} fits but "
                              f"{first_fail} does not (in {files})")
        step = min(r["step"] for r in group)
        lo, hi = min(r["lo"] for r in group), max(r["hi"] for r in group)
        complete = ((best is not None and first_fail is not None and first_fail - best <= step)
                    or (first_fail is None and best is not None and best == hi // step * step)
                    or (best is None and first_fail is not None and first_fail == -(-lo // step) * step))
        merged.append({**group[0], "lo": lo, "hi": hi, "step": step, "best": best, "first_fail": first_fail,
                       "complete": complete, "probes": [[s, ok] for s, ok in probes], "merged_from": len(group),
                       "probe_details": [d for r in group for d in r.get("probe_details", [])]})
    return merged


def _impl_rank(impl: str) -> tuple[int, int]:
    base, tile = split_tile(impl)
    return (IMPL_ORDER.index(base) if base in IMPL_ORDER else len(IMPL_ORDER)), -(tile or 0)


def config_key(row: dict) -> tuple:
    """What makes two rows the same workload: model, layer override, seq, batch, gradient checkpointing, and the
    processes (engine x count) it ran on."""
    return (row["model"], row.get("layers"), row["seq"], row["batch"], bool(row["gc"]),
            row.get("distributed", "none"), row.get("nproc", 1), row.get("memory_cap_gib"))


def _context_key(row: dict) -> tuple:
    """What makes two max-context searches the same: model, layer override, and the memory cap they ran under."""
    return row["model"], row.get("layers"), row.get("memory_cap_gib")


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["model"], r.get("layers") or 0, r["seq"], r["batch"], not r["gc"],
                                       _impl_rank(r["impl"])))


# -------------------------------------------------------------------------------------------------------- agreement
def rel_diff(value: float | None, reference: float | None) -> float:
    """|value - reference| / |reference| (NaN when either is missing or not finite; |diff| when reference is 0)."""
    if value is None or reference is None or not math.isfinite(value) or not math.isfinite(reference):
        return math.nan
    return abs(value - reference) / abs(reference) if reference else abs(value - reference)


def _same_but_gc(a: dict, b: dict) -> bool:
    """The same workload on the same processes, whatever the checkpointing setting (it does not change the loss)."""
    ka, kb = config_key(a), config_key(b)
    return ka[:4] == kb[:4] and ka[5:] == kb[5:]


def flag_agreement(rows: list[dict], *, reference: str = BASELINE, loss_rtol: float = LOSS_RTOL,
                   grad_rtol: float = GRAD_RTOL) -> list[dict]:
    """Set ``row["agreement"]`` on every ok row: "reference", "ok", "no reference" or "FLAG: <what>" (a NaN
    difference, e.g. a non-finite loss, is flagged). NF4 rows are checked against ``hf+peft+bnb`` (the same
    quantised weights), the others against ``reference``. Returns ``rows`` (modified in place)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    for row in rows:
        if row.get("status") != "ok":
            row["agreement"] = None
            continue
        if row["impl"] in (reference, QLORA_BASELINE):
            row["agreement"] = "reference"
            continue
        ref_impl = QLORA_BASELINE if "nf4" in row["impl"] else reference
        same = [r for r in ok if r["impl"] == ref_impl and _same_but_gc(r, row)]
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
    """{(model, layers, memory cap, impl): best / baseline's best} for every implementation with a baseline of the
    same search (NF4 rows: hf+peft+bnb's when it ran)."""
    bases = {impl: {_context_key(r): r.get("best") for r in maxctx if r["impl"] == impl}
             for impl in (baseline, QLORA_BASELINE)}
    out = {}
    for r in maxctx:  # NF4 rows against the bitsandbytes QLoRA baseline when it ran, as in the e2e rows
        base = bases[QLORA_BASELINE] if "nf4" in r["impl"] and _context_key(r) in bases[QLORA_BASELINE] else (
            bases[baseline])
        if _context_key(r) in base:
            out[(*_context_key(r), r["impl"])] = ratio(r.get("best"), base[_context_key(r)])
    return out


def format_compare(rows: list[dict], maxctx: list[dict], *, baseline: str = BASELINE) -> str:
    lines = [f"ratios vs {baseline} (same model, seq, batch, gradient checkpointing):"]
    for c in compare(rows, baseline=baseline):
        lines.append(f"  {c['name']}: tokens/s x{_num(c['tokens_per_s'], '.2f')}, peak GiB "
                     f"x{_num(c['peak_gib'], '.2f')}, peak - frozen x{_num(c['peak_minus_frozen_gib'], '.2f')}")
    for c in compare(rows, baseline=QLORA_BASELINE):
        if "nf4" in c["impl"]:
            lines.append(f"  {c['name']} vs {QLORA_BASELINE}: tokens/s x{_num(c['tokens_per_s'], '.2f')}, peak GiB "
                         f"x{_num(c['peak_gib'], '.2f')}")
    for (model, layers, _cap, impl), x in compare_max_context(maxctx, baseline=baseline).items():
        if impl != baseline:
            lines.append(f"  max context {model}{f' L{layers}' if layers else ''} {impl}: x{_num(x, '.2f')}")
    if len(lines) == 1:
        lines.append("  (nothing to compare: no implementation has a baseline run of the same workload)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------- markdown
def _pct(fraction) -> str:
    return "—" if fraction is None or not math.isfinite(fraction) else f"{100 * fraction:.1f}%"


def _workload(r: dict) -> str:
    layers = f" ({r['layers']} layers)" if r.get("layers") else ""
    cap = f" ({r['memory_cap_gib']:g} GiB cap)" if r.get("memory_cap_gib") else ""
    return f"{r['model']}{layers}{cap}"


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
                  + f". bf16 matmul ceiling {_num(rate and rate / 1e12, '.0f')} TFLOP/s ("
                  + ("given by --matmul-tflops" if first.get("matmul_source") == "--matmul-tflops"
                     else "8192^3, measured in the same invocation")
                  + "). MFU = tokens/s * (4P + 3A) / ceiling; HFU adds the checkpointing recompute "
                    "(2P_layers + A).", ""]
    if rows:
        lines += ["| model | seq x batch | GC | impl | tokens/s | x HF | peak GiB | peak - frozen GiB | MFU | HFU "
                  "| step ms | first loss | LoRA grad norm | agreement |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        world = "" if r.get("distributed", "none") == "none" else f" x {r['nproc']} GPUs ({r['distributed']})"
        head = (f"| {_workload(r)} | {r['seq']} x {r['batch']}{world} | {'on' if r['gc'] else 'off'} | "
                f"{r['impl']} |")
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}: {table_cell(r.get('error', ''), 80)} | | | | | | | | | |")
            continue
        c = ratios.get((config_key(r), r["impl"]))
        lines.append(
            f"{head} {_num(r['tokens_per_s'], '.0f')} | {_num(c and c['tokens_per_s'], '.2f')} | "
            f"{_num(r.get('peak_gib'), '.2f')} | {_num(r.get('peak_minus_frozen_gib'), '.2f')} | "
            f"{_pct(r.get('mfu'))} | {_pct(r.get('hfu'))} | "
            f"{_num(r.get('median_step_ms'), '.0f')} | {_num(r['first_loss'], '.4f')} | "
            f"{_num(r['grad_norm'], '.4g')} | {r.get('agreement') or ''} |")
    lines += steps_markdown(rows, config_key, baseline)
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
                         f"{_num(mx.get((*_context_key(r), r['impl'])), '.2f')} | {probes} |")
    return "\n".join(lines) + "\n"


def _rounds_note(rows: list[dict]) -> str:
    """The header's word on interleaved rounds, for runs that took them (older JSON has a single timing)."""
    counts = {len(r["ms_rounds"]) for r in rows if len(r.get("ms_rounds") or ()) > 1}
    if not counts:
        return ""
    return (f" fwd+bwd ms of the rows under {GRAPH_MAX_MS:.0f} ms: the median of {max(counts)} timings taken in "
            "turns over the implementations.")


def ops_markdown(result: dict) -> str:
    """ops.md: a header (date, GPU, versions, the run's ceilings) and one table row per (op, implementation): ms of
    fwd+bwd (harness), CUDA-graph ms ("—" when not captured), floor ms, % of the copy or matmul ceiling, extra peak
    and saved GiB; a failed row carries its error in the impl cell."""
    c = result["ceilings"]
    lines = [
        f"{result['date']}, {result['gpu']}, torch {result['versions']['torch']}, triton "
        f"{result['versions']['triton']}, transformers {result['versions']['transformers']}. Ceilings measured in "
        f"this run: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {c['matmul_flop_per_s'] / 1e12:.0f} "
        "TFLOP/s." + _rounds_note(result["rows"]),
        "",
        "| op | shape | impl | fwd+bwd ms | graph ms | floor ms | % of ceiling | extra peak GiB | saved GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pct = r.get("pct_copy_ceiling", r.get("pct_matmul_ceiling", math.nan))
        note = f" ({table_cell(r['error'])})" if r.get("error") else ""
        graph = r.get("graph_ms", math.nan)  # absent in runs before the column existed
        graph = "—" if graph is None or math.isnan(graph) else f"{graph:.3f}"
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']}{note} | {r['ms']:.3f} | {graph} | "
                     f"{r['floor_ms']:.3f} | {pct:.0f}% | {r['extra_peak_gib']:.3f} | {r['saved_gib']:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ plots
def plot(rows: list[dict], out: Path) -> list[Path]:
    """tokens_per_s.png, peak_gib.png: bars grouped by workload, one colour per implementation; step_ms.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    keys = list(dict.fromkeys(config_key(r) for r in ok))
    impls = sorted({r["impl"] for r in ok}, key=_impl_rank)
    labels = [f"{m}{f' L{layers}' if layers else ''}\n{s}x{b} GC {'on' if gc else 'off'}"
              + ("" if engine == "none" else f"\n{n} GPUs {engine}") + (f"\n{cap:g} GiB cap" if cap else "")
              for m, layers, s, b, gc, engine, n, cap in keys]
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
    return paths + [p for p in [plot_steps(ok, out)] if p]


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
    """Load every result in ``out``, flag agreement, write results.md and the PNGs; returns the markdown.

    Raises ReportError (nothing written) when ``out`` is not a directory, holds no results, or holds a malformed,
    duplicated or contradicting one (:func:`load_results`)."""
    out = Path(out)
    if not out.is_dir():
        raise ReportError(f"--out {out}: {'is a file, ' if out.exists() else 'does not exist; '}expected the directory "
                          "a `leantune bench` run wrote its results to")
    for name in ("results.md", "tokens_per_s.png", "peak_gib.png", "step_ms.png", "max_context.png"):
        if (out / name).is_dir():
            raise ReportError(f"{out / name} is a directory; the report writes a file of that name")
    rows, maxctx = load_results(out, log)
    op_results = load_op_results(out)
    if not rows and not maxctx and not op_results:
        raise ReportError(f"no benchmark results (*.json of `leantune bench e2e` / `max-context` / `ops`) in {out}; "
                          "nothing written")
    flag_agreement(rows)
    text = markdown(rows, maxctx) if rows or maxctx else ""
    for path, data in op_results:  # each op table rebuilt beside its JSON, and gathered in results.md
        table = ops_markdown(data)
        path.with_suffix(".md").write_text(table + "\n")
        text += f"\nOps (`{path.relative_to(out)}`):\n\n{table}\n"
    (out / "results.md").write_text(text)
    log(text)
    try:
        plot(rows, out)
        plot_max_context(maxctx, out)
    except ImportError as exc:  # the GPU machine may lack matplotlib: `leantune bench report` redraws anywhere
        log(f"PNG charts skipped ({exc}); run `leantune bench report --out {out}` where matplotlib is installed")
    if compare_ratios:
        log(format_compare(rows, maxctx))
    return text
