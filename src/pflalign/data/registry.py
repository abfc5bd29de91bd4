"""Every dataset pflalign loads (``data.name``), one line each: the name and the loader module's
`Dataset` (`pflalign.data.Dataset`: its table, its default clients, the files the data cache
keys on). To add a dataset: a loader module in this folder that defines its ``DATASET``, and its
line here; `data.federate`, `data.clients`, `pflalign.run.data_cache` and `pflalign export` read
it from here.
"""

from __future__ import annotations

from pflalign.data import Dataset, dolly, files, flan, synthetic

DATASETS: dict[str, Dataset] = {
    "synthetic": synthetic.DATASET,  # 4 generated tasks, one client each by default; no download (demos, tests)
    "dolly": dolly.DATASET,  # Databricks-Dolly-15K, one client per category
    "flan": flan.DATASET,  # FedDPA's FLAN release, one client per category
    "files": files.DATASET,  # your own data, read as a table and partitioned (data.columns, data.partition_by)
}
