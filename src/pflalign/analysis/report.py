"""`pflalign report`: the paper's Table 1 and the statistics of finished runs.

This module only hands names on, from three rooms: reading runs (`analysis/runs.py`), tables
(`analysis/tables.py`) and statistics (`analysis/stats.py`); `pflalign.analysis.report.X` keeps
working for every name it had (the analysis scripts under docs/results import it so).

Scans a folder for finished runs (a directory with `results.json`,
`metrics.jsonl` and `config.json`), groups them by dataset and method, and
computes per dataset a table shaped like the paper's Table 1 (`table.md`,
`table.csv`), paired differences, training dynamics and their markdown;
`report_md.write_report` puts them, the figures (`analysis/figures.py`) and the
claims (`analysis/claims.py`) into one `report.md`: figures and claims read this
module's rows, and it imports neither (tests/test_layers.py). A run's dataset is the folder name in a sweep's layout
(<dataset>/<method>/seed<k>/), else its `results.json` dataset.

Cells are personalized ROUGE-L ×100, the mean over seeds; the Avg column is
the mean over seeds of each run's client average, ± the half-width of the 95%
Student-t confidence interval over seeds, t_{0.975, n−1} · s / √n.

The paper's own parts (Table 1's family headings, the claims, structure_to_text
as the figures' default client) are for its federations only (`paper_federation`);
other data get a neutral report.
"""

from __future__ import annotations

from ..methods import FAMILIES, family, label, method_order  # noqa: F401  (FAMILIES: the table's row groups)
from ..run_stats import DIVERGED_LOSS_RATIO, client_blowups, distribution, start_loss  # noqa: F401
from .runs import (Run, DEFAULT_CLIENT, PAPER_FEDERATIONS, paper_federation, figure_client, _number,
    read_results, _unfinished_notes, find_runs, Divergence, round_losses, divergence, divergence_notes,
    client_blowup_notes, with_exact_match, predictions, run_dynamics, GSNR_RISE_ROUND, client_gsnr)  # noqa: F401
from .stats import (_t_central_mass, t_quantile, ci95_half_width, MIN_SEEDS_TO_JUDGE, judgeable,
    excludes_zero, REFERENCE, _score, Paired, paired_differences)  # noqa: F401
from .tables import (Row, METRICS, summarize, _mean_or_none, MARK_SEEDS, _ranks, marked, table_markdown,
    write_table_csv, Sweep, _setting_value, sweeps, sweeps_markdown, _seed_note, cost_markdown,
    MAX_TABLE_CLIENTS, distribution_markdown, top_answer, _short, answers_markdown, paired_markdown,
    dynamics_markdown, _mean_rows, _mean_cell, client_gsnr_markdown)  # noqa: F401
