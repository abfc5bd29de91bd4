"""Tests for the datasets' clients: Dolly, FLAN and the synthetic tasks, each read as a table and
made into clients by the one path (`pflalign.data.federate.federation`: the natural partition on
category, the dataset's test rule)."""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pflalign.data import ClientShare, Example
from pflalign.data.dolly import DOLLY_CATEGORIES, dolly_table
from pflalign.data.dolly import PAPER_CATEGORIES as DOLLY_PAPER
from pflalign.data.federate import FederationOptions, federation
from pflalign.data.flan import FLAN_CATEGORIES
from pflalign.data.flan import PAPER_CATEGORIES as FLAN_PAPER
from pflalign.data.synthetic import SYNTHETIC_TASKS, make_synthetic
from pflalign.errors import UserError

PAPER_DOLLY_SIZES = {  # category: (n, train, test) -- test = ceil(10% of n)
    "classification": (2136, 1922, 214),
    "closed_qa": (1773, 1595, 178),
    "information_extraction": (1506, 1355, 151),
    "summarization": (1188, 1069, 119),
}
DOLLY_PAPER_CATEGORIES = list(DOLLY_PAPER)
FLAN_PAPER_CATEGORIES = list(FLAN_PAPER)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ----------------------------------------------------------------------------


def clients_of(name: str, source: str | None, categories: list[str] | None, split_seed: int = 42,
               max_train: int | None = None, max_test: int | None = None) -> list[ClientShare]:
    """Dataset `name`'s clients with the default options: the natural partition on category
    (`categories`; None: the dataset's default clients) and its test rule."""
    return federation(name, source, categories, split_seed, max_train, max_test, FederationOptions())[0]


def dolly_clients(source: str, categories: list[str] | None, split_seed: int = 42,
                  max_train: int | None = None, max_test: int | None = None) -> list[ClientShare]:
    return clients_of("dolly", source, categories, split_seed, max_train, max_test)


def flan_clients(directory: str, categories: list[str] | None, max_train: int | None = None,
                 max_test: int | None = None) -> list[ClientShare]:
    return clients_of("flan", directory, categories, 42, max_train, max_test)


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def dolly_record(instruction: str, response: str, category: str, context: str = "") -> dict:
    return {
        "instruction": instruction,
        "context": context,
        "response": response,
        "category": category,
    }


def flan_record(instruction: str, output: str, category: str) -> dict:
    return {"instruction": instruction, "output": output, "task": "t", "category": category}


def write_flan_dir(root: Path, training: dict[int, list[dict]], test: list[dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for k, records in training.items():
        (root / f"local_training_{k}.json").write_text(json.dumps(records), encoding="utf-8")
    write_jsonl(root / "test.jsonl", test)
    return root


def raise_user_error(call, *fragments: str) -> str:
    """Run `call`, expect a one-line `UserError` containing every fragment; return its message."""
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def expected_dolly_examples(dolly_file: Path, category: str) -> list[Example]:
    """The category's examples, parsed here independently of the loader."""
    examples = []
    for line in dolly_file.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["category"] == category:
            instruction, context = record["instruction"].strip(), record["context"].strip()
            prompt = f"{instruction}\n\nContext:\n{context}" if context else instruction
            examples.append(Example(prompt, record["response"].strip()))
    return examples


# --- Dolly on the real data -------------------------------------------------------------


@pytest.fixture(scope="module")
def dolly_file(shared_data: Path) -> Path:
    return shared_data / "dolly" / "databricks-dolly-15k.jsonl"


@pytest.fixture(scope="module")
def dolly_paper(dolly_file: Path) -> list[ClientShare]:
    return dolly_clients(str(dolly_file), DOLLY_PAPER_CATEGORIES)


def test_dolly_paper_split_sizes(dolly_paper: list[ClientShare]) -> None:
    assert [client.name for client in dolly_paper] == DOLLY_PAPER_CATEGORIES
    sizes = {client.name: (len(client.train), len(client.test)) for client in dolly_paper}
    assert sizes == {
        category: (train, test) for category, (_, train, test) in PAPER_DOLLY_SIZES.items()
    }


def test_dolly_splits_are_disjoint_and_cover_the_category(
    dolly_paper: list[ClientShare], dolly_file: Path
) -> None:
    for client in dolly_paper:
        expected = expected_dolly_examples(dolly_file, client.name)
        assert len(expected) == PAPER_DOLLY_SIZES[client.name][0]
        assert Counter(client.train) + Counter(client.test) == Counter(expected)
        # Only records that occur twice in the file (closed_qa has 4) may be on both sides.
        duplicated = {example for example, count in Counter(expected).items() if count > 1}
        assert set(client.train) & set(client.test) <= duplicated


def test_dolly_same_seed_same_split_other_seed_other_split(
    dolly_paper: list[ClientShare], dolly_file: Path
) -> None:
    again = dolly_clients(str(dolly_file), DOLLY_PAPER_CATEGORIES, split_seed=42)
    assert again == dolly_paper
    other = dolly_clients(str(dolly_file), DOLLY_PAPER_CATEGORIES, split_seed=7)
    for ours, theirs in zip(dolly_paper, other, strict=True):
        assert (len(ours.train), len(ours.test)) == (len(theirs.train), len(theirs.test))
        assert set(ours.test) != set(theirs.test)


def test_dolly_category_split_does_not_depend_on_other_categories(
    dolly_paper: list[ClientShare], dolly_file: Path
) -> None:
    (alone,) = dolly_clients(str(dolly_file.parent), ["summarization"])  # a directory works too
    assert alone == dolly_paper[3]
    reordered = dolly_clients(str(dolly_file), list(reversed(DOLLY_PAPER_CATEGORIES)))
    assert reordered == list(reversed(dolly_paper))


def test_dolly_prompts_carry_context_only_when_present(
    dolly_paper: list[ClientShare], dolly_file: Path
) -> None:
    records = [json.loads(line) for line in dolly_file.read_text(encoding="utf-8").splitlines()]
    for client in dolly_paper:
        with_context = sum(
            1 for r in records if r["category"] == client.name and r["context"].strip()
        )
        prompts = [example.prompt for example in client.train + client.test]
        assert sum("\n\nContext:\n" in prompt for prompt in prompts) == with_context
    assert sum(r["context"].strip() != "" for r in records if r["category"] == "closed_qa") == 1773


def test_dolly_prompt_format(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            dolly_record(
                "  Summarize this. ", " Short. \n", "summarization", context="\n Long text.  "
            ),
            dolly_record("Name a fruit.", "Apple", "summarization", context="   "),
            {"instruction": "No context key", "response": "ok", "category": "summarization"},
        ],
    )
    (client,) = dolly_clients(str(path), ["summarization"])
    assert sorted(client.train + client.test, key=lambda e: e.response) == [
        Example("Name a fruit.", "Apple"),
        Example("Summarize this.\n\nContext:\nLong text.", "Short."),
        Example("No context key", "ok"),
    ]
    assert len(client.test) == 1 and len(client.train) == 2  # ceil(3 / 10) = 1


def test_dolly_max_train_max_test_keep_the_first_n(
    dolly_paper: list[ClientShare], dolly_file: Path
) -> None:
    small = dolly_clients(str(dolly_file), DOLLY_PAPER_CATEGORIES, max_train=5, max_test=3)
    for full, cut in zip(dolly_paper, small, strict=True):
        assert cut.train == full.train[:5] and cut.test == full.test[:3]
    (only_train_cut,) = dolly_clients(str(dolly_file), ["closed_qa"], max_train=10)
    assert (len(only_train_cut.train), len(only_train_cut.test)) == (10, 178)
    (zero,) = dolly_clients(str(dolly_file), ["closed_qa"], max_test=0)
    assert zero.test == []


# --- Dolly from the hub (mocked: tests never touch the network) -------------------------


def test_dolly_hub_id_downloads_the_jsonl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub

    local = write_jsonl(tmp_path / "dl.jsonl", [dolly_record("Q?", "A", "open_qa")])
    calls = []

    def fake_download(repo_id: str, filename: str, **kwargs: object) -> str:
        calls.append((repo_id, filename, kwargs))
        return str(local)

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    table = dolly_table("databricks/databricks-dolly-15k")
    assert table.examples == [Example("Q?", "A")] and table.labels == ["open_qa"]
    assert calls == [
        ("databricks/databricks-dolly-15k", "databricks-dolly-15k.jsonl", {"repo_type": "dataset"})
    ]


def test_dolly_unreachable_hub_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise ConnectionError("Max retries exceeded\nwith a second line")

    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    raise_user_error(
        lambda: dolly_clients("databricks/databricks-dolly-15k", ["closed_qa"]),
        "unreachable",
        "local file",
    )
    raise_user_error(
        lambda: clients_of("dolly", None, None, 42, None, None), "unreachable", "--data-dir"
    )


# --- Dolly errors -------------------------------------------------------------------------


def test_dolly_missing_file(tmp_path: Path) -> None:
    raise_user_error(
        lambda: dolly_clients(str(tmp_path / "nope.jsonl"), ["closed_qa"]), "nope.jsonl", "not found"
    )
    raise_user_error(
        lambda: dolly_clients(str(tmp_path), ["closed_qa"]), "databricks-dolly-15k.jsonl", "not found"
    )


def test_dolly_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps(dolly_record("a", "b", "closed_qa")) + "\n\n{not json\n", encoding="utf-8"
    )
    raise_user_error(lambda: dolly_clients(str(path), ["closed_qa"]), f"{path}:3", "not valid JSON")
    path.write_text('["a list"]\n', encoding="utf-8")
    raise_user_error(lambda: dolly_clients(str(path), ["closed_qa"]), f"{path}:1", "JSON object")
    path.write_bytes(b'{"instruction": "caf\xe9"}\n')
    raise_user_error(lambda: dolly_clients(str(path), ["closed_qa"]), f"{path}:1", "UTF-8")


@pytest.mark.parametrize("field", ["instruction", "response", "category"])
def test_dolly_missing_field_names_file_line_and_field(tmp_path: Path, field: str) -> None:
    broken = dolly_record("a", "b", "closed_qa")
    del broken[field]
    path = write_jsonl(tmp_path / "d.jsonl", [dolly_record("x", "y", "closed_qa"), broken])
    raise_user_error(lambda: dolly_clients(str(path), ["closed_qa"]), f"{path}:2", repr(field))


def test_dolly_non_string_field(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"instruction": 3, "response": "b", "category": "closed_qa"}]
    )
    raise_user_error(
        lambda: dolly_clients(str(path), ["closed_qa"]), f"{path}:1", "'instruction'", "string"
    )


def test_dolly_category_errors(dolly_file: Path, tmp_path: Path) -> None:
    message = raise_user_error(
        lambda: dolly_clients(str(dolly_file), ["sumarization"]), "'sumarization'"
    )
    assert "Did you mean 'summarization'?" in message
    assert all(category in message for category in DOLLY_CATEGORIES)
    path = write_jsonl(tmp_path / "d.jsonl", [dolly_record("a", "b", "classification")])
    raise_user_error(lambda: dolly_clients(str(path), ["closed_qa"]), "no example in", str(path), "'closed_qa'",
                     "values there: classification")
    raise_user_error(lambda: dolly_clients(str(path), []), "data.clients is empty")
    raise_user_error(lambda: dolly_clients(str(path), ["classification", "classification"]), "twice")
    # one example: ceil(10%) of it is the test set, which would leave it nothing to train on
    raise_user_error(lambda: dolly_clients(str(path), ["classification"]), "'classification' has 1 rows",
                     "too few to hold out a test set")
    raise_user_error(lambda: dolly_clients(str(path), ["classification"], max_train=-1), "max_train")


# --- FLAN on the real data ----------------------------------------------------------------


@pytest.fixture(scope="module")
def flan_dir(shared_data: Path) -> Path:
    return shared_data / "flan"


@pytest.fixture(scope="module")
def flan_raw(flan_dir: Path) -> tuple[list[dict], list[dict]]:
    """All training records (files K = 0..7 in order) and all test records, parsed here."""
    train = [
        r for k in range(8) for r in json.loads((flan_dir / f"local_training_{k}.json").read_text())
    ]
    test = [json.loads(line) for line in (flan_dir / "test.jsonl").read_text().splitlines()]
    return train, test


def flan_examples(records: list[dict], category: str) -> list[Example]:
    return [
        Example(r["instruction"].strip(), r["output"].strip())
        for r in records
        if r["category"] == category
    ]


def test_flan_paper_clients(flan_dir: Path) -> None:
    clients = flan_clients(str(flan_dir), FLAN_PAPER_CATEGORIES)
    assert [client.name for client in clients] == FLAN_PAPER_CATEGORIES
    assert [(len(c.train), len(c.test)) for c in clients] == [(300, 200)] * 4


def test_flan_all_categories_match_the_files(
    flan_dir: Path, flan_raw: tuple[list[dict], list[dict]]
) -> None:
    raw_train, raw_test = flan_raw
    clients = flan_clients(str(flan_dir), list(FLAN_CATEGORIES))
    assert len(clients) == 8
    for client in clients:
        assert client.train == flan_examples(raw_train, client.name)
        assert client.test == flan_examples(raw_test, client.name)
        assert (len(client.train), len(client.test)) == (300, 200)
    # the coreference client really holds coreference questions
    assert all("OPTIONS" in example.prompt for example in clients[0].train)


@pytest.mark.parametrize(
    "categories",
    [["word_disambiguation"], ["text_formatting", "coreference"], list(reversed(FLAN_CATEGORIES))],
)
def test_flan_any_subset_in_any_order(flan_dir: Path, categories: list[str]) -> None:
    full = {client.name: client for client in flan_clients(str(flan_dir), list(FLAN_CATEGORIES))}
    assert flan_clients(str(flan_dir), categories) == [full[category] for category in categories]


def test_flan_max_train_max_test(flan_dir: Path) -> None:
    full = flan_clients(str(flan_dir), ["entailment"])[0]
    (cut,) = flan_clients(str(flan_dir), ["entailment"], max_train=7, max_test=2)
    assert cut.train == full.train[:7] and cut.test == full.test[:2]


def test_flan_file_to_category_map_is_read_not_assumed(tmp_path: Path) -> None:
    root = write_flan_dir(
        tmp_path / "flan",
        {
            0: [flan_record(" P1 ", " yes ", "paraphrase")],
            1: [flan_record("C1", "him", "coreference")],
        },
        [flan_record("C2", "her", "coreference"), flan_record("P2", "no", "paraphrase")],
    )
    para, coref = flan_clients(str(root), ["paraphrase", "coreference"])
    assert para == ClientShare("paraphrase", [Example("P1", "yes")], [Example("P2", "no")])
    assert coref == ClientShare("coreference", [Example("C1", "him")], [Example("C2", "her")])


# --- FLAN errors --------------------------------------------------------------------------


def test_flan_missing_directory_and_files(tmp_path: Path) -> None:
    raise_user_error(
        lambda: flan_clients(str(tmp_path / "none"), ["coreference"]), "none", "not found"
    )
    raise_user_error(lambda: flan_clients(str(tmp_path), ["coreference"]), "local_training_")
    (tmp_path / "local_training_0.json").write_text(
        json.dumps([flan_record("a", "b", "coreference")])
    )
    raise_user_error(lambda: flan_clients(str(tmp_path), ["coreference"]), "test.jsonl", "not found")


def test_flan_malformed_files_name_file_and_line(tmp_path: Path) -> None:
    root = write_flan_dir(tmp_path, {0: [flan_record("a", "b", "coreference")]}, [])
    training = root / "local_training_0.json"
    training.write_text('[\n{"instruction": "a",\n oops}\n]')
    raise_user_error(
        lambda: flan_clients(str(root), ["coreference"]), f"{training}:3", "not valid JSON"
    )
    training.write_text('{"instruction": "a"}')
    raise_user_error(lambda: flan_clients(str(root), ["coreference"]), str(training), "JSON list")
    training.write_text(json.dumps([flan_record("a", "b", "coreference")]))
    test = root / "test.jsonl"
    test.write_text(json.dumps(flan_record("c", "d", "coreference")) + "\n[1, 2\n")
    raise_user_error(lambda: flan_clients(str(root), ["coreference"]), f"{test}:2", "not valid JSON")


@pytest.mark.parametrize("field", ["instruction", "output"])
def test_flan_missing_field(tmp_path: Path, field: str) -> None:
    broken = flan_record("a", "b", "coreference")
    del broken[field]
    root = write_flan_dir(tmp_path, {0: [flan_record("x", "y", "coreference"), broken]}, [])
    raise_user_error(
        lambda: flan_clients(str(root), ["coreference"]), "local_training_0.json item 1", repr(field)
    )
    write_flan_dir(
        tmp_path,
        {0: [flan_record("x", "y", "coreference")]},
        [flan_record("x", "y", "coreference"), broken],
    )
    raise_user_error(
        lambda: flan_clients(str(root), ["coreference"]), f"{root / 'test.jsonl'}:2", repr(field)
    )


def test_flan_category_errors(flan_dir: Path, tmp_path: Path) -> None:
    message = raise_user_error(lambda: flan_clients(str(flan_dir), ["corefrence"]), "'corefrence'")
    assert "Did you mean 'coreference'?" in message
    assert all(category in message for category in FLAN_CATEGORIES)
    root = write_flan_dir(
        tmp_path, {0: [flan_record("a", "b", "coreference")]}, [flan_record("a", "b", "entailment")]
    )
    raise_user_error(
        lambda: flan_clients(str(root), ["coreference"]), "'coreference'", "no test rows"
    )
    raise_user_error(
        lambda: flan_clients(str(root), ["entailment"]), "no example in", "'entailment'", "values there: coreference"
    )
    raise_user_error(lambda: flan_clients(str(root), []), "data.clients is empty")


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_is_deterministic_with_four_distinct_tasks() -> None:
    clients = make_synthetic()
    assert SYNTHETIC_TASKS == ("arithmetic", "sorting", "uppercase", "key_value")
    assert [client.name for client in clients] == list(SYNTHETIC_TASKS)
    assert [(len(c.train), len(c.test)) for c in clients] == [(64, 16)] * 4
    assert make_synthetic() == clients
    assert make_synthetic(seed=1) != clients
    assert make_synthetic(n_train=10, n_test=3, seed=5) == make_synthetic(
        n_train=10, n_test=3, seed=5
    )
    prefixes = {
        client.name: {e.prompt.split(":")[0].split(" ")[0] for e in client.train}
        for client in clients
    }
    assert prefixes == {
        "arithmetic": {"What"},
        "sorting": {"Sort"},
        "uppercase": {"Rewrite"},
        "key_value": {"Extract"},
    }


def check_synthetic_answers(clients: list[ClientShare]) -> None:
    """Every synthetic answer is right, short, and no prompt is in both train and test."""
    for client in clients:
        assert not {e.prompt for e in client.train} & {e.prompt for e in client.test}
        for example in client.train + client.test:
            assert 0 < len(example.response.split()) <= 20
            if client.name == "arithmetic":
                a, op, b = re.fullmatch(
                    r"What is (\d+) (plus|minus) (\d+)\?", example.prompt
                ).groups()
                assert int(example.response) == (
                    int(a) + int(b) if op == "plus" else int(a) - int(b)
                )
            elif client.name == "sorting":
                listed = example.prompt.removeprefix("Sort these numbers in ascending order: ")
                numbers = [int(n) for n in listed.split(", ")]
                assert [int(n) for n in example.response.split(", ")] == sorted(numbers)
                assert 3 <= len(numbers) <= 6
            elif client.name == "uppercase":
                phrase = example.prompt.removeprefix("Rewrite in capital letters: ")
                assert example.response == phrase.upper() and phrase.islower()
            else:
                sentence = example.prompt.removeprefix("Extract the name and the city as JSON: ")
                answer = json.loads(example.response)
                assert list(answer) == ["name", "city"]
                assert answer["name"] in sentence and answer["city"] in sentence


def test_synthetic_answers_are_correct() -> None:
    clients = make_synthetic(n_train=300, n_test=100)
    check_synthetic_answers(clients)
    templates = {re.sub(r"[A-Z][a-z]+", "X", e.prompt) for e in clients[3].train}
    assert len(templates) >= 4  # several sentence shapes, not one


@FAST
@given(seed=st.integers(-(2**40), 2**40), n_train=st.integers(0, 40), n_test=st.integers(0, 20))
def test_synthetic_property(seed: int, n_train: int, n_test: int) -> None:
    clients = make_synthetic(n_train, n_test, seed)
    assert [(len(c.train), len(c.test)) for c in clients] == [(n_train, n_test)] * 4
    check_synthetic_answers(clients)


def test_synthetic_is_a_table_like_any_other() -> None:
    """Its tasks are the labels and its own test split the table's test rows: the natural partition
    gives each task's examples, and any other partition applies (a global test set of every task's)."""
    from pflalign.data.partition import PartitionSpec
    from pflalign.data.synthetic import synthetic_table

    table = synthetic_table(None, 3, 5, 2)
    tasks = make_synthetic(5, 2, 3)
    assert table.examples == [e for t in tasks for e in t.train]
    assert table.labels == [t.name for t in tasks for _ in range(5)]
    assert table.test_examples == [e for t in tasks for e in t.test]
    iid, info = federation("synthetic", None, None, 3, 5, 2, FederationOptions(PartitionSpec("iid", 2)))
    assert [len(c.train) for c in iid] == [5, 5] and all(c.test == table.test_examples[:2] for c in iid)
    assert sorted(e.prompt for c in iid for e in c.train) != sorted(e.prompt for e in table.examples[:10])
    assert info["test_set"] == "global" and info["rows"] == 20


def test_synthetic_bad_sizes() -> None:
    raise_user_error(lambda: make_synthetic(n_train=-1), "n_train")
    raise_user_error(lambda: make_synthetic(n_train=5000), "at most")


# --- every dataset ----------------------------------------------------------------------


def test_clients_of_synthetic() -> None:
    clients = clients_of("synthetic", None, None, 0, None, None)
    assert clients == make_synthetic(64, 16, 0)
    subset = clients_of("synthetic", "", ["uppercase", "arithmetic"], 3, 5, 2)
    full = make_synthetic(5, 2, 3)
    assert subset == [full[2], full[0]]
    raise_user_error(
        lambda: clients_of("synthetic", "data/", None, 0, None, None), "no data source"
    )
    message = raise_user_error(
        lambda: clients_of("synthetic", None, ["sortin"], 0, None, None), "'sortin'"
    )
    assert "Did you mean 'sorting'?" in message
    raise_user_error(
        lambda: clients_of("synthetic", None, [], 0, None, None), "data.clients is empty"
    )


def test_clients_of_real_data_defaults(shared_data: Path) -> None:
    flan = clients_of("flan", str(shared_data / "flan"), None, 42, 3, 2)
    assert [c.name for c in flan] == FLAN_PAPER_CATEGORIES
    assert [(len(c.train), len(c.test)) for c in flan] == [(3, 2)] * 4
    dolly = clients_of("dolly", str(shared_data / "dolly"), None, 42, None, None)
    assert [c.name for c in dolly] == DOLLY_PAPER_CATEGORIES
    assert [len(c.test) for c in dolly] == [214, 178, 151, 119]
    (one,) = clients_of("dolly", str(shared_data / "dolly"), ["open_qa"], 42, None, None)
    assert (len(one.train), len(one.test)) == (3742 - 375, 375)


def test_clients_of_errors() -> None:
    raise_user_error(lambda: clients_of("flan", None, None, 42, None, None), "--data-dir")
    message = raise_user_error(
        lambda: clients_of("dolyy", None, None, 42, None, None), "'dolyy'"
    )
    assert "Did you mean 'dolly'?" in message and "synthetic" in message


# --- property tests for the parsers -------------------------------------------------------

text = st.text(max_size=30)
some_categories = st.sampled_from(["classification", "closed_qa", "my_own_category"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(text, children, max_size=3),
    max_leaves=8,
)
field_names = st.sampled_from(["instruction", "context", "response", "output", "category", "task"])
record_like = st.dictionaries(field_names, json_values | some_categories, max_size=6)
garbage_line = st.one_of(
    st.binary(max_size=40),
    json_values.map(lambda value: json.dumps(value).encode()),
    record_like.map(lambda value: json.dumps(value).encode()),
)


@FAST
@given(
    records=st.lists(st.tuples(text, text, text, some_categories), min_size=1, max_size=25),
    seed=st.integers(),
)
def test_dolly_valid_records_round_trip(
    records: list[tuple[str, str, str, str]], seed: int
) -> None:
    categories = sorted({category for *_, category in records})
    with tempfile.TemporaryDirectory() as folder:
        path = write_jsonl(
            Path(folder) / "d.jsonl",
            [dolly_record(i, r, cat, context=c) for i, c, r, cat in records],
        )
        if 1 in Counter(category for *_, category in records).values():  # nothing left to train on
            raise_user_error(lambda: dolly_clients(str(path), categories, split_seed=seed), "too few")
            return
        clients = dolly_clients(str(path), categories, split_seed=seed)
    for client in clients:
        expected = []
        for instruction, context, response, category in records:
            if category == client.name:
                prompt = instruction.strip()
                if context.strip():
                    prompt += f"\n\nContext:\n{context.strip()}"
                expected.append(Example(prompt, response.strip()))
        assert Counter(client.train) + Counter(client.test) == Counter(expected)
        assert len(client.test) == -(-len(expected) // 10)


@FAST
@given(lines=st.lists(garbage_line, max_size=5))
def test_dolly_garbage_is_a_user_error_or_loads(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "d.jsonl"
        path.write_bytes(b"\n".join(lines))
        try:
            clients = dolly_clients(str(path), ["closed_qa"])
        except UserError as error:  # one line naming the file and line, or the empty category
            message = str(error)
            assert "\n" not in message
            assert re.match(rf"{re.escape(str(path))}:\d+: ", message) or message.startswith((
                f"data.clients: no example in {path} has category 'closed_qa'", f"no Dolly records in {path}",
                "client 'closed_qa' has 1 rows: too few")), message
        else:
            assert [client.name for client in clients] == ["closed_qa"]


@FAST
@given(
    training=st.lists(st.tuples(text, text, some_categories), max_size=10),
    test=st.lists(st.tuples(text, text, some_categories), max_size=10),
)
def test_flan_valid_records_round_trip(
    training: list[tuple[str, str, str]], test: list[tuple[str, str, str]]
) -> None:
    wanted = sorted({c for *_, c in training} & {c for *_, c in test})
    with tempfile.TemporaryDirectory() as folder:
        half = len(training) // 2
        root = write_flan_dir(
            Path(folder),
            {
                3: [flan_record(*r) for r in training[:half]],
                10: [flan_record(*r) for r in training[half:]],
            },
            [flan_record(*r) for r in test],
        )
        clients = flan_clients(str(root), wanted) if wanted else []
    for client in clients:
        assert client.train == [
            Example(i.strip(), o.strip()) for i, o, c in training if c == client.name
        ]
        assert client.test == [
            Example(i.strip(), o.strip()) for i, o, c in test if c == client.name
        ]


@FAST
@given(
    training=st.one_of(
        st.binary(max_size=60),
        st.lists(record_like, max_size=4).map(lambda v: json.dumps(v).encode()),
    ),
    test_lines=st.lists(garbage_line, max_size=4),
)
def test_flan_garbage_is_a_user_error_or_loads(training: bytes, test_lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "local_training_0.json").write_bytes(training)
        (root / "test.jsonl").write_bytes(b"\n".join(test_lines))
        try:
            clients = flan_clients(str(root), ["closed_qa"])
        except UserError as error:  # one line naming the file (and line or item), or the empty category
            message = str(error)
            assert "\n" not in message
            where = rf"{re.escape(str(root))}/(local_training_0\.json(:\d+| item \d+)?|test\.jsonl:\d+): "
            category = (f"data.clients: no example in {root} has category 'closed_qa'",  # absent from the rows
                        "client 'closed_qa' has no test rows")
            assert re.match(where, message) or message.startswith(category), message
        else:
            assert [client.name for client in clients] == ["closed_qa"]


# ---- a validation split carved from the training data (hyperparameter tuning) ----
def _shares(data: dict):
    from pflalign.config import build_config
    from pflalign.data.clients import client_shares

    return client_shares(build_config(None, {"data": data}))


def test_validation_is_held_out_of_training_and_never_touches_test(flan_dir: Path) -> None:
    full = _shares({"name": "flan", "dir": str(flan_dir)})
    held = _shares({"name": "flan", "dir": str(flan_dir), "validation": 50})
    for whole, part in zip(full, held):
        assert part.name == whole.name and len(part.test) == 50 and len(part.train) == 250
        # disjoint, and together exactly the training data, each part in file order
        assert sorted(map(repr, part.train + part.test)) == sorted(map(repr, whole.train))
        assert not set(part.train) & set(part.test)
        order = {e: i for i, e in enumerate(whole.train)}
        assert [order[e] for e in part.train] == sorted(order[e] for e in part.train)
        assert not set(part.test) & set(whole.test)  # no test example is looked at
    again = _shares({"name": "flan", "dir": str(flan_dir), "validation": 50})
    other = _shares({"name": "flan", "dir": str(flan_dir), "validation": 50, "split_seed": 7})
    assert [c.test for c in again] == [c.test for c in held]  # split_seed fixes it, whatever the run seed
    assert [c.test for c in other] != [c.test for c in held]


def test_validation_size_must_leave_training_data() -> None:
    with pytest.raises(UserError, match=r"data.validation=64 .* client 'arithmetic' has 64 training"):
        _shares({"name": "synthetic", "clients": ["arithmetic"], "validation": 64})
