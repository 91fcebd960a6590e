#!/usr/bin/env python
"""Regenerate docs/RESULTS.md and its plots (issue 5): what the caches cost in quality.

Usage (from the repository root; plots need the ``results`` extra, i.e. matplotlib)::

    .venv/bin/python scripts/reproduce.py                 # everything -> docs/RESULTS.md, docs/results/
    .venv/bin/python scripts/reproduce.py --quick         # smoke run, small sizes -> a temp folder
    .venv/bin/python scripts/reproduce.py --render-only   # re-render from docs/results/results.json
    .venv/bin/python scripts/reproduce.py --sections 3,4 --out /tmp/r   # some sections only

Three steps, each in ``jaxkv.eval.report``: measure (every number, from ``../shared/data``
only: stories260K, SmolLM2-135M-Instruct GGUF, the TinyStories validation text) ->
OUT/results/results.json; plot -> OUT/results/*.png; render -> OUT/RESULTS.md. The
sections are listed in ``jaxkv/eval/report/measure.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / ".." / "shared" / "data"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run with small sizes (writes to a temp folder unless --out is given)",
    )
    parser.add_argument("--out", type=pathlib.Path, help="folder for RESULTS.md and results/ (default: docs)")
    parser.add_argument("--sections", default="1,2,3,4,5", help="comma-separated sections to measure (default: all)")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="re-render RESULTS.md and the plots from OUT/results/results.json without running the models",
    )
    parser.add_argument(
        "--no-plots",
        action="store_true",
        help="do not draw the plots; link those already in OUT/results (no matplotlib needed)",
    )
    args = parser.parse_args(argv)
    out = args.out or (pathlib.Path(tempfile.gettempdir()) / "jaxkv-reproduce-quick" if args.quick else REPO / "docs")
    resdir = out / "results"
    resdir.mkdir(parents=True, exist_ok=True)

    from jaxkv.eval.report import measure, plot, render
    from jaxkv.files import atomic_write

    if args.render_only:
        res = json.loads((resdir / "results.json").read_text())
    else:
        import jax

        jax.config.update("jax_platforms", "cpu")
        sections = [int(s) for s in args.sections.split(",")]
        res = measure.run(DATA, quick=args.quick, sections=sections, checkpoint=resdir / "results.json")
        atomic_write(resdir / "results.json", json.dumps(res).encode(), private=False)
    if args.no_plots:
        made = [p.name for p in sorted(resdir.glob("*.png"))]
    else:
        made = plot.plots(res, resdir)
    (out / "RESULTS.md").write_text(render.render(res, made), encoding="utf-8")
    measure.log(f"wrote {out / 'RESULTS.md'} from {resdir / 'results.json'}; plots: {', '.join(made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
