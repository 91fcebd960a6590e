"""docs/RESULTS.md in three steps: :mod:`~jaxkv.eval.report.measure` (run the models, one
JSON-ready dict), :mod:`~jaxkv.eval.report.plot` (PNGs, matplotlib: the ``results`` extra) and
:mod:`~jaxkv.eval.report.render` (the markdown). ``scripts/reproduce.py`` chains them."""
