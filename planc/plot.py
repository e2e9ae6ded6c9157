"""`planc explain --plot`: memory over one training step, plan vs unsharded baseline (matplotlib).

matplotlib is the optional `plot` extra (`pip install "planc[plot]"`); it is imported only
when a plot is asked for.
"""

from __future__ import annotations

from planc.cli import UsageError


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise UsageError('--plot needs matplotlib: pip install "planc[plot]"') from err
    return plt


def plot_step(est, path: str, measured=None) -> None:
    """Write memory per rank over one step (PNG or SVG, by the file's extension).

    Args:
        est: the analytic `planc.memory.Estimate` (its timeline is plotted, units marked).
        path: output file, `.png` or `.svg`.
        measured: a `planc.simulate.Measurement` to draw next to the estimate, if any.
    """
    if not path.lower().endswith((".png", ".svg")):
        raise UsageError(f"--plot {path}: write a .png or .svg file")
    plt = _pyplot()
    mib = 2**20
    fig, ax = plt.subplots(figsize=(11, 5))
    n = len(est.timeline)
    xs = [i / max(n - 1, 1) for i in range(n)]
    ax.plot(xs, [m.total / mib for m in est.timeline], label=f"plan, estimated (rank of {est.world})", lw=1.6)
    if measured is not None and measured.timeline:
        k = len(measured.timeline)
        ax.plot([i / max(k - 1, 1) for i in range(k)], [t / mib for _, t in measured.timeline],
                label="plan, simulated (fake process group)", lw=1.0, alpha=0.8)
    ax.axhline(est.unsharded_peak_baseline / mib, color="grey", ls="--", label="unsharded (DDP-like) peak")
    ax.axhline(est.lower_bound / mib, color="grey", ls=":", label="lower bound")
    # Mark where each unit's forward and backward begin.
    last = None
    for x, m in zip(xs, est.timeline):
        if m.label.startswith("all-gather") and m.label != last:
            ax.axvline(x, color="lightgrey", lw=0.5)
            ax.text(x, ax.get_ylim()[1] * 0.98, m.unit, rotation=90, fontsize=6, va="top", color="dimgrey")
            last = m.label
    peak_x = xs[est.timeline.index(est.peak)]
    ax.annotate(f"peak {est.peak.total / mib:.1f} MiB\n{est.peak.label}", (peak_x, est.peak.total / mib),
                fontsize=8, xytext=(10, -30), textcoords="offset points", arrowprops={"arrowstyle": "->"})
    ax.set_xlabel("progress through one step (forward, backward, optimizer)")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"memory per rank over one training step, world {est.world}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
