"""`planc explain --plot`: memory over one training step, plan vs unsharded baseline (matplotlib).

matplotlib is the optional `plot` extra (`pip install "planc[plot]"`); it is imported only
when a plot is asked for.
"""

from __future__ import annotations


class PlotError(ValueError):
    """A plot cannot be written (no matplotlib, or a file type it cannot make); the message says why."""



def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlotError('--plot needs matplotlib: pip install "planc[plot]"') from err
    return plt


def plot_step(est, path, measured=None, fmt: str | None = None) -> None:
    """Write memory per rank over one step (PNG or SVG, by the file's extension).

    Left: the estimated timeline (and the simulated one, if given), phases shaded, the units
    marked where they are all-gathered, the lower bound dotted. Right: the peaks side by side,
    the plan's split by category, against the same model unsharded (DDP-like).

    Args:
        est: the analytic `planc.estimate.memory.Estimate`.
        path: output file, `.png` or `.svg`; or a file object, then `fmt` says which.
        measured: a `planc.analysis.simulate.Measurement` to draw next to the estimate, if any.
    """
    if fmt is None and not path.lower().endswith((".png", ".svg")):
        raise PlotError(f"--plot {path}: write a .png or .svg file")
    plt = _pyplot()
    scale, unit = _scale(est.unsharded_peak_baseline)
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3.2, 1]})
    n = len(est.timeline)
    xs = [i / max(n - 1, 1) for i in range(n)]
    for phase, color in (("forward", "#e8f0fb"), ("backward", "#fbeee8"), ("optimizer", "#eef7e8")):
        idx = [i for i, m in enumerate(est.timeline) if m.phase == phase]
        if idx:
            ax.axvspan(xs[idx[0]], xs[idx[-1]] if idx[-1] > idx[0] else xs[idx[0]] + 0.01, color=color, lw=0)
            ax.text((xs[idx[0]] + xs[idx[-1]]) / 2, 0, phase, ha="center", va="bottom", fontsize=8, color="grey")
    ax.plot(xs, [m.total / scale for m in est.timeline], label=f"estimated (rank of {est.world})", lw=1.6)
    if measured is not None and measured.timeline:
        k = len(measured.timeline)
        ax.plot([i / max(k - 1, 1) for i in range(k)], [t / scale for _, t in measured.timeline],
                label=f"simulated (rank {measured.rank}, fake process group)", lw=1.0, alpha=0.8)
    ax.axhline(est.lower_bound / scale, color="grey", ls=":", label="lower bound")
    top = max(max(m.total for m in est.timeline), est.lower_bound, measured.peak if measured else 0) / scale
    ax.set_ylim(0, top * 1.25)
    # Mark where units are gathered; at most ~20 labels so they stay readable.
    marks = [(x, m.gathered) for x, m in zip(xs, est.timeline) if m.gathered and "(prefetch)" not in m.label]
    step = max(1, len(marks) // 20)
    for j, (x, name) in enumerate(marks):
        ax.axvline(x, color="lightgrey", lw=0.4)
        if j % step == 0:
            ax.text(x, top * 1.22, name, rotation=90, fontsize=6, va="top", color="dimgrey")
    peak_x = xs[est.timeline.index(est.peak)]
    ax.annotate(f"peak {est.peak.total / scale:.2f} {unit}\n{est.peak.label}", (peak_x, est.peak.total / scale),
                fontsize=8, xytext=(12, -34), textcoords="offset points", arrowprops={"arrowstyle": "->"})
    ax.set_xlabel("progress through one training step")
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(f"memory per rank over one step, world {est.world}")
    ax.legend(loc="upper left", fontsize=8)

    # Peaks: the plan's split by category, then the unsharded baseline.
    labels, bottoms = ["plan\n(estimated)"], 0.0
    for cat, value in est.peak.bytes.items():
        if value:
            bars.bar(0, value / scale, bottom=bottoms, label=cat.replace("_", " "))
            bottoms += value / scale
    xs_bar = [0]
    if measured is not None:
        bars.bar(1, measured.peak / scale, color="#ff7f0e")
        labels.append("plan\n(simulated)")
        xs_bar.append(1)
    base_x = len(xs_bar)
    bars.bar(base_x, est.unsharded_peak_baseline / scale, color="grey")
    labels.append("unsharded\n(DDP-like)")
    xs_bar.append(base_x)
    bars.set_xticks(xs_bar, labels, fontsize=8)
    bars.set_title("peak per rank", fontsize=10)
    bars.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format=fmt)
    plt.close(fig)


def _scale(largest: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "B"
