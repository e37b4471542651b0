"""The HTML report's plots: matplotlib figures written as inline SVG.

matplotlib is imported inside the functions that draw, so `import fpdoctor` and the text, JSON
and markdown renderers never load it. Each view takes the data a report already holds and
returns SVG markup, or None when that data is absent: a view without its data is not drawn.
Values may arrive as Python floats (`Report.to_dict()`) or as the strings "nan", "inf", "-inf"
(a report read back from its JSON); both are accepted.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from fpdoctor.formats import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE, UNDERFLOW_SHARE

# Text stays text (searchable, small) in a generic family: no font file is embedded or fetched.
_RC = {
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial"],
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 10,
    "axes.titlelocation": "left",
    "path.simplify": True,
}
# One colour per quantity across every view.
BLUE, ORANGE, RED, GREY, PURPLE, GREEN = "#1f77b4", "#e07b00", "#c62828", "#7f7f7f", "#6a3d9a", "#2e7d32"
MAX_ROWS = 60  # a per-module view taller than this is unreadable; the table and JSON keep every row
_LANE_BINS = 400  # an event is at least 1/400 of the axis wide (a step when fewer): visible, and bounded in size


def number(value: Any) -> float | None:
    """A float from a report value: floats and ints, and the JSON spellings of non-finite numbers."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def to_svg(fig: Any, key: str) -> str:
    """The figure as an `<svg>` element to inline in HTML. `key` makes its ids unique in the page:
    several figures in one document must not share a marker or clip-path id."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": key}):  # the same report gives the same page, byte for byte
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight", pad_inches=0.05)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)
    ref = re.compile(r'(xlink:href="#|href="#|url\(#)([^")]+)')
    referenced = {m.group(2) for m in ref.finditer(text)}

    def _id(match: re.Match[str]) -> str:
        name = match.group(1)
        return f' id="{key}-{name}"' if name in referenced else ""  # unreferenced group ids would repeat per figure

    text = re.sub(r' id="([^"]+)"', _id, text)
    text = ref.sub(lambda m: f"{m.group(1)}{key}-{m.group(2)}", text)
    return text.replace("<svg ", f'<svg role="img" aria-label="{key}" ', 1).strip()


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _rc() -> contextlib.AbstractContextManager[None]:
    import matplotlib

    # typed with every rc key as a literal; ours are checked by matplotlib when set
    return matplotlib.rc_context(cast(Any, _RC))  # the caller's own settings come back afterwards


def _runs(steps: Iterable[float], width: float) -> list[tuple[float, float]]:
    """Event steps as (start, length) bars `width` wide, neighbours merged into one bar."""
    runs: list[list[float]] = []
    for s in sorted(steps):
        if runs and s - width / 2 <= runs[-1][0] + runs[-1][1]:
            runs[-1][1] = s + width / 2 - runs[-1][0]
        else:
            runs.append([s - width / 2, width])
    return [(a, b) for a, b in runs]


def timeline(data: Mapping[str, Any], key: str = "timeline") -> str | None:
    """The sentinel's timeline: loss per step above, one lane per event kind below."""
    steps = [number(s) for s in data.get("step") or []]
    losses = [number(v) for v in data.get("loss") or []]
    if not steps or len(steps) != len(losses) or any(s is None for s in steps):
        return None
    lanes = [
        ("non-finite", data.get("nonfinite") or [], RED),
        ("AMP skipped", data.get("amp_skipped") or [], PURPLE),
        ("loss spike", data.get("spikes") or [], ORANGE),
    ]
    xs = [float(s) for s in steps if s is not None]
    events = [float(s) for _, values, _ in lanes for s in values if number(s) is not None]
    lo, hi = min(xs + events), max(xs + events)
    span = max(hi - lo, 1.0)
    finite = [v if v is not None and math.isfinite(v) else math.nan for v in losses]
    shown = [v for v in finite if not math.isnan(v)]
    norm_steps = [number(s) for s in data.get("grad_norm_step") or []]
    norms = [number(v) for v in data.get("grad_norm") or []]
    scales = [number(v) for v in data.get("scale") or []]
    has_norm = bool(norms) and len(norms) == len(norm_steps) and None not in norm_steps
    has_scale = len(scales) == len(steps) and any(v is not None for v in scales)
    middle_panel = has_norm or has_scale
    with _rc():
        fig = _figure(10, 5.6 if middle_panel else 4.2)
        if middle_panel:
            top, middle, bottom = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 1])
        else:
            top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
        top.plot(xs, finite, color=BLUE, linewidth=1.0, label="loss")
        if shown and min(shown) > 0:
            top.set_yscale("log")
        spikes = {float(s) for s in data.get("spikes") or [] if number(s) is not None}
        marked = [(x, v) for x, v in zip(xs, finite, strict=True) if x in spikes and not math.isnan(v)]
        if marked:
            top.plot(*zip(*marked, strict=True), "o", color=ORANGE, markersize=5, label="spike")
        top.set_ylabel("loss")
        top.set_title("Loss per step; a gap is a non-finite loss" if len(shown) < len(finite) else "Loss per step")
        if marked:
            top.legend(loc="upper right", frameon=False)
        top.grid(True, alpha=0.3)
        if middle_panel:
            _norm_and_scale(middle, norm_steps if has_norm else [], norms, xs if has_scale else [], scales)
        width = max(span / _LANE_BINS, 1.0)
        labels = []
        for row, (label, values, color) in enumerate(reversed(lanes)):
            points = [float(v) for v in values if number(v) is not None]
            bars = _runs(points, width)
            if bars:
                bottom.broken_barh(bars, (row - 0.35, 0.7), facecolors=color)
            labels.append(f"{label} ({len(points)})")
        bottom.set_yticks(range(len(lanes)), labels)
        bottom.set_ylim(-0.6, len(lanes) - 0.4)
        bottom.set_xlim(lo - span * 0.01, hi + span * 0.01)
        bottom.set_xlabel("step")
        bottom.spines["left"].set_visible(False)
        bottom.tick_params(axis="y", length=0)
        bottom.grid(True, axis="x", alpha=0.3)
        return to_svg(fig, key)


def _norm_and_scale(
    ax: Any, norm_steps: list[float | None], norms: list[float | None], xs: list[float], scales: list[float | None]
) -> None:
    """The gradient norm where the sentinel took it, and GradScaler's loss scale on its own axis;
    a non-finite norm (a skipped overflow step) is a gap."""
    if norm_steps:
        values = [v if v is not None and math.isfinite(v) else math.nan for v in norms]
        ax.plot([float(s) for s in norm_steps if s is not None], values, ".-", color=GREEN, linewidth=0.8,
                markersize=3, label="gradient norm")  # fmt: skip
        if any(v > 0 for v in values if not math.isnan(v)):
            ax.set_yscale("log")
        ax.set_ylabel("gradient norm")
    twin = ax
    if xs:
        twin = ax.twinx() if norm_steps else ax
        shown = [(x, v) for x, v in zip(xs, scales, strict=True) if v is not None and math.isfinite(v) and v > 0]
        if shown:
            twin.step(*zip(*shown, strict=True), where="post", color=PURPLE, linewidth=1.0, label="loss scale")
            twin.set_yscale("log", base=2)
            twin.set_ylabel("loss scale")
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + (twin.get_legend_handles_labels()[0] if xs and twin is not ax else [])
    if handles:
        ax.legend(handles=handles, loc="upper right", frameon=False)


def _pick(rows: Sequence[Mapping[str, Any]], score: list[float], keep_last: bool = False) -> list[int]:
    """Indexes of the rows to draw, in model order: all of them, or the MAX_ROWS that score highest."""
    if len(rows) <= MAX_ROWS:
        return list(range(len(rows)))
    best = sorted(range(len(rows)), key=lambda k: -score[k])[: MAX_ROWS - int(keep_last)]
    return sorted({*best, *([len(rows) - 1] if keep_last else [])})


_OVERFLOW = (("fp16", "fp16 max"), ("bf16", "bf16 max"), ("fp8_e4m3", "e4m3 max"), ("fp8_e5m2", "e5m2 max"))
_UNDERFLOW = (
    ("fp16_flush", "fp16 flush"),
    ("fp16_subnormal", "fp16 subnormal"),
    ("bf16_flush", "bf16 flush"),
    ("fp8_e4m3_scaled_flush", "e4m3 flush*"),
    ("fp8_e5m2_scaled_flush", "e5m2 flush*"),
)


def range_heatmap(rows: Sequence[Mapping[str, Any]], key: str = "range-heatmap") -> str | None:
    """Per module: its largest magnitude as a share of each format's max (left) and the share of
    its non-zero values that would flush to zero in each format (right)."""
    rows = [r for r in rows if isinstance(r, Mapping) and number(r.get("absmax")) is not None and "module" in r]
    if not rows:
        return None
    under = [(k, label) for k, label in _UNDERFLOW if any(number(r.get(k)) is not None for r in rows)]
    absmax = [number(r["absmax"]) or 0.0 for r in rows]
    over = [[a / FORMATS[fmt].max for fmt, _ in _OVERFLOW] for a in absmax]
    flush = [[number(r.get(k)) or 0.0 for k, _ in under] for r in rows]
    score = [max(o[0] / OVERFLOW_SHARE, *(f / UNDERFLOW_SHARE for f in fl)) for o, fl in zip(over, flush, strict=True)]
    picked = _pick(rows, score)
    names = [f"{rows[k]['module']}  ({_short_dtype(rows[k].get('dtype'))})" for k in picked]
    from matplotlib.colors import Normalize

    with _rc():
        fig = _figure(10, 1.3 + 0.24 * len(picked))
        left, right = fig.subplots(1, 2, width_ratios=[len(_OVERFLOW), max(1, len(under))], sharey=True)
        # log10(absmax / max): 0 is the format's limit; below a thousandth of it the cell stays pale
        grid = [[math.log10(v) if v > 0 else -3.0 for v in over[k]] for k in picked]
        mesh = left.pcolormesh(grid, cmap=_steps("YlOrRd"), norm=Normalize(-3, 0), edgecolors="white", linewidth=0.5)
        for i, k in enumerate(picked):
            for j, v in enumerate(over[k]):
                left.text(j + 0.5, i + 0.5, _share_text(v, over_limit=True), ha="center", va="center", fontsize=7,
                          color="white" if v >= 0.1 else "black")  # fmt: skip
        _colorbar(fig, mesh, left, "log10(absmax / format max)")
        left.set_xticks([j + 0.5 for j in range(len(_OVERFLOW))], [label for _, label in _OVERFLOW])
        left.set_yticks([i + 0.5 for i in range(len(picked))], names)
        left.set_title("largest magnitude / format max")
        if under:
            # share of non-zero values below the flush threshold: a thousandth of them to all of them
            cells = [[math.log10(v) if v > 0 else -3.0 for v in flush[k]] for k in picked]
            mesh = right.pcolormesh(
                cells, cmap=_steps("Blues"), norm=Normalize(-3, 0), edgecolors="white", linewidth=0.5
            )
            for i, k in enumerate(picked):
                for j, v in enumerate(flush[k]):
                    if v > 0:
                        right.text(j + 0.5, i + 0.5, f"{v:.1%}" if v >= 0.001 else "<0.1%", ha="center",
                                   va="center", fontsize=7, color="white" if v >= 0.1 else "black")  # fmt: skip
            _colorbar(fig, mesh, right, "log10(share flushed to zero)")
            right.set_xticks([j + 0.5 for j in range(len(under))], [label for _, label in under])
            right.set_title("non-zero values that flush to zero (* after tensorwise scaling)")
        else:
            right.set_axis_off()
        left.invert_yaxis()  # model order, top to bottom (the axes share y: once for both)
        if len(picked) < len(rows):
            fig.suptitle(f"the {len(picked)} of {len(rows)} modules closest to a limit, in model order (JSON has all)",
                         x=0.0, ha="left", fontsize=9, color=GREY)  # fmt: skip
        for ax in (left, right):
            ax.tick_params(axis="x", labelrotation=30, length=0)
            ax.tick_params(axis="y", length=0)
            for side in ("left", "bottom"):
                ax.spines[side].set_visible(False)
        return to_svg(fig, key)


def _steps(name: str) -> Any:
    """A colour map of 24 steps: plenty for a heatmap read with its numbers, and a colour bar that
    stays a few vector rectangles (matplotlib embeds one of 50 steps or more as a PNG)."""
    import matplotlib

    return matplotlib.colormaps[name].resampled(24)


def _colorbar(fig: Any, mesh: Any, ax: Any, label: str) -> None:
    bar = fig.colorbar(mesh, ax=ax, location="bottom", shrink=0.8, label=label)
    bar.solids.set_edgecolor("face")  # no hairline seams between its steps


def _short_dtype(dtype: Any) -> str:
    return DTYPE_FORMAT.get(str(dtype), str(dtype).replace("torch.", "")) if dtype else "?"


def _share_text(value: float, over_limit: bool = False) -> str:
    if over_limit and value > 1:
        return "over"
    if value == 0:
        return "0"
    return f"{value:.0%}" if value >= 0.01 else f"{value:.0e}"


# Column names of the precision profile: the numeric records first, the rendered table's columns second.
_PROFILE_KEYS = {
    "propagated": ("propagated_sqnr_db", "propagated_rel"),
    "isolated": ("isolated_sqnr_db", "isolated_rel"),
    "floor": ("floor_sqnr_db", "floor_rel"),
}


def _db(record: Mapping[str, Any], which: str) -> float | None:
    db_key, rel_key = _PROFILE_KEYS[which]
    if (value := number(record.get(db_key))) is not None:
        return value
    rel = number(record.get(rel_key))
    if rel is None or math.isnan(rel):
        return None
    return math.inf if rel == 0 else -math.inf if math.isinf(rel) else -20.0 * math.log10(rel)


def profile_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The precision profile as {module, propagated, isolated, floor (dB), diverged}, from the
    numeric per-module records when the report has them, else parsed from its rendered table."""
    out = []
    modules = data.get("modules")
    if isinstance(modules, list) and modules and all(isinstance(m, Mapping) for m in modules):
        for m in modules:
            values = {w: _db(m, w) for w in _PROFILE_KEYS}
            if values["propagated"] is None and values["isolated"] is None:
                continue
            name = str(m.get("module", "?")) + (f" #{m['call']}" if m.get("call") else "")
            ratio = number(m.get("ratio"))
            out.append({"module": name, **values, "diverged": bool(m.get("diverged")), "ratio": ratio})
        return out
    table = data.get("table")
    if not isinstance(table, Mapping):
        return []
    columns = [str(c).lower() for c in table.get("columns") or []]
    index = {w: next((k for k, c in enumerate(columns) if c.startswith(w)), None) for w in _PROFILE_KEYS}
    if index["floor"] is None or (index["propagated"] is None and index["isolated"] is None):
        return []
    for row in table.get("rows") or []:
        cells = [str(c) for c in row]
        values = {w: _cell_db(cells, k) for w, k in index.items()}
        ratio_cell = next((c for c in cells if c.endswith(" diverges")), None)
        out.append({"module": cells[0], **values, "diverged": ratio_cell is not None, "ratio": None})
    return out


def _cell_db(cells: list[str], k: int | None) -> float | None:
    if k is None or k >= len(cells):
        return None
    text = cells[k].strip()
    if text == "non-finite":
        return -math.inf
    try:
        return float(text)
    except ValueError:
        return None


def precision_profile(
    rows: Sequence[Mapping[str, Any]],
    *,
    divergence_ratio: float | None = None,
    kept: Iterable[str] = (),
    key: str = "precision-profile",
) -> str | None:
    """SQNR against fp64 per module, in model order: propagated and isolated error beside the
    noise floor; a module whose isolated error sits far below its floor diverges."""
    if not rows:
        return None
    score = [math.inf if r["diverged"] else (number(r.get("ratio")) or 0.0) for r in rows]
    picked = _pick(rows, score, keep_last=True)
    kept = set(kept)
    finite = [v for k in picked for w in _PROFILE_KEYS if (v := rows[k][w]) is not None and math.isfinite(v)]
    if not finite:
        return None
    drop = 20 * math.log10(divergence_ratio) if divergence_ratio and divergence_ratio > 1 else None
    if drop is not None:  # the divergence line must show: isolated error left of it diverges
        finite += [v - drop for k in picked if (v := rows[k]["floor"]) is not None and math.isfinite(v)]
    lo, hi = min(finite) - 3, max(finite) + 3
    gap = max(3.0, 0.08 * (hi - lo))
    # Two extra columns beside the dB scale: a non-finite output (SQNR -inf) and an exact one (+inf).
    present = {v for k in picked for w in ("propagated", "isolated") if (v := rows[k][w]) is not None and math.isinf(v)}
    special = {v: x for v, x in ((-math.inf, lo - gap), (math.inf, hi + gap)) if v in present}
    from matplotlib.ticker import MaxNLocator

    with _rc():
        fig = _figure(10, 1.4 + 0.24 * len(picked))
        ax = fig.subplots()
        ys = list(range(len(picked)))

        def series(which: str) -> list[float]:
            values = [rows[k][which] for k in picked]
            return [v if v is not None and math.isfinite(v) else math.nan for v in values]

        def off_scale(which: str) -> list[tuple[float, int]]:
            values = [rows[k][which] for k in picked]
            return [(special[v], y) for v, y in zip(values, ys, strict=True) if v is not None and math.isinf(v)]

        floor = series("floor")
        ax.plot(floor, ys, color=GREY, linestyle="--", marker="|", markersize=8, label="noise floor")
        if drop is not None:
            limit = [v - drop for v in floor]
            ax.plot(limit, ys, color=GREY, linestyle=":", linewidth=0.8,
                    label=f"divergence line ({divergence_ratio:g}x the floor's error)")  # fmt: skip
        ax.plot(series("propagated"), ys, color=BLUE, marker="o", markersize=4, label="propagated (as the model runs)")
        ax.plot(series("isolated"), ys, color=ORANGE, linestyle="none", marker="D", markersize=4,
                label="isolated (fp64 inputs)")  # fmt: skip
        for which, color in (("propagated", BLUE), ("isolated", ORANGE)):
            if points := off_scale(which):
                ax.plot(*zip(*points, strict=True), linestyle="none", marker="X", markersize=7, color=color)
        isolated = [special.get(v, v) if v is not None else math.nan for v in (rows[k]["isolated"] for k in picked)]
        bad = [(v, y) for v, y, k in zip(isolated, ys, picked, strict=True) if rows[k]["diverged"]]
        if bad:
            ax.plot(*zip(*bad, strict=True), linestyle="none", marker="o", markersize=11, markerfacecolor="none",
                    markeredgecolor=RED, label="diverges")  # fmt: skip
        names = [rows[k]["module"] + ("  [fp32]" if rows[k]["module"].split(" #")[0] in kept else "") for k in picked]
        ax.set_yticks(ys, names)
        for label, k in zip(ax.get_yticklabels(), picked, strict=True):
            if rows[k]["diverged"]:
                label.set_color(RED)
        ax.set_ylim(len(picked) - 0.5, -0.5)  # model order, top to bottom
        ticks = [t for t in MaxNLocator(nbins=8).tick_values(lo, hi) if lo <= t <= hi]
        names_of = {-math.inf: "non-finite", math.inf: "exact"}
        ax.set_xticks([*ticks, *special.values()], [f"{t:g}" for t in ticks] + [names_of[v] for v in special])
        for v in special:
            ax.axvline(lo - gap / 2 if v < 0 else hi + gap / 2, color=GREY, linewidth=0.6)
        ax.set_xlim(lo - 1.5 * gap if -math.inf in special else lo, hi + 1.5 * gap if math.inf in special else hi)
        ax.set_xlabel("SQNR against fp64, dB (higher is better)")
        title = "Precision profile per module"
        if len(picked) < len(rows):
            title += f": the {len(picked)} of {len(rows)} with the largest isolated error / floor"
        ax.set_title(title)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        return to_svg(fig, key)


_EQUAL, _DIFFER, _UNKNOWN = 2, 1, 0


def fingerprint_matrix(rows: Sequence[Mapping[str, Any]], key: str = "fingerprints") -> str | None:
    """Device x device: green where two devices' GEMM digests are bit-equal, red where they differ,
    grey where they cannot be compared (another fingerprint group, or no digest); on the diagonal,
    whether a device's own repeats agreed."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    if sum(1 for r in rows if r.get("digests")) < 2:
        return None
    rows = rows[:MAX_ROWS]
    hosts = {r.get("host") for r in rows}

    def label(r: Mapping[str, Any]) -> str:
        text = " ".join(str(x) for x in (r.get("index"), r.get("name") or r.get("device")) if x not in (None, ""))
        if r.get("rank") is not None:
            text = f"rank {r['rank']}: {text}"
        return f"{r.get('host')} {text}" if len(hosts) > 1 else text

    def cell(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
        if a is b:
            consistent = a.get("self_consistent")
            return _UNKNOWN if consistent is None else _EQUAL if consistent else _DIFFER
        da, db = a.get("digests") or {}, b.get("digests") or {}
        common = set(da) & set(db)
        if not common or a.get("group") != b.get("group"):
            return _UNKNOWN
        return _EQUAL if all(da[d] == db[d] for d in common) else _DIFFER

    from matplotlib.colors import ListedColormap

    grid = [[cell(a, b) for b in rows] for a in rows]
    n = len(rows)
    names = [_clip(label(r), 48) for r in rows]
    # The figure is sized for its labels (9 pt: about 0.075 in a character; the x labels slant at
    # 45 degrees) and the title wrapped to its width: with few devices and long names a fixed size
    # leaves the grid no room and matplotlib gives up on the layout (with a warning).
    chars = max(len(x) for x in names)
    width = min(12.0, max(4.0, 1.0 + 0.075 * chars + 0.35 * n))
    title = "GEMM fingerprints: green bit-equal, red different, grey not comparable; diagonal: own repeats"
    with _rc():
        fig = _figure(width, 1.9 + 0.3 * n + 0.055 * chars)
        ax = fig.subplots()
        ax.pcolormesh(grid, cmap=ListedColormap(["#d9d9d9", "#e57373", "#81c784"]), vmin=0, vmax=2,
                      edgecolors="white", linewidth=1)  # fmt: skip
        ax.set_xticks([i + 0.5 for i in range(n)], names, rotation=45, ha="right")
        ax.set_yticks([i + 0.5 for i in range(n)], names)
        for tick, r in zip(ax.get_yticklabels(), rows, strict=True):
            if r.get("verdict") not in (None, "ok", "not comparable"):
                tick.set_color(RED)
        ax.invert_yaxis()
        ax.set_title(textwrap.fill(title, int(width * 9)))
        ax.tick_params(length=0)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_aspect("equal")
        return to_svg(fig, key)


def input_ranges(evidence: Mapping[str, Any], key: str = "input-ranges") -> str | None:
    """The first bad op's inputs: the magnitude range each held, against its dtype's max."""
    inputs = [i for i in evidence.get("inputs") or [] if isinstance(i, Mapping)]
    bars = []
    for i in inputs:
        lo, hi = number(i.get("min")), number(i.get("max"))
        if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
            continue
        bars.append((str(i.get("from") or "input"), max(abs(lo), abs(hi)), DTYPE_FORMAT.get(str(i.get("dtype")))))
    limits = {fmt for *_, fmt in bars if fmt in FORMATS and fmt != "fp32"}
    if not bars or not limits:
        return None
    finite = [m for _, m, _ in bars if math.isfinite(m) and m > 0]
    top = max([*finite, *(FORMATS[f].max for f in limits)]) * 30
    with _rc():
        fig = _figure(8, 0.9 + 0.35 * len(bars))
        ax = fig.subplots()
        for y, (_, magnitude, _) in enumerate(bars):
            width = top if not math.isfinite(magnitude) else max(magnitude, 1e-30)
            ax.barh(y, width, color=RED if not math.isfinite(magnitude) else BLUE, height=0.5)
            ax.text(width, y, "  inf" if not math.isfinite(magnitude) else f"  {magnitude:.4g}", va="center",
                    fontsize=8)  # fmt: skip
        for fmt in sorted(limits):
            ax.axvline(FORMATS[fmt].max, color=RED, linestyle="--", linewidth=1)
            ax.text(FORMATS[fmt].max, len(bars) - 0.45, f" {fmt} max {FORMATS[fmt].max:g}", color=RED, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(min([*finite, 1.0]) / 10, top * 10)
        ax.set_yticks(range(len(bars)), [_clip(name, 60) for name, *_ in bars])
        ax.set_ylim(len(bars) - 0.3, -0.6)
        ax.set_xlabel("largest input magnitude (log scale)")
        return to_svg(fig, key)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
