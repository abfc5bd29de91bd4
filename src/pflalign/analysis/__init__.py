"""Finished runs read back: report.py, report_md.py, figures.py (with figure_style.py,
client_figures.py, sweep_figure.py), claims.py. They import no training code
(tests/test_layers.py), so `pflalign report` does not load the training stack.
"""
