"""Your own data (pflalign.data.files) and partitioned federations (pflalign.data.federate):
formats and column mapping, test-set rules, one-line errors, and today's Dolly/FLAN
federations reproduced exactly as the natural partition by category."""

from __future__ import annotations

import json
import random
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from pflalign.cli import main  # noqa: E402
from pflalign.config import build_config, parse_set  # noqa: E402
from pflalign.data import Example  # noqa: E402
from pflalign.data.dolly import PAPER_CATEGORIES as DOLLY_PAPER  # noqa: E402
from pflalign.data.flan import PAPER_CATEGORIES as FLAN_PAPER  # noqa: E402
from pflalign.data.federate import FederationOptions, federation  # noqa: E402
from pflalign.data.files import Columns, read_table  # noqa: E402
from pflalign.data.partition import PartitionSpec  # noqa: E402
from pflalign.errors import UserError  # noqa: E402

DOLLY_PAPER_CATEGORIES = list(DOLLY_PAPER)
FLAN_PAPER_CATEGORIES = list(FLAN_PAPER)
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "qa.csv"
QA = Columns(instruction="question", response="answer", context="passage")


def _rows(n=12, labels=("a", "b", "c")):
    return [{"q": f"question {i}", "ctx": f"context {i}" if i % 2 else "", "ans": f"answer {i}",
             "who": labels[i % len(labels)]} for i in range(n)]


def _write_all_formats(tmp_path, rows):
    import pandas as pd

    frame = pd.DataFrame(rows)
    paths = {"jsonl": tmp_path / "d.jsonl", "json": tmp_path / "d.json", "csv": tmp_path / "d.csv",
             "parquet": tmp_path / "d.parquet"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))
    frame.to_csv(paths["csv"], index=False)
    frame.to_parquet(paths["parquet"], index=False)
    return paths


def _opts(**kw):
    spec = kw.pop("spec", PartitionSpec())
    return FederationOptions(partition=spec, columns=kw.pop("columns", Columns("q", "ans", "ctx")), **kw)


# --- the paper's federations: the natural partition on category ------------------------------


def _dolly_by_hand(path: Path, categories: list[str], seed: int) -> list[tuple[str, list, list]]:
    """The paper's Dolly split, written out here: each category's records in file order, shuffled
    by random.Random(f"{seed}:{category}"), the first ceil(n/10) its test set."""
    by_category: dict[str, list[Example]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        instruction, context = r["instruction"].strip(), (r.get("context") or "").strip()
        prompt = f"{instruction}\n\nContext:\n{context}" if context else instruction
        by_category.setdefault(r["category"], []).append(Example(prompt, r["response"].strip()))
    out = []
    for category in categories:
        examples = list(by_category[category])
        random.Random(f"{seed}:{category}").shuffle(examples)
        n_test = -(-len(examples) // 10)
        out.append((category, examples[n_test:], examples[:n_test]))
    return out


def test_dolly_natural_partition_is_the_papers_split(shared_data):
    source = shared_data / "dolly" / "databricks-dolly-15k.jsonl"
    for seed, categories in ((42, None), (7, ["summarization", "open_qa", "brainstorming"])):
        clients, info = federation("dolly", str(source), categories, seed, None, None, FederationOptions())
        expected = _dolly_by_hand(source, categories or DOLLY_PAPER_CATEGORIES, seed)
        assert [(c.name, c.train, c.test) for c in clients] == expected  # same clients, examples, order
        assert info["partition"] == "natural" and info["partition_by"] == "category"
        assert info["test_set"] == "per_client (seeded 0.1 hold-out)"  # Dolly has no test split of its own
    paper, _ = federation("dolly", str(source), None, 42, None, None, FederationOptions())
    assert [len(c.test) for c in paper] == [214, 178, 151, 119]


def test_flan_natural_partition_is_the_papers_clients(shared_data):
    """Client c: the training records of category c (files K ascending), and test.jsonl's lines of c."""
    source = shared_data / "flan"
    train = [r for k in range(8) for r in json.loads((source / f"local_training_{k}.json").read_text())]
    test = [json.loads(line) for line in (source / "test.jsonl").read_text().splitlines()]

    def of(records, category):
        return [Example(r["instruction"].strip(), r["output"].strip()) for r in records if r["category"] == category]

    for categories in (None, ["word_disambiguation", "coreference"]):
        clients, info = federation("flan", str(source), categories, 42, None, 50, FederationOptions())
        assert [(c.name, c.train, c.test) for c in clients] == \
            [(k, of(train, k), of(test, k)[:50]) for k in categories or FLAN_PAPER_CATEGORIES]
        assert info["test_set"] == "per_client (the source's test split, by label)"


def test_results_json_describes_the_data_only_beyond_the_papers_federations(shared_data):
    """The default options (the natural partition on category: the paper's federations and the
    synthetic tasks) add no `data` entry to results.json, as before issue 59; any other partition
    or your own files do."""
    from pflalign.data.clients import client_shares_described

    for name, source in (("dolly", str(shared_data / "dolly")), ("flan", str(shared_data / "flan")),
                         ("synthetic", None)):
        cfg = build_config(None, {"data": {"name": name, "dir": source, "max_train": 20, "max_test": 5}})
        shares, info = client_shares_described(cfg)
        assert info is None and [(len(s.train), len(s.test)) for s in shares] == [(20, 5)] * 4
        iid = build_config(None, {"data": {"name": name, "dir": source, "max_train": 20, "max_test": 5,
                                           "partition": "iid", "num_clients": 2}})
        assert client_shares_described(iid)[1]["partition"] == "iid"


def test_flan_dirichlet_pools_training_files_and_shares_test_jsonl(shared_data):
    opts = FederationOptions(PartitionSpec("dirichlet", 6, alpha=1.0, seed=42))
    clients, info = federation("flan", str(shared_data / "flan"), FLAN_PAPER_CATEGORIES, 42, None, None, opts)
    assert sum(len(c.train) for c in clients) == 4 * 300
    assert all(len(c.test) == 4 * 200 for c in clients)
    assert info["test_set"] == "global" and info["partition"] == "dirichlet" and info["alpha"] == 1.0


# --- your own files -----------------------------------------------------------------------


def test_every_format_gives_the_same_clients(tmp_path):
    paths = _write_all_formats(tmp_path, _rows())
    results = {fmt: federation("files", str(p), None, 42, None, None, _opts(partition_by="who"))[0]
               for fmt, p in paths.items()}
    first = results["jsonl"]
    assert [c.name for c in first] == ["a", "b", "c"]
    assert all(r == first for r in results.values())
    every = [e for c in first for e in c.train + c.test]
    assert Example("question 1\n\nContext:\ncontext 1", "answer 1") in every
    assert Example("question 0", "answer 0") in every  # empty context: the instruction alone


def test_example_file_columns_and_info():
    table = read_table(str(EXAMPLE), QA, "topic")
    assert len(table.examples) == 24 and sorted(set(table.labels)) == ["arithmetic", "geography", "reading"]
    assert table.info["columns"] == {"instruction": "question", "response": "answer", "context": "passage",
                                     "label": "topic"}
    assert table.examples[1] == Example("What is 2 plus 3?", "5")  # a number cell is text
    assert table.examples[2].prompt.startswith("Which animal does the passage mention?\n\nContext:\nThe cat")


def test_per_client_split_is_seeded_disjoint_and_ceil_of_fraction(tmp_path):
    path = _write_all_formats(tmp_path, _rows(30))["jsonl"]
    opts = _opts(partition_by="who", test_fraction=0.25)
    first, info = federation("files", str(path), None, 1, None, None, opts)
    assert federation("files", str(path), None, 1, None, None, opts)[0] == first
    assert federation("files", str(path), None, 2, None, None, opts)[0] != first
    for c in first:
        assert len(c.test) == 3 and len(c.train) == 7  # ceil(0.25 x 10)
        assert not set(c.train) & set(c.test)
    assert [c["n_test"] for c in info["clients"]] == [3, 3, 3]


def test_global_test_set_is_shared_and_held_out_before_partitioning(tmp_path):
    path = _write_all_formats(tmp_path, _rows(40))["csv"]
    clients, info = federation("files", str(path), None, 42, None, None,
                                     _opts(spec=PartitionSpec("iid", 4, seed=42), test_set="global"))
    test = clients[0].test
    assert len(test) == 4 and all(c.test == test for c in clients)
    train = [e for c in clients for e in c.train]
    assert len(train) == 36 and len(set(train)) == 36 and not set(train) & set(test)
    assert info["test_set"] == "global" and [c.name for c in clients] == [f"client_00{i}" for i in range(4)]


def test_folder_with_test_split_natural_by_label_other_partitions_global(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(12)))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(6, ("b", "a", "c"))))
    clients, info = federation("files", str(folder), None, 42, None, None, _opts(partition_by="who"))
    assert [(c.name, len(c.train), len(c.test)) for c in clients] == [("a", 4, 2), ("b", 4, 2), ("c", 4, 2)]
    assert clients[1].test[0] == Example("question 0", "answer 0")  # test row 0 has label b
    assert info["test_rows"] == 6
    clients, info = federation("files", str(folder), None, 42, None, None,
                                     _opts(partition_by="who", spec=PartitionSpec("iid", 2)))
    assert all(len(c.test) == 6 for c in clients) and info["test_set"] == "global"
    clients, info = federation("files", str(folder), ["c", "a"], 42, None, None,
                                     _opts(partition_by="who", test_set="per_client"))
    assert [c.name for c in clients] == ["c", "a"]
    assert info["dropped"] == {"who not among the clients (data.clients)": 4,
                               "test: the source's test split (data.test_set=per_client)": 4,
                               "test: who not among the clients (data.clients)": 2}


def test_drop_empty_counts_dropped_rows_by_reason(tmp_path):
    rows = _rows(12)
    rows[3]["ans"] = "  "
    rows[5]["q"] = ""
    rows[7]["ans"] = None
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"d.jsonl \(train\) row 4: empty response \(column 'ans'\); .*data.drop_empty"):
        federation("files", str(path), None, 42, None, None, _opts(partition_by="who"))
    clients, info = federation("files", str(path), None, 42, None, None,
                                     _opts(partition_by="who", drop_empty=True))
    assert sum(len(c.train) + len(c.test) for c in clients) == 9
    assert info["dropped"] == {"empty instruction (column 'q')": 1, "empty response (column 'ans')": 2}
    assert info["rows"] == 12


@pytest.mark.parametrize(
    ("content", "kwargs", "match"),
    [
        ("", {}, r"d\.csv is empty"),
        ("q,ans,ctx,who\n", {}, r"has no rows"),
        ("q,answer,ctx,who\nx,y,z,a\n", {}, r"no column 'ans' \(data.columns.response\); its columns are: q, answer, ctx, who"),
        ("q,ans,ctx,who\nx,y,z,a\n", {"partition_by": "topic"}, r"no column 'topic' \(data.partition_by\)"),
        ("q,ans,ctx,who\nx,,z,a\n", {}, r"row 1: empty response \(column 'ans'\)"),
        ("q,ans,ctx,who\nx,y,z,\n", {}, r"row 1: empty label \(column 'who'\)"),
        ("q,ans,ctx,who\nx,y,z,a\nx,y,z,a\n", {"spec": PartitionSpec("iid", 3)}, r"more clients than rows \(2\)"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, content, kwargs, match):
    path = tmp_path / "d.csv"
    path.write_text(content)
    kwargs.setdefault("partition_by", "who")
    with pytest.raises(UserError, match=match) as info:
        federation("files", str(path), None, 42, None, None, _opts(**kwargs))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("column", ["q", "ans", "ctx"])
def test_a_text_field_that_is_not_text_is_refused_with_its_row_and_field(tmp_path, column):
    """Issue 57: every text field is checked as Dolly's are (`dolly.check_text`): a JSON 42 or
    true in the instruction, response or context column is refused, not trained on as "42"."""
    rows = _rows(4)
    rows[2][column] = 42 if column != "ctx" else True
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=rf"d\.jsonl \(train\) row 3: field '{column}' must be a string, got "
                                        rf"{'bool' if column == 'ctx' else 'int'}$") as info:
        federation("files", str(path), None, 42, None, None, _opts(partition_by="who"))
    assert "\n" not in str(info.value)


def test_a_csv_cell_is_the_text_it_holds_and_a_label_may_be_a_number(tmp_path):
    """CSV has no types (its reader guesses numbers): its cells are used as text (a number as its
    reader parsed it: 1.50 is "1.5", as before). A label column (partition_by) may hold numbers
    in any format: class ids are labels."""
    path = tmp_path / "d.csv"
    path.write_text("q,ans,ctx,who\nwhat is 6x7,42,,1\nprice,1.50,in euros,2\n")
    table = read_table(str(path), Columns("q", "ans", "ctx"), "who")
    assert [(e.prompt, e.response) for e in table.examples] == [("what is 6x7", "42"),
                                                               ("price\n\nContext:\nin euros", "1.5")]
    assert table.labels == ["1", "2"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"q": "x", "ans": "y", "who": 7}) + "\n")
    assert read_table(str(jsonl), Columns("q", "ans"), "who").labels == ["7"]


@pytest.mark.parametrize(("name", "content", "match"), [
    ("d.jsonl", '{"instruction": "x"\n', r"d\.jsonl: cannot read it as a dataset \(ArrowInvalid: JSON parse error: "
                                       r"Missing a comma .* in row 0\)$"),
    ("d.csv", b"\xff\xfe\x00garbage", r"d\.csv: cannot read it as a dataset \(UnicodeDecodeError: 'utf-8' codec "),
])
def test_an_unreadable_file_names_the_files_own_error_in_one_line(tmp_path, capfd, name, content, match):
    # not datasets' wrapper ("DatasetGenerationError: An error occurred while generating the dataset"),
    # and not its builder's log line beside ours
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=match) as info:
        federation("files", str(path), None, 42, None, None, _opts(spec=PartitionSpec("iid", 2)))
    assert "\n" not in str(info.value)
    assert "Failed to load" not in capfd.readouterr().err


def test_missing_or_unsupported_source_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="data file not found"):
        read_table(str(tmp_path / "absent.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(UserError, match=r"unsupported file type '\.txt'"):
        read_table(str(tmp_path / "d.txt"))

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/qa' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"'someone/qa' is not a local file or folder, and the Hugging Face Hub is "
                                        r"not reachable \(HF_HUB_OFFLINE is set\)"):
        read_table("someone/qa")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("pflalign.data.files._hub_unreachable", lambda: None)  # as if online, then it fails
    with pytest.raises(UserError, match=r"'someone/qa' is not a local file or folder, and loading it as a Hugging "
                                        r"Face hub dataset failed \(Couldn't reach") as info:
        read_table("someone/qa")
    assert "\n" not in str(info.value)


# --- config and command line --------------------------------------------------------------


def test_config_keys_reach_the_loader():
    cfg = build_config(None, parse_set([
        "data.name=files", "data.dir=x.csv", "data.columns.instruction=question", "data.columns.context=passage",
        "data.partition=dirichlet", "data.num_clients=5", "data.alpha=0.3", "data.partition_by=topic",
        "data.test_set=global",
    ]))
    opts = FederationOptions.from_config(cfg.data)
    assert opts.columns == Columns("question", "response", "passage")
    assert opts.partition == PartitionSpec("dirichlet", 5, 0.3, None, None, 42)
    assert opts.test_set == "global" and not opts.is_default()
    assert FederationOptions.from_config(build_config().data).is_default()


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["data.alpha=-1", "data.partition=dirichlet", "data.num_clients=3"], "data.alpha must be a finite number > 0"),
        (["data.alpha=NaN", "data.partition=dirichlet", "data.num_clients=3"], "data.alpha must be a finite number"),
        (["data.partition=iid", "data.num_clients=0"], "data.num_clients must be a positive integer"),
        (["data.test_fraction=0"], r"data.test_fraction must be a number in \(0, 1\)"),
        (["data.test_fraction=1"], r"data.test_fraction must be a number in \(0, 1\)"),
        (["data.test_fraction=NaN"], r"data.test_fraction must be a (number in \(0, 1\)|finite number)"),
        (["data.test_set=shared"], "data.test_set must be one of auto, per_client, global"),
        (["data.partition_by=task"], "data.partition_by for synthetic can only be 'category'"),
        (["data.name=dolly", "data.columns.instruction=q"], "data.columns applies to data.name=files"),
        (["data.name=files", "data.dir=x.csv"], "data.partition=natural makes one client per value of a column"),
        (["data.columns.instruction="], "data.columns.instruction must be a column name"),
        (["data.columns.promt=x"], "unknown config key 'data.columns.promt'"),
    ],
)
def test_bad_data_config_values_are_one_line_errors(items, match):
    with pytest.raises(UserError, match=match):
        build_config(None, parse_set(items))


def _docs_command() -> list[str]:
    text = (REPO / "docs" / "usage.md").read_text()
    section = text.split("## Bring your own data", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[0] == "pflalign"
    return argv[1:]


def test_docs_bring_your_own_data_example_runs_as_written(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(REPO)  # the command's paths are relative to the repository root
    argv = _docs_command()
    out = tmp_path / "byod"
    argv[argv.index("--out") + 1] = str(out)
    caplog.set_level("INFO")
    assert main([*argv, "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [c["task"] for c in results["clients"]] == ["geography", "arithmetic", "reading"]
    data = results["data"]
    assert data["columns"] == {"instruction": "question", "response": "answer", "context": "passage", "label": "topic"}
    assert data["dropped"] == {} and data["rows"] == 24 and data["partition"] == "natural"
    assert "columns instruction=question, response=answer, context=passage, label=topic; 24 rows" in caplog.text


def test_cli_bad_own_data_exit_2_nothing_written(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(EXAMPLE.read_text().replace(",Paris,", ",,", 1))
    argv = [arg.replace("docs/examples/qa.csv", str(bad)) for arg in _docs_command()]
    argv[argv.index("--out") + 1] = str(tmp_path / "run")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("row 1: empty response (column 'answer'); fix the data or set data.drop_empty=true "
                        "to drop such rows") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_flower_app_names_the_clients_of_every_federation():
    """Flower's partition-id k is the k-th client: the ServerApp names them from the config, or,
    for a natural partition of your own files without data.clients, from the data on its host."""
    pytest.importorskip("flwr")
    from pflalign.flower import wire
    from pflalign.data.clients import client_shares, names_from_config

    def cfg(*items):
        return build_config(None, parse_set(list(items)))

    assert wire.client_names(cfg("data.name=dolly")) == DOLLY_PAPER_CATEGORIES
    assert wire.client_names(cfg("data.name=dolly", "data.partition=iid", "data.num_clients=3")) == \
        ["client_000", "client_001", "client_002"]
    assert wire.client_names(cfg("data.name=flan", "data.test_set=global")) == FLAN_PAPER_CATEGORIES
    qa = ["data.name=files", f"data.dir={EXAMPLE}", "data.columns.instruction=question",
          "data.columns.response=answer", "data.partition_by=topic"]
    assert wire.client_names(cfg(*qa, "data.clients=reading,arithmetic")) == ["reading", "arithmetic"]
    assert names_from_config(cfg(*qa)) is None  # the topics are in the file
    assert wire.client_names(cfg(*qa)) == [s.name for s in client_shares(cfg(*qa))] and \
        sorted(wire.client_names(cfg(*qa))) == ["arithmetic", "geography", "reading"]
    with pytest.raises(UserError, match=r"reading data.dir on its host, and could not: .*x.csv.*data.clients=a,b"):
        wire.client_names(cfg("data.name=files", "data.dir=x.csv", "data.partition_by=topic"))


def test_data_seed_draws_the_partition_and_defaults_to_split_seed(tmp_path):
    """data.seed unset: the partition of every earlier run (seeded by data.split_seed); set, it
    alone draws the partition (split_seed still draws each client's test hold-out)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in _rows(40)))
    base = ["data.name=files", f"data.dir={rows}", "data.columns.instruction=q", "data.columns.response=ans",
            "data.partition=iid", "data.num_clients=4"]

    def shares(*items):
        from pflalign.data.clients import client_shares

        return client_shares(build_config(None, parse_set(base + list(items))))

    def rows_of(federation):  # each client's examples, train and test together
        return [sorted(e.prompt for e in s.train + s.test) for s in federation]

    assert shares() == shares("data.seed=42") == shares("data.split_seed=42", "data.seed=42")
    assert rows_of(shares("data.seed=7")) != rows_of(shares())
    assert rows_of(shares("data.seed=7", "data.split_seed=1")) == rows_of(shares("data.seed=7"))
    assert rows_of(shares("data.split_seed=1")) != rows_of(shares())  # unset: split_seed draws it, as before
    with pytest.raises(UserError, match="data.partition=natural draws nothing"):
        build_config(None, parse_set(["data.name=dolly", "data.seed=3"]))


def test_after_partitioning_one_table_gives_each_clients_size_and_label_mix(tmp_path, caplog):
    """Issue 42: each client's training examples counted by label (after the test hold-out and
    max_train), in results.json's data info and in one logged table."""
    import logging

    rows = _rows(90, labels=("a", "b", "c"))
    path = _write_all_formats(tmp_path, rows)["jsonl"]
    label_of_prompt = {}
    for r in rows:
        label_of_prompt[r["q"] + (f"\n\nContext:\n{r['ctx']}" if r["ctx"] else "")] = r["who"]
    opts = _opts(partition_by="who", spec=PartitionSpec("dirichlet", 3, 0.3, None, None, 7))
    with caplog.at_level(logging.INFO, logger="pflalign.data.federate"):
        clients, info = federation("files", str(path), None, 42, 20, None, opts)
    table = [m for m in caplog.messages if m.startswith("client ")]
    assert len(table) == 1
    lines = table[0].splitlines()
    assert lines[0].split() == ["client", "n_train", "n_test", "who", "mix", "(share", "of", "n_train)"]
    skewed = False
    for client, described, line in zip(clients, info["clients"], lines[1:], strict=True):
        expected = Counter(label_of_prompt[e.prompt] for e in client.train)  # counted here from the rows
        assert described["labels"] == dict(expected) and sum(expected.values()) == len(client.train) <= 20
        top, n = expected.most_common(1)[0]
        assert line.startswith(f"{client.name}  ") and f"{top} {100 * n / len(client.train):.0f}%" in line
        assert line.split()[1:3] == [str(len(client.train)), str(len(client.test))]
        skewed |= n / len(client.train) > 0.5
    assert skewed  # alpha 0.3: not vacuous, some client is dominated by one label


def test_labelled_client_names_carry_the_most_common_label_and_change_nothing_else(tmp_path, caplog):
    """Issue 42: data.client_names=labelled names client k `client_00k-<its most common training
    label>` (in the mix table, results.json and everything that reads the names); the clients'
    examples are the numbered ones' (the test hold-outs stay seeded by the plain name)."""
    import logging

    from pflalign.data.clients import client_names, client_shares

    path = _write_all_formats(tmp_path, _rows(90, labels=("a", "b", "c")))["jsonl"]
    spec = PartitionSpec("dirichlet", 3, 0.3, None, None, 7)
    numbered, _ = federation("files", str(path), None, 42, None, None,
                                   _opts(partition_by="who", spec=spec, test_set="per_client"))
    with caplog.at_level(logging.INFO, logger="pflalign.data.federate"):
        labelled, info = federation("files", str(path), None, 42, None, None,
                                          _opts(partition_by="who", spec=spec, test_set="per_client",
                                                client_names="labelled"))
    for k, (plain, named) in enumerate(zip(numbered, labelled, strict=True)):
        assert (named.train, named.test) == (plain.train, plain.test)  # the same rows
        label = Counter(info["clients"][k]["labels"]).most_common(1)[0][0]
        assert named.name == f"client_{k:03d}-{label}" == info["clients"][k]["name"]
    table = next(m for m in caplog.messages if m.startswith("client "))
    assert [line.split()[0] for line in table.splitlines()[1:]] == [c.name for c in labelled]
    # through the config: the names are read off the data; the default's config.json stays as it was
    sets = ["data.name=files", f"data.dir={path}", "data.columns.instruction=q", "data.columns.response=ans",
            "data.partition=dirichlet", "data.num_clients=3", "data.alpha=0.3", "data.seed=7", "data.partition_by=who"]
    cfg = build_config(None, parse_set(sets + ["data.client_names=labelled"]))
    assert client_names(cfg) == [s.name for s in client_shares(cfg)] and client_names(cfg)[0].startswith("client_000-")
    from pflalign.config import to_dict

    assert "client_names" not in to_dict(build_config(None, parse_set(sets)))["data"]
    assert to_dict(cfg)["data"]["client_names"] == "labelled"


@pytest.mark.parametrize("sets, match", [
    (["data.name=dolly", "data.client_names=labelled"], "already is one label"),
    (["data.name=files", "data.partition=iid", "data.num_clients=2", "data.client_names=labelled"], "partition_by"),
    (["data.name=files", "data.partition=iid", "data.num_clients=2", "data.client_names=label"], "numbered or labelled"),
])
def test_labelled_client_names_are_refused_where_no_label_names_a_client(sets, match):
    with pytest.raises(UserError, match=match):
        build_config(None, parse_set(sets))


def test_mix_table_shows_the_first_clients_and_says_how_many_more():
    from pflalign.data.federate import mix_table

    clients = [{"name": f"client_{k:03d}", "n_train": 4, "n_test": 1, "labels": {"x": 3, "y": 1}} for k in range(25)]
    text = mix_table(clients, "topic", rows=20, top=1)
    assert text.splitlines()[1] == "client_000        4       1  x 75%, +1 more"
    assert text.splitlines()[-1] == "... 5 more clients (results.json: data.clients)" and len(text.splitlines()) == 22
    plain = [{"name": "client_000", "n_train": 4, "n_test": 1}]  # no label column (an iid split of unlabelled rows)
    assert mix_table(plain, None).splitlines() == ["client      n_train  n_test", "client_000        4       1"]
