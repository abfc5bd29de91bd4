"""The paper's Table 1 beside ours, per client: a Markdown page from the paper's table1.csv
(`shared/paper/table1.csv`, beside the project) and a report's table.csv (`pflalign report`).

    python3 docs/results/beside-paper.py ../shared/paper/table1.csv \
        docs/results/table1-dolly/dolly/table.csv dolly > docs/results/table1-dolly/beside-paper.md

Per paper model (LLaMA-3.2-1B-Instruct, OPT-1.3B): "paper / ours" for each client and the
average (the paper's Avg ± its 95% half-width, ours ± ours with the number of seeds), then
pFLAlign's rank in each column among the methods both tables have, and how far the two tables
order those methods alike (Spearman's rank correlation of each column). Levels are not to be
compared across models (the paper's about 1.2B and 1.3B parameters, ours 135M): ranks are.
The numbers are computed here from the two files, never typed by hand. Standard library only.
"""

from __future__ import annotations

import csv
import sys

# the paper's method names that are not ours lowercased
PAPER_NAMES = {"Fed-SVD": "fedsvd", "FedYoGI": "fedyogi", "FedGloss": "fedgloss"}
SHOWN = {"ffa-lora": "FFA-LoRA", "fedsa-lora": "FedSA-LoRA", "fedsvd": "FedSVD", "fedavg": "FedAvg",
         "fedprox": "FedProx", "fedsam": "FedSAM", "scaffold": "SCAFFOLD", "feddyn": "FedDyn",
         "fedyogi": "FedYogi", "fedgloss": "FedGloSS", "local": "Local", "pflalign": "pFLAlign"}


def paper_rows(path: str, dataset: str) -> dict[str, dict[str, dict[str, float]]]:
    """{paper model: {our method name: {"c1".."c4", "avg", "ci95": value}}} for `dataset` ("dolly", "flan")."""
    rows: dict[str, dict[str, dict[str, float]]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            cols = [k for k in r if k.startswith(dataset + "_")]
            if not cols:
                raise SystemExit(f"beside-paper: {path} has no {dataset}_ columns")
            method = PAPER_NAMES.get(r["method"], r["method"].lower())
            rows.setdefault(r["model"], {})[method] = {k[len(dataset) + 1:]: float(r[k]) for k in cols}
    return rows


def our_rows(path: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Our clients in order and {method: the table.csv row}."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        rows = {r["method"]: r for r in reader}
    clients = fields[fields.index("family") + 1:fields.index("avg")]
    return clients, rows


def ranks(values: dict[str, float]) -> dict[str, float]:
    """Rank 1 = highest; ties share the mean of their places (as Spearman's correlation wants)."""
    order = sorted(values, key=lambda m: -values[m])
    out, i = {}, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for m in order[i:j + 1]:
            out[m] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: dict[str, float], b: dict[str, float]) -> float | None:
    """Spearman's rank correlation over the keys both have (None below 3 or without spread)."""
    keys = [k for k in a if k in b]
    if len(keys) < 3:
        return None
    ra, rb = ranks({k: a[k] for k in keys}), ranks({k: b[k] for k in keys})
    ma, mb = sum(ra.values()) / len(keys), sum(rb.values()) / len(keys)
    cov = sum((ra[k] - ma) * (rb[k] - mb) for k in keys)
    va, vb = sum((ra[k] - ma) ** 2 for k in keys), sum((rb[k] - mb) ** 2 for k in keys)
    return cov / (va * vb) ** 0.5 if va and vb else None


def _place(rank: float, n: int) -> str:
    return f"{rank:g} of {n}"


def page(paper: dict, clients: list[str], ours: dict[str, dict[str, str]], dataset: str) -> str:
    names = clients + ["avg"]
    # the paper's columns: c1..c4 (Dolly) or the clients' names (FLAN)
    first = next(iter(next(iter(paper.values())).values()))
    cols = names if clients[0] in first else [f"c{i + 1}" for i in range(len(clients))] + ["avg"]
    seeds = sorted({int(r["n_seeds"]) for r in ours.values()}) or [0]
    seeds_said = f"{seeds[0]} seed{'s' * (seeds[0] != 1)}" if seeds[0] == seeds[-1] else f"{seeds[0]}–{seeds[-1]} seeds"
    lines = [f"# The paper's Table 1 beside ours: {dataset}", "",
             f"Personalized ROUGE-L ×100, **paper / ours** per client "
             + (f"(the paper's c1–c4 are {', '.join(clients)}) " if cols != names else "")
             + f"from the paper's table1.csv and ours from this folder's "
             f"{dataset}/table.csv ({len(ours)} rows, {seeds_said} each; Avg: mean ± the 95% "
             "half-width where a row has 3 seeds). Levels are not to be compared across models (the paper's "
             "about 1.2B and 1.3B parameters, ours SmolLM2-135M-Instruct); ranks are. Written by "
             "docs/results/beside-paper.py from the two files.", ""]
    for model, rows in paper.items():
        lines += [f"## {model}", "", "| Method | " + " | ".join(clients) + " | Avg |",
                  "| :-- |" + " --: |" * len(names)]
        methods = list(rows) + [m for m in ours if m not in rows]
        for m in methods:
            p, o = rows.get(m), ours.get(m)
            cells = []
            for c, name in zip(cols, names):
                left = "–" if p is None else f"{p[c]:.2f}"
                if c == "avg" and p is not None:
                    left += f" ± {p['ci95']:.2f}"
                right = "–" if o is None else f"{float(o[name]):.2f}"
                if c == "avg" and o is not None:
                    right += f" ± {float(o['avg_ci95']):.2f}" if o["avg_ci95"] else f" ({o['n_seeds']} seed{'s' * (o['n_seeds'] != '1')})"
                cells.append(f"{left} / {right}")
            lines.append(f"| {SHOWN.get(m, m)} | " + " | ".join(cells) + " |")
        both = [m for m in rows if m in ours]
        lines += ["", f"Over the {len(both)} methods both tables have"
                  + (f" ({', '.join(SHOWN.get(m, m) for m in both)})" if both else "") + ":", ""]
        if len(both) < 2:
            lines += ["(fewer than two: no ranks yet)", ""]
            continue
        lines += ["| | " + " | ".join(names[:-1]) + " | Avg |", "| :-- |" + " --: |" * len(names)]
        paper_col = {c: {m: rows[m][c] for m in both} for c in cols}
        our_col = {c: {m: float(ours[m][name]) for m in both} for c, name in zip(cols, names)}
        if "pflalign" in both:
            lines.append("| pFLAlign's rank, paper | " + " | ".join(
                _place(ranks(paper_col[c])["pflalign"], len(both)) for c in cols) + " |")
            lines.append("| pFLAlign's rank, ours | " + " | ".join(
                _place(ranks(our_col[c])["pflalign"], len(both)) for c in cols) + " |")
        rho = [spearman(paper_col[c], our_col[c]) for c in cols]
        lines.append("| Spearman ρ, paper vs ours | " + " | ".join("–" if r is None else f"{r:+.2f}" for r in rho)
                     + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: beside-paper.py PAPER_TABLE1_CSV OUR_TABLE_CSV DATASET", file=sys.stderr)
        return 2
    paper_csv, ours_csv, dataset = argv
    try:
        paper = paper_rows(paper_csv, dataset)
        clients, ours = our_rows(ours_csv)
    except (OSError, KeyError, ValueError) as exc:
        print(f"beside-paper: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(page(paper, clients, ours, dataset))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
