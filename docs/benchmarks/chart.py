#!/usr/bin/env python3
"""Draws bench-http's ratios (annotated ÷ bare) as an SVG bar chart, standard library only.

    python3 docs/benchmarks/chart.py docs/benchmarks/latest.json [MORE.json ...]
        [-o docs/benchmarks/ratios.svg] [--table-into BENCHMARKS.md] [--check]

Input: what `bench-http --json FILE` writes ("format": "bench-http 1"): a row per framework,
store, scenario and arm with its req/s and its ratio to the bare arm of the same table. Rows of
several files are drawn together (a Redis Cluster run is a second file, its store
`redis-cluster`); a store, framework, scenario and arm given twice is an error. A file may say
`"transcribed": "…"` and give each row a `"source"`: figures copied from BENCHMARKS.md's
history rather than written by a run; the chart and the table say so.

Output: two panels, first executions and replays; in each, a group of bars per store (a bar per
framework and annotated arm, its value written above it) against a dashed line at 1.0, the
bare handler. `--table-into FILE` also rewrites the Markdown table of the same ratios between
the lines `<!-- ratios:begin -->` and `<!-- ratios:end -->` of FILE. `--check` then reads the
SVG back and fails unless it holds one bar per drawn row, with that row's value.
"""

import argparse
import json
import math
import os
import sys
import textwrap
import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape

HERE = os.path.dirname(os.path.abspath(__file__))

STORES = [
    ("memory", "memory"),
    ("sqlite", "SQLite"),
    ("postgres", "PostgreSQL"),
    ("mysql", "MySQL / MariaDB"),
    ("redis", "Redis"),
    ("redis-cluster", "Redis Cluster"),
]
FRAMEWORKS = [("axum", "Axum"), ("actix", "Actix")]
ARMS = [("tx", "single commit"), ("plain", "plain mode")]
SCENARIOS = [
    ("first", "First executions (a new key each request)"),
    ("replay", "Replays (a finished key)"),
]
# (framework, arm) -> fill: Axum blue, Actix orange; single commit dark, plain mode light.
COLOURS = {
    ("axum", "tx"): "#1f5fa8",
    ("axum", "plain"): "#8db6e6",
    ("actix", "tx"): "#b8481a",
    ("actix", "plain"): "#f0b08a",
}

BAR, BAR_GAP, GROUP_GAP = 30, 4, 34
LEFT, RIGHT = 78, 64
MIN_WIDTH = 900
PANEL_H, PANEL_GAP = 230, 96


class Bad(Exception):
    """An input or output that is not what it should be."""


def load(paths):
    """The files' summaries and all their rows."""
    files, rows, seen = [], [], {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != "bench-http 1":
            raise Bad(f"{path}: not bench-http --json output (format {data.get('format')!r})")
        files.append(data)
        for row in data.get("rows", []):
            for field in ("framework", "store", "scenario", "arm", "ratio"):
                if field not in row:
                    raise Bad(f"{path}: a row without {field}: {row}")
            ident = (row["store"], row["framework"], row["scenario"], row["arm"])
            if ident in seen:
                raise Bad(f"{path}: {ident} is also in {seen[ident]}")
            seen[ident] = path
            rows.append(row)
    return files, rows


def drawn(rows):
    """The rows a bar stands for: annotated arms, first executions and replays."""
    out = []
    for row in rows:
        if row["arm"] == "bare" or row["scenario"] not in dict(SCENARIOS):
            continue
        if not isinstance(row["ratio"], (int, float)) or row["ratio"] <= 0:
            raise Bad(f"a row to draw without a positive ratio: {row}")
        out.append(row)
    return out


def ordered(values, known):
    """The distinct `values` in the order of `known`, unknown ones after, sorted."""
    keys = [k for k, _ in known]
    first = [k for k in keys if k in values]
    return first + sorted(set(values) - set(keys), key=str)


def label(key, known):
    return dict(known).get(key, key)


def nice_step(top):
    """A tick step that gives at most 6 ticks from 0 to `top`."""
    for step in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 50, 100):
        if top / step <= 6:
            return step
    return 10 ** math.ceil(math.log10(top))


def fmt_tick(v):
    return f"{v:g}"


def subtitle(files):
    """What the figures are: one line per input file."""
    lines = []
    for data in files:
        note = data.get("transcribed")
        if note:
            lines.append(note if isinstance(note, str) else " ".join(note))
            continue
        s = data.get("settings") or {}
        parts = [f"bench-http, {data.get('date', '?')}", data.get("machine", "")]
        if s:
            parts.append(
                f"{s.get('connections')} connections, medians of {s.get('rounds')} "
                f"round{'' if s.get('rounds') == 1 else 's'} of "
                f"{s.get('duration_s'):g} s"
                + (", load generator and servers on separate CPUs" if s.get("pinned") else "")
            )
        line = "; ".join(p for p in parts if p)
        if len(files) > 1:
            stores = ordered([r.get("store") for r in data.get("rows", [])], STORES)
            line = ", ".join(label(k, STORES) for k in stores) + ": " + line
        lines.append(line)
    return lines


def svg(files, rows):
    """The chart's SVG text."""
    bars = drawn(rows)
    if not bars:
        raise Bad("no annotated first-execution or replay rows to draw")
    stores = ordered([r["store"] for r in bars], STORES)
    # The bars of a store's group: every (framework, arm) any of its rows has, in a fixed order,
    # the same slots in both panels so that the groups line up.
    slots = {}
    for store in stores:
        present = {(r["framework"], r["arm"]) for r in bars if r["store"] == store}
        frameworks = ordered({f for f, _ in present}, FRAMEWORKS)
        arms = ordered({a for _, a in present}, ARMS)
        slots[store] = [(f, a) for f in frameworks for a in arms if (f, a) in present]
    group_w = {s: len(slots[s]) * (BAR + BAR_GAP) - BAR_GAP for s in stores}
    # Groups spread over at least MIN_WIDTH.
    gap = max(GROUP_GAP, (MIN_WIDTH - LEFT - RIGHT - sum(group_w.values())) / (len(stores) + 1))
    plot_w = round(sum(group_w.values()) + gap * (len(stores) + 1), 1)
    width = round(LEFT + plot_w + RIGHT)
    # Text of 11 px is about 6 px a character.
    chars = int((width - LEFT - 10) / 6.0)
    notes = [w for line in subtitle(files) for w in textwrap.wrap(line, chars)]
    top_y = 96 + 16 * len(notes)
    legend_y = top_y + len(SCENARIOS) * (PANEL_H + PANEL_GAP) - PANEL_GAP + 62
    footnote = textwrap.wrap(
        "Single commit: the handler's write and the record in one transaction (SQL stores); "
        "plain mode: the record written apart. Memory and Redis have one annotated arm, plain "
        "mode. The bare handler writes one row on SQL stores and nothing on memory and Redis, "
        "so a replay, which skips the handler, can be faster than bare (above 1).",
        chars,
    )
    height = legend_y + 30 + 16 * len(footnote)
    by_id = {(r["store"], r["framework"], r["scenario"], r["arm"]): r for r in bars}

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" '
        'font-size="12" role="img" aria-labelledby="chart-title">',
        '<title id="chart-title">idempotent: throughput of the annotated handler ÷ the bare '
        "handler, by store and framework (bench-http)</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="28" font-size="17" font-weight="bold">Annotated ÷ bare: '
        "throughput of the same handler with #[idempotent] and without</text>",
    ]
    for i, line in enumerate(notes):
        out.append(
            f'<text x="{LEFT}" y="{50 + 16 * i}" font-size="11" fill="#444">{escape(line)}</text>'
        )

    for p, (scenario, title) in enumerate(SCENARIOS):
        y0 = top_y + p * (PANEL_H + PANEL_GAP)
        values = [r["ratio"] for r in bars if r["scenario"] == scenario]
        top = max(values + [1.0]) * 1.15
        step = nice_step(top)
        top = math.ceil(top / step - 1e-9) * step

        def y(v, y0=y0, top=top):
            return y0 + PANEL_H - v / top * PANEL_H

        out.append(
            f'<text x="{LEFT}" y="{y0 - 14}" font-size="14" font-weight="bold">{escape(title)}'
            "</text>"
        )
        # Grid and y axis.
        ticks = [i * step for i in range(int(round(top / step)) + 1)]
        for t in ticks:
            ty = y(t)
            out.append(
                f'<line x1="{LEFT}" y1="{ty:.1f}" x2="{LEFT + plot_w}" y2="{ty:.1f}" '
                'stroke="#e4e4e4"/>'
            )
            out.append(
                f'<text x="{LEFT - 8}" y="{ty + 4:.1f}" text-anchor="end" fill="#333">'
                f"{fmt_tick(t)}</text>"
            )
        out.append(
            f'<line x1="{LEFT}" y1="{y0}" x2="{LEFT}" y2="{y0 + PANEL_H}" stroke="#333"/>'
        )
        out.append(
            f'<line x1="{LEFT}" y1="{y0 + PANEL_H}" x2="{LEFT + plot_w}" y2="{y0 + PANEL_H}" '
            'stroke="#333"/>'
        )
        mid = y0 + PANEL_H / 2
        out.append(
            f'<text x="24" y="{mid:.1f}" text-anchor="middle" fill="#333" '
            f'transform="rotate(-90 24 {mid:.1f})">annotated ÷ bare (req/s)</text>'
        )
        # Bars; their values are written after the line at 1.0, over it.
        labels = []
        x = LEFT + gap
        for store in stores:
            for k, (framework, arm) in enumerate(slots[store]):
                row = by_id.get((store, framework, scenario, arm))
                bx = round(x + k * (BAR + BAR_GAP), 1)
                if row is None:
                    out.append(
                        f'<text x="{bx + BAR / 2}" y="{y0 + PANEL_H - 4}" text-anchor="middle" '
                        'fill="#999">–</text>'
                    )
                    continue
                v = row["ratio"]
                by = y(v)
                what = (
                    f"{label(framework, FRAMEWORKS)}, {label(store, STORES)}, "
                    f"{label(arm, ARMS)}, {scenario}: {v:.2f} of bare"
                )
                if isinstance(row.get("rps"), (int, float)):
                    what += f" ({row['rps']:.0f} req/s)"
                if row.get("source"):
                    what += f"; {row['source']}"
                out.append(
                    f'<rect class="bar" x="{bx}" y="{by:.1f}" width="{BAR}" '
                    f'height="{y0 + PANEL_H - by:.1f}" '
                    f'fill="{COLOURS.get((framework, arm), "#888888")}" '
                    f'data-store="{escape(store)}" data-framework="{escape(framework)}" '
                    f'data-scenario="{escape(scenario)}" data-arm="{escape(arm)}" '
                    f'data-ratio="{v:.2f}"><title>{escape(what)}</title></rect>'
                )
                labels.append(
                    f'<text class="value" x="{bx + BAR / 2}" y="{by - 4:.1f}" '
                    'text-anchor="middle" font-size="11" stroke="#ffffff" stroke-width="3" '
                    f'paint-order="stroke">{v:.2f}</text>'
                )
            cx = x + group_w[store] / 2
            out.append(
                f'<text x="{cx:.1f}" y="{y0 + PANEL_H + 18}" text-anchor="middle" '
                f'font-weight="bold" fill="#222">{escape(label(store, STORES))}</text>'
            )
            x += group_w[store] + gap
        # The bare handler.
        one = y(1.0)
        out.append(
            f'<line x1="{LEFT}" y1="{one:.1f}" x2="{LEFT + plot_w}" y2="{one:.1f}" '
            'stroke="#c00000" stroke-width="1.5" stroke-dasharray="6 4"/>'
        )
        out.append(
            f'<text x="{LEFT + plot_w + 6}" y="{one + 4:.1f}" fill="#c00000" '
            'font-size="11">bare</text>'
        )
        out.extend(labels)
        out.append(
            f'<text x="{LEFT + plot_w / 2:.1f}" y="{y0 + PANEL_H + 38}" text-anchor="middle" '
            'fill="#333">store</text>'
        )

    # Legend: the (framework, arm) pairs drawn.
    pairs = ordered(
        {(r["framework"], r["arm"]) for r in bars},
        [((f, a), "") for f, _ in FRAMEWORKS for a, _ in ARMS],
    )
    lx = LEFT
    for framework, arm in pairs:
        text = f"{label(framework, FRAMEWORKS)}, {label(arm, ARMS)}"
        out.append(
            f'<rect x="{lx:.0f}" y="{legend_y - 11}" width="14" height="14" '
            f'fill="{COLOURS.get((framework, arm), "#888888")}"/>'
        )
        out.append(f'<text x="{lx + 20:.0f}" y="{legend_y}">{escape(text)}</text>')
        lx += 34 + 6.4 * len(text)
    out.append(
        f'<line x1="{lx:.0f}" y1="{legend_y - 4}" x2="{lx + 28:.0f}" y2="{legend_y - 4}" '
        'stroke="#c00000" stroke-width="1.5" stroke-dasharray="6 4"/>'
    )
    out.append(
        f'<text x="{lx + 34:.0f}" y="{legend_y}">bare handler = 1.0</text>'
    )
    for i, line in enumerate(footnote):
        out.append(
            f'<text x="{LEFT}" y="{legend_y + 24 + 16 * i}" font-size="11" fill="#444">'
            f"{escape(line)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def table(files, rows):
    """The Markdown table of the drawn ratios, a row per store and arm."""
    bars = drawn(rows)
    by_id = {(r["store"], r["framework"], r["scenario"], r["arm"]): r for r in bars}
    frameworks = ordered([r["framework"] for r in bars], FRAMEWORKS)
    sources = []

    def cell(row):
        if row is None:
            return "–"
        text = f"{row['ratio']:.2f}"
        if row.get("source"):
            if row["source"] not in sources:
                sources.append(row["source"])
            text += f" <sup>{sources.index(row['source']) + 1}</sup>"
        return text

    head = ["store", "annotated arm"]
    for f in frameworks:
        head += [f"{label(f, FRAMEWORKS)}: first executions", f"{label(f, FRAMEWORKS)}: replays"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for store in ordered([r["store"] for r in bars], STORES):
        arms = ordered({r["arm"] for r in bars if r["store"] == store}, ARMS)
        for arm in arms:
            cells = [label(store, STORES), label(arm, ARMS)]
            for f in frameworks:
                for scenario, _ in SCENARIOS:
                    cells.append(cell(by_id.get((store, f, scenario, arm))))
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for line in subtitle(files):
        lines.append(line)
        lines.append("")
    for i, source in enumerate(sources):
        lines.append(f"{i + 1}. {source}")
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def table_into(path, text):
    begin, end = "<!-- ratios:begin -->", "<!-- ratios:end -->"
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise Bad(f"{path}: no single {begin} … {end} block")
    head, rest = doc.split(begin)
    _, tail = rest.split(end)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{begin}\n{text}{end}{tail}")


def check(path, rows):
    """Reads the SVG back: one bar per drawn row, with the row's value, inside its panel."""
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    found = {}
    for rect in root.iter(f"{ns}rect"):
        if rect.get("class") != "bar":
            continue
        ident = tuple(rect.get(f"data-{k}") for k in ("store", "framework", "scenario", "arm"))
        if ident in found:
            raise Bad(f"{path}: two bars for {ident}")
        if float(rect.get("height")) <= 0:
            raise Bad(f"{path}: the bar of {ident} has no height")
        found[ident] = rect.get("data-ratio")
    want = {
        (r["store"], r["framework"], r["scenario"], r["arm"]): f"{r['ratio']:.2f}"
        for r in drawn(rows)
    }
    if found != want:
        missing = sorted(set(want) - set(found))
        extra = sorted(set(found) - set(want))
        wrong = sorted(k for k in set(want) & set(found) if want[k] != found[k])
        raise Bad(f"{path}: bars differ from rows: missing {missing}, extra {extra}, wrong {wrong}")
    labels = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "value"]
    if sorted(labels) != sorted(want.values()):
        raise Bad(f"{path}: value labels {sorted(labels)} against {sorted(want.values())}")
    return len(found)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="bench-http --json files")
    parser.add_argument(
        "-o", "--output", default=os.path.join(HERE, "ratios.svg"), help="the SVG to write"
    )
    parser.add_argument(
        "--table-into",
        metavar="FILE",
        help="rewrite the ratios table between <!-- ratios:begin --> and <!-- ratios:end -->",
    )
    parser.add_argument(
        "--check", action="store_true", help="read the SVG back: one bar per drawn row"
    )
    args = parser.parse_args()
    try:
        files, rows = load(args.inputs)
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(svg(files, rows))
        if args.table_into:
            table_into(args.table_into, table(files, rows))
        if args.check:
            n = check(args.output, rows)
            print(f"{args.output}: {n} bars, one per row, values as in the input")
    except (Bad, OSError, ValueError, ET.ParseError) as e:
        print(f"chart.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
