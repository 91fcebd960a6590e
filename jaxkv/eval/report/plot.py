"""Plots of docs/RESULTS.md from the measured results (``measure.run``'s JSON): matplotlib, the
optional ``results`` extra (``pip install 'jaxkv[results]'``)."""

from __future__ import annotations

import pathlib

import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.eval.perplexity import paired_ratio
from jaxkv.eval.report.measure import MODEL_NAMES


def _save(plt, fig, path: pathlib.Path) -> str:
    """Lay out, write (PNG, 110 dpi) and close ``fig``; returns the file name."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plots(res: dict, outdir: pathlib.Path) -> list[str]:
    """Draw the plots of every section present in ``res`` into ``outdir`` (PNG, 110 dpi).

    Plots: ``nll_vs_position_<model>.png`` (section 1: rolling perplexity by token position,
    and the paired ratio to the recomputation oracle per bin of positions),
    ``ppl_by_sinks.png`` (section 2), ``kivi_ppl.png`` (section 3: perplexity change in %
    by group size).

    Returns:
      the file names written, in the order the document shows them.
    Raises:
      JaxkvError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise JaxkvError(
            "the plots need matplotlib: pip install 'jaxkv[results]' (or render with the plots already there)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    labels = {
        "full": "full cache",
        "window": "window only (sink 0)",
        "sink_absolute": "sink 4 + window, absolute pos.",
        "sink_cache": "sink 4 + window, cache pos.",
    }
    colors = {"full": "tab:gray", "window": "tab:red", "sink_absolute": "tab:orange", "sink_cache": "tab:blue"}
    for name in MODEL_NAMES:
        if name not in res or "s1" not in res[name]:
            continue
        s1 = res[name]["s1"]
        n = s1["tokens"]
        roll = 256 if n >= 2048 else 64
        fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
        kernel = np.ones(roll) / roll
        for kind in ("full", "sink_absolute", "sink_cache", "window"):  # window last, dashed: it may overlap
            nll = np.asarray(s1["runs"][kind])
            y = np.exp(np.convolve(nll, kernel, mode="valid"))
            x = np.arange(len(y)) + roll // 2
            ax.plot(x, y, label=labels[kind], color=colors[kind], lw=1.3, ls="--" if kind == "window" else "-")
        # bottom: paired ratio to the recomputation oracle per bin of its sampled positions
        pos = np.asarray(s1["recompute"]["positions"])
        rec = np.asarray(s1["recompute"]["nll"])
        bw = 512 if n >= 4096 else 256 if n >= 1024 else 64
        edges = [lo for lo in range(0, n, bw) if ((pos >= lo) & (pos < lo + bw)).sum() >= 4]
        for kind in ("full", "window", "sink_absolute", "sink_cache"):
            nll = np.asarray(s1["runs"][kind])
            full = np.zeros(len(nll))  # the oracle's NLL by query position (only the sampled ones are read)
            full[pos] = rec
            ys = [paired_ratio(nll, full, pos[(pos >= lo) & (pos < lo + bw)])["ratio"] for lo in edges]
            bx.plot([lo + bw / 2 for lo in edges], ys, "o-", color=colors[kind], ms=4, lw=1.2)
        bx.axhspan(1 / 1.1, 1.1, color="tab:green", alpha=0.15, label="within 10 % of the oracle")
        bx.axhline(1.0, color="k", lw=0.8)
        bx.set_yscale("log")
        bx.set_ylabel("ratio to recompute oracle")
        bx.set_xlabel("token position")
        bx.legend(fontsize=8, loc="upper left")
        bx.grid(alpha=0.3, which="both")
        trained = res[name]["config"]["trained_context"]
        for a in (ax, bx):
            a.axvline(s1["cache"], color="k", ls=":", lw=0.8)
            if trained < n:
                a.axvline(trained, color="tab:purple", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"perplexity (exp of rolling mean NLL, {roll} tokens)")
        ax.set_title(
            f"{name}: streaming perplexity versus position ({n} tokens of TinyStories)\n"
            f"dotted line: cache size {s1['cache']}"
            + (f"; dashed line: trained context {trained}" if trained < n else "")
            + f"\nbottom: paired ratio to the recomputation oracle (window {s1['cache']}) per {bw} positions",
            fontsize=9,
        )
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3, which="both")
        made.append(_save(plt, fig, outdir / f"nll_vs_position_{name}.png"))

    have2 = [m for m in MODEL_NAMES if m in res and "s2" in res[m]]
    if have2:
        fig, axes = plt.subplots(1, len(have2), figsize=(5 * len(have2), 4), squeeze=False)
        for ax, name in zip(axes[0], have2):
            s2 = res[name]["s2"]
            for positions, col in (("absolute", "tab:orange"), ("cache", "tab:blue")):
                rows = [v for v in s2["table"].values() if v["positions"] == positions]
                rows.sort(key=lambda r: r["sink"])
                ax.plot(
                    [r["sink"] for r in rows], [r["ppl"] for r in rows], "o-", color=col, label=f"{positions} positions"
                )
            ax.set_xticks(sorted({v["sink"] for v in s2["table"].values()}))
            ax.set_xlabel(f"sink tokens (sink + window = {s2['cache']})")
            ax.set_ylabel(f"perplexity over {s2['tokens']} tokens")
            ax.set_yscale("log")
            ax.set_title(name)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        made.append(_save(plt, fig, outdir / "ppl_by_sinks.png"))

    have3 = [m for m in MODEL_NAMES if m in res and "s3" in res[m]]
    if have3:
        fig, axes = plt.subplots(1, len(have3), figsize=(5 * len(have3), 4), squeeze=False)
        for ax, name in zip(axes[0], have3):
            cache = res[name]["s3"]["cache"]
            groups = sorted({int(k.split("/G")[1]) for k in cache if "/G" in k})
            for mode, col in (("int8", "tab:green"), ("int4", "tab:blue"), ("int2", "tab:red")):
                ax.plot(groups, [100 * cache[f"{mode}/G{g}"]["vs_fp32"] for g in groups], "o-", color=col, label=mode)
            ax.axhline(100 * cache["bf16"]["vs_fp32"], color="tab:gray", ls="--", label="bf16")
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xscale("log", base=2)
            ax.set_xticks(groups, [str(g) for g in groups])
            ax.set_yscale("symlog", linthresh=0.1)
            ax.set_xlabel("group size G (residual R = G)")
            ax.set_ylabel("perplexity change vs fp32 cache (%)")
            ax.set_title(f"{name}: KIVI (fp32 ppl {cache['fp32']['ppl']:.3f})")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        made.append(_save(plt, fig, outdir / "kivi_ppl.png"))
    return made
