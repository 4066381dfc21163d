"""The audit report: a few PNG plots and one HTML page that links them (``out/report.html``).

Written by the driver from small, already aggregated rows (per subject-hour, per hour,
a bounded number of example problems), so its cost does not grow with the data.

Plots:

* ``status.png``   - how many scheduled messages ended in each status (log scale);
* ``lateness.png`` - p50 / p99 / max lateness per UTC hour over all subjects;
* ``heatmap.png``  - p99 lateness per subject (rows, busiest first) and hour (columns);
* ``problems.png`` - lost / duplicated / delivered after cancel / late per subject.
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from pathlib import Path

SUBJECTS_SHOWN_MAX = 20
PROBLEM_KINDS = ("lost", "duplicated", "delivered_after_cancel", "late")
COLORS = {"delivered": "#4c9a2a", "duplicated": "#e6a100", "lost": "#c0392b", "delivered_after_cancel": "#8e44ad",
          "cancelled": "#7f8c8d", "pending": "#2980b9", "late": "#d35400"}


def _hour_label(h) -> str:
    if h is None:
        return "?"
    if isinstance(h, datetime):
        return h.astimezone(timezone.utc).strftime("%m-%d %H:00") if h.tzinfo else h.strftime("%m-%d %H:00")
    return str(h)


def _plots(out: Path, summary: dict, lateness: list[dict], hourly: list[dict]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []

    # status bars
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(summary["status"])
    vals = [summary["status"][n] for n in names]
    bars = ax.barh(names, [max(v, 0) for v in vals], color=[COLORS.get(n, "#555") for n in names])
    ax.set_xscale("symlog")
    for b, v in zip(bars, vals):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:,}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"{summary['scheduled']:,} scheduled messages by outcome")
    fig.tight_layout()
    fig.savefig(out / "status.png", dpi=110)
    plt.close(fig)
    made.append(("status.png", "Outcome of every scheduled message"))

    # lateness over time
    rows = [r for r in hourly if r.get("p50_ms") is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        x = list(range(len(rows)))
        for key, label, style in (("p50_ms", "p50", "-"), ("p99_ms", "p99", "--"), ("max_ms", "max", ":")):
            ax.plot(x, [max(r[key], 0) for r in rows], style, marker="o", markersize=3, label=label)
        ax.set_yscale("symlog")
        ax.set_ylabel("lateness (ms)")
        step = max(1, len(rows) // 12)
        ax.set_xticks(x[::step], [_hour_label(r["hour"]) for r in rows][::step], rotation=30, fontsize=7)
        ax.legend(fontsize=8)
        ax.set_title("Lateness per UTC hour of due time (all subjects)")
        fig.tight_layout()
        fig.savefig(out / "lateness.png", dpi=110)
        plt.close(fig)
        made.append(("lateness.png", "Lateness percentiles per hour"))

    # heatmap subject x hour of p99
    volume: dict[str, int] = {}
    for r in lateness:
        volume[r["subject"]] = volume.get(r["subject"], 0) + (r["delivered"] or 0)
    subjects = sorted(volume, key=lambda s: -volume[s])[:SUBJECTS_SHOWN_MAX]
    hours = sorted({r["hour"] for r in lateness if r["hour"] is not None})
    if subjects and hours:
        import numpy as np

        grid = np.full((len(subjects), len(hours)), np.nan)
        si = {s: i for i, s in enumerate(subjects)}
        hi = {h: i for i, h in enumerate(hours)}
        for r in lateness:
            if r["subject"] in si and r["hour"] in hi and r.get("p99_ms") is not None:
                grid[si[r["subject"]], hi[r["hour"]]] = max(r["p99_ms"], 0)
        fig, ax = plt.subplots(figsize=(min(14, 3 + 0.5 * len(hours)), 1.2 + 0.32 * len(subjects)))
        im = ax.imshow(np.log10(grid + 1), aspect="auto", cmap="magma_r")
        ax.set_yticks(range(len(subjects)), subjects, fontsize=7)
        step = max(1, len(hours) // 12)
        ax.set_xticks(range(len(hours))[::step], [_hour_label(h) for h in hours][::step], rotation=30, fontsize=7)
        cb = fig.colorbar(im, ax=ax)
        cb.set_label("log10(p99 lateness ms + 1)", fontsize=7)
        ax.set_title("p99 lateness per subject and hour (blank: nothing delivered)")
        fig.tight_layout()
        fig.savefig(out / "heatmap.png", dpi=110)
        plt.close(fig)
        made.append(("heatmap.png", "p99 lateness per subject and hour"))

    # problems per subject
    per: dict[str, dict[str, int]] = {}
    for r in lateness:
        d = per.setdefault(r["subject"], {k: 0 for k in PROBLEM_KINDS})
        for k in PROBLEM_KINDS:
            d[k] += r.get(k) or 0
    bad = sorted((s for s in per if sum(per[s].values())), key=lambda s: -sum(per[s].values()))[:SUBJECTS_SHOWN_MAX]
    if bad:
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * len(bad)))
        left = [0] * len(bad)
        for k in PROBLEM_KINDS:
            vals = [per[s][k] for s in bad]
            ax.barh(bad, vals, left=left, color=COLORS[k], label=k)
            left = [a + b for a, b in zip(left, vals)]
        ax.invert_yaxis()
        ax.legend(fontsize=7)
        ax.set_title("Problems per subject")
        fig.tight_layout()
        fig.savefig(out / "problems.png", dpi=110)
        plt.close(fig)
        made.append(("problems.png", "Problems per subject"))
    return made


def _table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def verdict(summary: dict) -> str:
    st = summary["status"]
    issues = [f"{st[k]:,} {k.replace('_', ' ')}" for k in ("lost", "duplicated", "delivered_after_cancel") if st[k]]
    if summary.get("corrupt_records"):
        issues.append(f"{summary['corrupt_records']:,} torn/corrupt records")
    return "PROBLEMS: " + ", ".join(issues) if issues else "OK: nothing lost, duplicated or delivered after cancel"


def write_report(out: Path, summary: dict, lateness: list[dict], hourly: list[dict], examples: dict,
                 corrupt: list[dict]) -> Path:
    """Write the PNGs and ``report.html``; return the HTML path."""
    plots = _plots(out, summary, lateness, hourly)
    st = summary["status"]
    cards = "".join(f"<div class='card' style='border-color:{COLORS.get(k, '#555')}'><b>{v:,}</b><br>"
                    f"{html.escape(k.replace('_', ' '))}</div>" for k, v in list(st.items()) + [("late", summary["late"])])
    imgs = "".join(f"<figure><img src='{p}' alt='{html.escape(t)}'><figcaption>{html.escape(t)}</figcaption></figure>"
                   for p, t in plots)
    cols = ["subject", "id", "nodes", "seq", "due_ms", "received", "dispatched", "lateness_ms", "reason"]
    sections = "".join(f"<h3>{html.escape(k.replace('_', ' '))} (first {len(examples.get(k, []))})</h3>"
                       + _table(examples.get(k, []), cols) for k in PROBLEM_KINDS)
    worst = [dict(r, hour=_hour_label(r["hour"])) for r in
             sorted((r for r in lateness if r.get("p99_ms") is not None), key=lambda r: -r["p99_ms"])[:10]]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Hourglass audit</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} .card{{display:inline-block;border-left:6px solid;
padding:.4em 1em;margin:.2em;background:#f6f6f6}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}} figure{{display:inline-block;margin:.5em}} .v{{font-size:1.3em}}</style>
</head><body><h1>Hourglass delivery audit</h1>
<p class="v"><b>{html.escape(verdict(summary))}</b></p>
<p>{summary['records_read']:,} log records read in {summary['seconds']} s; as of
{datetime.fromtimestamp(summary['as_of_ms'] / 1000, timezone.utc).isoformat()} (grace {summary['grace_ms']} ms,
late above {summary['late_ms']} ms); {summary['received_not_scheduled']:,} received messages were never
scheduled on a delay node (immediate sends).</p>
{cards}
<h2>Plots</h2>{imgs}
<h2>Worst subject-hours by p99 lateness</h2>
{_table(worst, ["subject", "hour", "delivered", "p50_ms", "p99_ms", "max_ms", "lost", "duplicated", "late"])}
<h2>Problems</h2>{sections}
<h2>Torn or corrupt records (first {len(corrupt)})</h2>
{_table(corrupt, ["node", "log", "segment", "offset", "error"])}
<h2>Summary</h2><pre>{html.escape(json.dumps(summary, indent=2, sort_keys=True, default=str))}</pre>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
