"""The audit report: four figures and one HTML page (``out/report.html``).

Written by the driver from small, already aggregated rows (per subject-hour, per hour,
a bounded number of example problems), so its cost does not grow with the data.

Figures (``figures`` builds them as matplotlib objects, ``write_report`` saves them):

* ``status.png``   - messages per outcome, one bar each (delivered, duplicated, lost,
  delivered after cancel, cancelled, pending) and ``late`` and ``early`` (parts of the
  delivered ones, hatched, each its own colour), the count printed at every bar; log axis,
  ticks as 1 / 10 / 1k / 1M;
* ``lateness.png`` - p50 / p99 / max lateness per UTC hour of the due time (lines, or
  grouped bars with their values when there are at most ``BARS_HOURS_MAX`` hours),
  the ``--late-ms`` threshold as a dashed line; log axis in ms / s / min;
* ``heatmap.png``  - p99 lateness per subject (rows, busiest first) and hour; each cell says
  all it holds (``cell_lines``: its p99, then "3 lost", "1 early", "4 pending", "1 cancelled")
  and a cell with a loss is framed in blue; blank means nothing was due; the late threshold
  is a bold tick of its own on the colour bar ("1.0 s: late above");
* ``problems.png`` - two panels per subject: failures (lost, duplicated, delivered after
  cancel, stacked) and, apart, late deliveries, each bar with its count; an empty panel is
  one sentence ("No delivery was later than 1.0 s.").

The verdict (``verdict``) is "OK" only when nothing failed, nothing was early and no record
was damaged; damaged records name their segment files, and an input with no good record at
all is "PROBLEMS: no log yields a good record".

Tables show UTC times ("2026-11-23 11:00:05.120Z"), lateness in ms / s ("120.0 s"), "-"
for no value, and problems worst first (the longest lateness first; ``audit.run`` orders
them).
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from pathlib import Path

SUBJECTS_SHOWN_MAX = 20
HOURS_SHOWN_MAX = 48            # heatmap columns (the latest hours)
BARS_HOURS_MAX = 3              # lateness as grouped bars up to this many hours, lines above
CELL_TEXT_HOURS_MAX = 24        # heatmap values printed in cells up to this many hour columns
FAILURE_KINDS = ("lost", "duplicated", "delivered_after_cancel")
PROBLEM_KINDS = FAILURE_KINDS + ("late",)
OUTCOMES = ("delivered", "duplicated", "lost", "delivered_after_cancel", "cancelled", "pending")
COLORS = {"delivered": "#4c9a2a", "duplicated": "#e6a100", "lost": "#c0392b", "delivered_after_cancel": "#8e44ad",
          "cancelled": "#7f8c8d", "pending": "#2980b9", "late": "#d35400", "early": "#17a2b8"}
PARTS = ("late", "early")  # parts of the delivered: hatched bars, their own colour
DPI = 110
LOSS_EDGE = "#1a4f9c"   # heatmap frame of a cell with a loss: stands out on every colour of the map


def label(kind: str) -> str:
    return kind.replace("_", " ")


# ---------------------------------------------------------------------- text formats


def utc(ms) -> str:
    """Epoch ms as a UTC time people read; "-" for none."""
    if ms is None:
        return "-"
    t = datetime.fromtimestamp(ms / 1000, timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def duration(ms) -> str:
    """A lateness: "850 ms", "12.3 s", "4.1 min", "2.0 h"; "-" for none."""
    if ms is None:
        return "-"
    a = abs(ms)
    if a < 1000:
        return f"{ms:,.0f} ms"
    if a < 60_000:
        return f"{ms / 1000:.1f} s"
    if a < 3_600_000:
        return f"{ms / 60_000:.1f} min"
    return f"{ms / 3_600_000:.1f} h"


def count(n) -> str:
    """Tick text for a count: 1, 10, 100, 1k, 10k, 1M."""
    if n is None or n <= 0:
        return "0"
    for unit, div in (("M", 1_000_000), ("k", 1_000)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n:.0f}"


def hour_label(h) -> str:
    if h is None:
        return "?"
    if isinstance(h, datetime):
        h = h.astimezone(timezone.utc) if h.tzinfo else h
        return h.strftime("%m-%d %H:00")
    return str(h)


# ---------------------------------------------------------------------- figures


def _status_figure(plt, summary: dict):
    from matplotlib.ticker import FuncFormatter, LogLocator

    names = list(OUTCOMES) + list(PARTS)
    vals = [summary["status"].get(n, 0) for n in OUTCOMES] + [summary.get(p, 0) for p in PARTS]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    top = max(vals + [1])
    bars = ax.barh([label(n) for n in names], [v if v > 0 else 0 for v in vals],
                   color=[COLORS[n] for n in names], left=0.8)
    for b in bars[len(OUTCOMES):]:
        b.set_hatch("//")
        b.set_alpha(0.75)
    ax.set_xscale("log")
    ax.set_xlim(0.8, top * 30)  # room for the count printed after the longest bar
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: count(x)))
    for b, v in zip(bars, vals):
        ax.text(max(b.get_width() + 0.8, 0.9) * 1.15, b.get_y() + b.get_height() / 2, f"{v:,}", va="center",
                fontsize=9, fontweight="bold" if v else None)
    ax.invert_yaxis()
    ax.set_xlabel("messages (log scale)")
    ax.set_ylabel("outcome")
    ax.set_title(f"{summary['scheduled']:,} scheduled messages by outcome (late, early: parts of delivered)",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _ms_axis(ax, lo: float, hi: float) -> None:
    """A log lateness axis from ``lo`` to ``hi`` ms with ticks in ms / s / min."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ticks = [t for t in (1, 10, 100, 1e3, 1e4, 6e4, 6e5, 3.6e6, 3.6e7, 8.64e7) if lo <= t <= hi]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: duration(v).replace(".0 ", " ")))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _lateness_figure(plt, hourly: list[dict], late_ms: int):
    rows = [r for r in hourly if r.get("p50_ms") is not None]
    if not rows:
        return None
    series = (("p50_ms", "p50", "#2e86c1", "o", "-"), ("p99_ms", "p99", "#d35400", "s", "--"),
              ("max_ms", "max", "#6c3483", "^", ":"))
    floor = 1.0  # a log axis: lateness <= 1 ms is drawn at 1 ms
    vals = [max(r[k] or 0, floor) for r in rows for k, *_ in series] + [max(late_ms, floor)]
    lo, hi = floor * 0.8, max(vals) * 3
    labels = [hour_label(r["hour"]) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    if len(rows) <= BARS_HOURS_MAX:  # a line through one point is a dot: grouped bars with values
        width = 0.8 / len(series)
        for k, (key, name, color, _, _) in enumerate(series):
            xs = [i + (k - 1) * width for i in range(len(rows))]
            ys = [max(r[key] or 0, floor) for r in rows]
            ax.bar(xs, ys, width, color=color, label=name, bottom=0)
            for x, r in zip(xs, rows):
                ax.text(x, max(r[key] or 0, floor) * 1.15, duration(r[key]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_xlim(-0.6, len(rows) - 0.4)
    else:
        x = list(range(len(rows)))
        for key, name, color, marker, style in series:
            ax.plot(x, [max(r[key] or 0, floor) for r in rows], style, color=color, marker=marker, markersize=4,
                    label=name, linewidth=1.6 if name != "max" else 1.0)
        step = max(1, len(rows) // 12)
        ax.set_xticks(x[::step], labels[::step], rotation=30, ha="right", fontsize=8)
    ax.axhline(max(late_ms, floor), color="#c0392b", linestyle="--", linewidth=1.2,
               label=f"late above {duration(late_ms)}")
    _ms_axis(ax, lo, hi)
    ax.set_xlabel("hour of due time (UTC)")
    ax.set_ylabel("lateness (log scale)")
    ax.set_title("Lateness of delivered messages per hour (all subjects)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def _busiest(lateness: list[dict]) -> list[str]:
    volume: dict[str, int] = {}
    for r in lateness:
        volume[r["subject"]] = volume.get(r["subject"], 0) + sum(r.get(k) or 0 for k in (
            "delivered", "lost", "pending", "cancelled", "delivered_after_cancel"))
    return sorted(volume, key=lambda s: (-volume[s], s))[:SUBJECTS_SHOWN_MAX]


def _heatmap_figure(plt, lateness: list[dict], late_ms: int):
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter

    subjects = _busiest(lateness)
    hours = sorted({r["hour"] for r in lateness if r["hour"] is not None})[-HOURS_SHOWN_MAX:]
    if not subjects or not hours:
        return None
    si = {s: i for i, s in enumerate(subjects)}
    hi = {h: i for i, h in enumerate(hours)}
    grid = np.full((len(subjects), len(hours)), np.nan)
    cells: dict[tuple[int, int], dict] = {}
    for r in lateness:
        if r["subject"] in si and r["hour"] in hi:
            ij = (si[r["subject"]], hi[r["hour"]])
            cells[ij] = r
            if r.get("p99_ms") is not None:
                grid[ij] = max(r["p99_ms"], 1)
    finite = grid[np.isfinite(grid)]
    vmax = max(float(finite.max()) * 1.2 if finite.size else 1.0, late_ms * 1.2, 10.0)
    vmin = max(1.0, min(float(finite.min()) / 3 if finite.size else 1.0, late_ms / 3))
    show_text = len(hours) <= CELL_TEXT_HOURS_MAX
    texts = {ij: cell_lines(r) for ij, r in cells.items()} if show_text else {}
    lines_max = max((len(t) for t in texts.values()), default=1)
    width = min(16.0, max(8.0, 3.5 + 0.9 * len(hours)))
    fig, ax = plt.subplots(figsize=(width, 1.6 + (0.3 + 0.13 * lines_max) * len(subjects)))
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="YlOrRd", norm=LogNorm(vmin=vmin, vmax=vmax))
    ax.set_facecolor("white")
    ax.set_yticks(range(len(subjects)), subjects, fontsize=8)
    step = max(1, len(hours) // 16)
    ax.set_xticks(range(len(hours))[::step], [hour_label(h) for h in hours][::step], rotation=30, ha="right",
                  fontsize=8)
    for (i, j), r in cells.items():
        lost = r.get("lost") or 0
        if lost:
            ax.add_patch(Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, edgecolor=LOSS_EDGE, linewidth=2.5))
        if (i, j) not in texts:
            continue
        v = r.get("p99_ms")
        dark = v is not None and math.log(max(v, vmin) / vmin) > 0.6 * math.log(vmax / vmin)
        lines = texts[(i, j)]
        # the value in the cell's ink; what was not delivered in red when something was lost
        ax.text(j, i, "\n".join(lines), ha="center", va="center", fontsize=7 if len(lines) <= 2 else 6,
                color="white" if dark else "#c0392b" if lost and v is None else "black",
                fontweight="bold" if lost else None, linespacing=1.1)
    cb = fig.colorbar(im, ax=ax)
    threshold = max(late_ms, 1)
    # the threshold is a tick of its own ("1 s = late"); round ticks too close to it are left out
    ticks = [m * 10 ** e for e in range(0, 9) for m in (1, 2, 5) if vmin <= m * 10 ** e <= vmax
             and not 1 / 1.6 < m * 10 ** e / threshold < 1.6]
    ticks = sorted(ticks + ([threshold] if vmin <= threshold <= vmax else []))
    cb.set_ticks(ticks if len(ticks) >= 2 else [vmin, vmax])
    cb.ax.yaxis.set_major_formatter(FuncFormatter(
        lambda v, _: f"{duration(v)}: late above" if v == threshold else duration(v)))
    for t in cb.ax.get_yticklabels():
        if t.get_text().endswith("late above"):
            t.set_fontweight("bold")
    cb.ax.tick_params(labelsize=9)
    cb.ax.minorticks_off()
    cb.set_label("p99 lateness (log scale)", fontsize=10)
    cb.ax.axhline(threshold, color="black", linewidth=3)
    cb.ax.axhline(threshold, color="white", linewidth=1.2, linestyle="--")
    ax.set_xlabel("hour of due time (UTC)")
    ax.set_ylabel("subject (busiest first)")
    ax.set_title("p99 lateness per subject and hour\n(blue frame: a message lost; blank: nothing due)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def cell_lines(r: dict) -> list[str]:
    """What a heatmap cell says: its p99 when something was delivered, then every other count
    it holds (``["120 ms", "2 lost", "3 pending"]``); ``["-"]`` when it holds nothing."""
    lines = [duration(r["p99_ms"])] if r.get("p99_ms") is not None else []
    for k, word in (("lost", "lost"), ("early", "early"), ("pending", "pending"), ("cancelled", "cancelled"),
                    ("delivered_after_cancel", "after cancel")):
        if r.get(k):
            lines.append(f"{r[k]:,} {word}")
    return lines or ["-"]


def _problems_figure(plt, lateness: list[dict], late_ms: int):
    per: dict[str, dict[str, int]] = {}
    for r in lateness:
        d = per.setdefault(r["subject"], {k: 0 for k in PROBLEM_KINDS})
        for k in PROBLEM_KINDS:
            d[k] += r.get(k) or 0
    bad = [s for s in per if sum(per[s].values())]
    if not bad:
        return None
    failing = sorted((s for s in bad if any(per[s][k] for k in FAILURE_KINDS)),
                     key=lambda s: (-sum(per[s][k] for k in FAILURE_KINDS), s))[:SUBJECTS_SHOWN_MAX]
    late = sorted((s for s in bad if per[s]["late"]), key=lambda s: (-per[s]["late"], s))[:SUBJECTS_SHOWN_MAX]
    rows = max(len(failing), len(late), 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 1.8 + 0.45 * rows))
    if failing:  # one stacked bar per subject, its total at the end: a single loss is a visible bar
        top = max(sum(per[s][k] for k in FAILURE_KINDS) for s in failing)
        start = [0] * len(failing)
        for kind in FAILURE_KINDS:
            vals = [per[s][kind] for s in failing]
            left.barh(range(len(failing)), vals, 0.6, left=start, color=COLORS[kind], label=label(kind))
            start = [a + v for a, v in zip(start, vals)]
        for i, total in enumerate(start):
            left.text(total + top * 0.02, i, f"{total:,}", va="center", fontsize=8)
        left.set_yticks(range(len(failing)), failing, fontsize=8)
        left.set_xlim(0, top * 1.8 + 1)  # the legend sits in the room on the right
        left.legend(fontsize=8, loc="lower right")
    else:
        left.set_yticks([])
        left.text(0.5, 0.5, "Nothing was lost, duplicated\nor delivered after its cancel.", ha="center",
                  va="center", transform=left.transAxes, fontsize=10, color="#4c9a2a")
    left.invert_yaxis()
    left.xaxis.get_major_locator().set_params(integer=True)
    left.set_xlabel("messages")
    left.set_ylabel("subject")
    left.set_title("Failures per subject", fontsize=10)
    if late:
        top = max(per[s]["late"] for s in late)
        right.barh(range(len(late)), [per[s]["late"] for s in late], 0.6, color=COLORS["late"])
        for i, s in enumerate(late):
            right.text(per[s]["late"] + top * 0.02, i, f"{per[s]['late']:,}", va="center", fontsize=8)
        right.set_yticks(range(len(late)), late, fontsize=8)
        right.set_xlim(0, top * 1.25 + 1)
    else:
        right.set_yticks([])
        right.text(0.5, 0.5, f"No delivery was later\nthan {duration(late_ms)}.", ha="center", va="center",
                   transform=right.transAxes, fontsize=10, color="#4c9a2a")
    right.invert_yaxis()
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set_xlabel("late deliveries")
    right.set_ylabel("subject")
    right.set_title("Late deliveries per subject", fontsize=10)
    fig.tight_layout()
    return fig


def figures(summary: dict, lateness: list[dict], hourly: list[dict]) -> dict[str, object]:
    """The report's figures (matplotlib ``Figure`` s) by file name; a figure with nothing to show
    is left out. The caller closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = {"status.png": _status_figure(plt, summary),
            "lateness.png": _lateness_figure(plt, hourly, summary["late_ms"]),
            "heatmap.png": _heatmap_figure(plt, lateness, summary["late_ms"]),
            "problems.png": _problems_figure(plt, lateness, summary["late_ms"])}
    return {k: v for k, v in made.items() if v is not None}


CAPTIONS = {"status.png": "Outcome of every scheduled message",
            "lateness.png": "Lateness percentiles per hour, with the late threshold",
            "heatmap.png": "p99 lateness per subject and hour",
            "problems.png": "Failures and late deliveries per subject"}


# ---------------------------------------------------------------------- page


def _cell(col: str, v) -> str:
    if v is None:
        return "-"
    if col.endswith("_ms") and col in ("due_ms", "first_received_ms", "accepted_ms", "cancelled_ms"):
        return utc(v)
    if col.endswith("_ms"):
        return duration(v)
    if col == "hour":
        return hour_label(v)
    if isinstance(v, int) and not isinstance(v, bool) and col not in ("seq", "offset"):
        return f"{v:,}"
    return str(v)


HEADINGS = {"due_ms": "due (UTC)", "first_received_ms": "received (UTC)", "lateness_ms": "lateness",
            "early_ms": "early by",
            "p50_ms": "p50", "p99_ms": "p99", "max_ms": "max", "hour": "hour (UTC)"}


def _table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    head = "".join(f"<th>{html.escape(HEADINGS.get(c, c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c, r.get(c)))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


VERDICT_FILES_MAX = 3   # corrupt segment files named in the verdict line (all are in the report)


def corrupt_text(summary: dict) -> str:
    """``"12 torn/corrupt records in /d/delay-1/messages/0.log, ... (+2 more files)"``."""
    files = [f["segment"] for f in summary.get("corrupt_files") or []]
    where = ""
    if files:
        more = len(files) - VERDICT_FILES_MAX
        where = " in " + ", ".join(files[:VERDICT_FILES_MAX]) + (f" (+{more} more files)" if more > 0 else "")
    return f"{summary['corrupt_records']:,} torn/corrupt records{where}"


def verdict(summary: dict) -> str:
    """The report's first line: ``OK: ...`` only when records were read, nothing failed and no
    record was damaged; a folder of random bytes is ``PROBLEMS: no log yields a good record``."""
    if summary.get("no_good_record"):
        return "PROBLEMS: no log yields a good record: " + corrupt_text(summary)
    st = summary["status"]
    issues = [f"{st[k]:,} {label(k)}" for k in FAILURE_KINDS if st[k]]
    if summary.get("early"):
        issues.append(f"{summary['early']:,} delivered early")
    if summary.get("corrupt_records"):
        issues.append(corrupt_text(summary))
    return "PROBLEMS: " + ", ".join(issues) if issues else "OK: nothing lost, duplicated or delivered after cancel"


def _problem_sections(summary: dict, examples: dict) -> str:
    totals = dict(summary["status"], late=summary.get("late", 0), early=summary.get("early", 0))
    cols = ["subject", "id", "nodes", "due_ms", "first_received_ms", "lateness_ms", "received", "dispatched",
            "reason"]
    early_cols = [c if c != "lateness_ms" else "early_ms" for c in cols]
    out = []
    for k in PROBLEM_KINDS + ("early",):
        shown, total = len(examples.get(k, [])), totals.get(k, 0)
        if not total:
            out.append(f"<h3>{html.escape(label(k))}: none</h3>")
            continue
        note = "all shown" if shown >= total else f"first {shown} shown"
        order = ", worst first" if k in ("late", "early") else ""
        out.append(f"<h3>{html.escape(label(k))}: {total:,} ({note}{order})</h3>"
                   + _table(examples.get(k, []), early_cols if k == "early" else cols))
    return "".join(out)


def write_report(out: Path, summary: dict, lateness: list[dict], hourly: list[dict], examples: dict,
                 corrupt: list[dict]) -> Path:
    """Write the PNGs and ``report.html``; return the HTML path."""
    import matplotlib.pyplot as plt

    made = figures(summary, lateness, hourly)
    for name, fig in made.items():
        fig.savefig(out / name, dpi=DPI)
        plt.close(fig)
    st = summary["status"]
    cards = "".join(f"<div class='card' style='border-color:{COLORS.get(k, '#555')}'><b>{v:,}</b><br>"
                    f"{html.escape(label(k))}</div>" for k, v in list(st.items()) + [(p, summary.get(p, 0)) for p in PARTS])
    imgs = "".join(f"<figure><img src='{p}' alt='{html.escape(CAPTIONS[p])}'>"
                   f"<figcaption>{html.escape(CAPTIONS[p])}</figcaption></figure>" for p in made)
    worst = sorted((r for r in lateness if r.get("p99_ms") is not None), key=lambda r: -r["p99_ms"])[:10]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Hourglass audit</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} .card{{display:inline-block;border-left:6px solid;
padding:.4em 1em;margin:.2em;background:#f6f6f6}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}} th{{background:#f0f0f0}} figure{{margin:.8em 0}}
img{{max-width:100%}} .v{{font-size:1.3em}}</style>
</head><body><h1>Hourglass delivery audit</h1>
<p class="v"><b>{html.escape(verdict(summary))}</b></p>
<p>{summary['records_read']:,} log records read in {summary['seconds']} s; as of
{html.escape(utc(summary['as_of_ms']))} (grace {duration(summary['grace_ms'])},
late above {duration(summary['late_ms'])}); {summary['received_not_scheduled']:,} received messages were never
scheduled on a delay node (immediate sends).</p>
{cards}
<h2>Plots</h2>{imgs}
<h2>Worst subject-hours by p99 lateness</h2>
{_table(worst, ["subject", "hour", "delivered", "p50_ms", "p99_ms", "max_ms", "lost", "duplicated", "late", "early"])}
<h2>Problems</h2>{_problem_sections(summary, examples)}
<h2>Torn or corrupt records ({summary.get('corrupt_records', 0):,}; first {len(corrupt)} shown)</h2>
{_table(corrupt, ["node", "log", "segment", "offset", "frame_bytes", "error"])}
<h2>Summary</h2><pre>{html.escape(json.dumps(summary, indent=2, sort_keys=True, default=str))}</pre>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
