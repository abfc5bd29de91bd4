"""Finished runs read back: report.py, report_md.py, figures.py, claims.py. They import no training
code (tests/test_layers.py), so `pflalign report` does not load the training stack.
"""
