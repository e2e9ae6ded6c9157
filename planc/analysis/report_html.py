"""`planc explain --html FILE`: the explain report as one self-contained HTML page.

The page holds the module tree with each unit's modules in the unit's colour, the per-unit
table, the memory summary and the memory-over-one-step plot as inline SVG. Everything is
inline (CSS, SVG; no script, no font, no network reference), so the file can be attached to
a review or a CI artifact and opened anywhere. The numbers are `planc.analysis.explain.report(...)`'s
JSON data; the plot is `planc.plot.plot_step` (matplotlib, the `plot` extra) written to a
string.
"""

from __future__ import annotations

import io
import re
from html import escape
from typing import Any

from planc.quantities import show_bytes, show_count

# Distinct, light enough to read black text on; units beyond the list reuse it in turn.
PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#fccde5",
           "#bebada", "#80b1d3", "#b3de69", "#d9d9d9", "#ccebc5", "#ffed6f", "#e5d8bd", "#decbe4")

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.meta { color: #555; } code, .mono { font-family: ui-monospace, monospace; font-size: 13px; }
ul.tree, ul.tree ul { list-style: none; margin: 0; padding-left: 18px; }
ul.tree { padding-left: 0; } ul.tree li { margin: 1px 0; }
.mod { padding: 0 4px; border-radius: 3px; } .cls { color: #666; } .n { color: #888; }
.badge { font-size: 11px; padding: 0 5px; border-radius: 8px; border: 1px solid #0002; margin-left: 6px; }
table { border-collapse: collapse; } th, td { padding: 3px 8px; border-bottom: 1px solid #ddd; text-align: left; }
td code { white-space: nowrap; } td.num { text-align: right; font-variant-numeric: tabular-nums; } th { background: #f4f4f4; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px; vertical-align: -1px; }
.plot svg { max-width: 100%; height: auto; } .note { color: #666; font-size: 12px; }
"""


def colors(data: dict[str, Any]) -> dict[str, str]:
    """Unit name -> its colour, in the report's unit order."""
    return {u["name"]: PALETTE[i % len(PALETTE)] for i, u in enumerate(data["units"])}


def render_html(data: dict[str, Any], compiled, est, measured=None) -> str:
    """The whole page for one `explain` report (`data` from `planc.analysis.explain.report`)."""
    color = colors(data)
    title = f"planc explain {data['plan']}"
    mesh = data["mesh"]
    head = (f"<h1>{escape(title)}</h1><div class=meta>model <code>{escape(str(data['model']))}</code> · world "
            f"{data['world_size']} (replicate {mesh['replicate']} × shard {mesh['shard']}"
            + (f" × tensor {mesh['tensor']}" if mesh.get("tensor") is not None else "") + ") · optimizer "
            f"{escape(str(data['optimizer']))}" + (f" · input {'x'.join(map(str, data['input_shape']))}"
                                                    if data["input_shape"] else "") + "</div>")
    parts = [head, "<h2>Module tree</h2>", _tree(data, compiled, color),
             "<h2>Units</h2>", _units_table(data, color),
             "<h2>Memory per rank, one training step</h2>", _memory(data),
             "<div class=plot>", plot_svg(est, measured), "</div>"]
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>" + escape(title) +
            "</title><style>" + CSS + "</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_html(path: str, data: dict[str, Any], compiled, est, measured=None) -> None:
    """Write the page to `path` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(data, compiled, est, measured))


def plot_svg(est, measured=None) -> str:
    """The memory plot as an inline `<svg>` element (the XML prolog dropped)."""
    from planc.analysis.plot import plot_step
    buf = io.StringIO()
    plot_step(est, buf, measured=measured, fmt="svg")
    svg = buf.getvalue()
    # matplotlib's RDF metadata block names namespaces by URL; nothing is fetched, but the
    # page keeps no external address at all (tests/test_report_html.py checks)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg[svg.index("<svg"):], flags=re.S)
    return svg


def _tree(data: dict[str, Any], compiled, color: dict[str, str]) -> str:
    """Nested lists: every module down to the units' modules; a unit's insides folded away."""
    g = compiled.graph
    unit_of = {m: u["name"] for u in data["units"] if not u["root"] for m in u["modules"]}
    root = next((u["name"] for u in data["units"] if u["root"]), None)

    def label(path: str, name: str, unit: str | None) -> str:
        style = f" style='background:{color[unit]}'" if unit else ""
        badge = f"<span class=badge style='background:{color[unit]}'>unit {escape(unit)}</span>" if unit else ""
        return (f"<span class='mod mono'{style}>{escape(name)}</span> <span class=cls>{escape(g.cls(path))}</span> "
                f"<span class=n>{show_count(g.subtree_numel[path])}</span>{badge}")

    def walk(path: str) -> str:
        items = []
        for kid, name in zip(g.children(path), g.child_names(path)):
            unit = unit_of.get(kid)
            inner = walk(kid) if g.children(kid) else ""
            if inner and unit:  # the unit's own submodules: one click away
                items.append(f"<li><details><summary>{label(kid, name, unit)}</summary>{inner}</details></li>")
            else:
                items.append(f"<li>{label(kid, name, unit)}{inner}</li>")
        return "<ul>" + "".join(items) + "</ul>" if items else ""

    top = label("", "<root>", root)
    return f"<ul class=tree><li>{top}{walk('')}</li></ul>"


def _units_table(data: dict[str, Any], color: dict[str, str]) -> str:
    """One row per unit: size, bytes per rank, the settings and where each came from."""
    head = ("<tr><th>unit</th><th>params</th><th>sharded/rank</th><th>unsharded</th><th>param/reduce</th>"
            "<th>reshard</th><th>offload</th><th>prefetch fwd / bwd</th><th>defined by</th></tr>")
    rows = []
    for u in data["units"]:
        s = u["settings"]
        fwd = ", ".join(u["prefetch_forward"]) or "-"
        bwd = ", ".join(u["prefetch_backward"]) or "-"
        rows.append(
            f"<tr><td><span class=swatch style='background:{color[u['name']]}'></span><code>{escape(u['name'])}</code></td>"
            f"<td class=num>{show_count(u['params'])}</td><td class=num>{show_bytes(u['sharded_bytes'])}</td>"
            f"<td class=num>{show_bytes(u['unsharded_bytes'])}</td>"
            f"<td>{escape(s['param_dtype']['value'])}/{escape(s['reduce_dtype']['value'])}</td>"
            f"<td>{escape(s['reshard_after_forward']['value'])}</td><td>{'yes' if u['offload'] else '-'}</td>"
            f"<td>{escape(fwd)} / {escape(bwd)}</td>"
            f"<td><code>{escape(u['defined_by'] or '')}</code> <span class=note>{escape(u['line'] or '')}</span></td></tr>")
    return "<table>" + head + "".join(rows) + "</table>"


def _memory(data: dict[str, Any]) -> str:
    """The peak and its breakdown, the bounds, and the estimate's notes."""
    m = data["memory"]
    rows = [f"<tr><th>peak</th><td class=num>{show_bytes(m['peak_bytes'])}</td><td>at {escape(m['moment'])}</td></tr>"]
    rows += [f"<tr><td>{escape(k.replace('_', ' '))}</td><td class=num>{show_bytes(v)}</td><td></td></tr>"
             for k, v in m["breakdown"].items()]
    rows.append(f"<tr><td>lower bound</td><td class=num>{show_bytes(m['lower_bound_bytes'])}</td>"
                f"<td>peak is {m['ratio_to_lower_bound']}x</td></tr>")
    rows.append(f"<tr><td>unsharded (DDP-like)</td><td class=num>{show_bytes(m['unsharded_baseline_bytes'])}</td><td></td></tr>")
    if "simulated" in data:
        s = data["simulated"]
        rows.append(f"<tr><td>simulated (rank {s['rank']})</td><td class=num>{show_bytes(s['peak_bytes'])}</td>"
                    f"<td>at {escape(str(s['moment']))}</td></tr>")
    notes = "".join(f"<li>{escape(n)}</li>" for n in m["notes"])
    return ("<table>" + "".join(rows) + "</table>" +
            f"<p class=note>activations from: {escape(str(m['activations_from']))}; tensor bytes only (no CUDA "
            "context, NCCL workspaces or allocator fragmentation)</p>" + (f"<ul class=note>{notes}</ul>" if notes else ""))
