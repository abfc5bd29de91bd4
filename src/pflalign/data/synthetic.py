"""A small synthetic federation generated in code, for demos and tests.

Personalized federated learning only pays off when clients need different
skills, so the 4 clients here do clearly different things with different output
formats: add or subtract two numbers (`arithmetic`), sort a list of numbers
(`sorting`), rewrite a phrase in capitals (`uppercase`) and pull a name and a
city out of a sentence as JSON (`key_value`). None of them needs world
knowledge, every answer is short and checkable, and nothing is downloaded, so a
tiny model can show the effect of a method in minutes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from pflalign.data import ClientShare, Dataset, Example, Table
from pflalign.errors import UserError

SYNTHETIC_TASKS = ("arithmetic", "sorting", "uppercase", "key_value")
DEFAULT_TRAIN, DEFAULT_TEST = 64, 16  # examples per task when data.max_train / data.max_test are not set
MAX_EXAMPLES_PER_TASK = 2000  # well below each task's number of distinct prompts

_ADJECTIVES = (
    "quiet", "bright", "old", "small", "green", "cold", "happy", "narrow", "heavy", "gentle",
    "dark", "tall", "lazy", "brave", "empty", "golden", "silent", "busy", "wild", "soft",
)
_NOUNS = (
    "river", "garden", "window", "fox", "forest", "bridge", "kitten", "harbor", "lamp", "road",
    "cloud", "village", "piano", "hill", "letter", "market", "candle", "tower", "meadow", "ship",
)
_VERBS = (
    "sleeps", "waits", "shines", "moves", "sings", "falls", "grows", "turns", "rests", "glows",
    "drifts", "stands", "listens", "wakes", "returns",
)
_NAMES = (
    "Maria", "Ahmed", "Chen", "Olga", "Tomas", "Aisha", "Kenji", "Lucia", "Pedro", "Ingrid",
    "Ravi", "Fatima", "Jonas", "Elena", "Kwame", "Sofia", "Mateo", "Yuki", "Omar", "Hannah",
)
_CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Quito", "Cairo", "Seoul", "Vienna",
    "Prague", "Denver", "Madrid", "Athens", "Manila", "Bogota", "Helsinki", "Toronto", "Accra",
    "Kyoto",
)
_KEY_VALUE_TEMPLATES = (
    "{name} lives in {city}.",
    "{name} moved to {city} last year.",
    "In {city}, {name} runs a small bakery.",
    "{name} works as a nurse in {city}.",
    "The new office in {city} is managed by {name}.",
    "After years abroad, {name} settled in {city}.",
)


def make_synthetic(n_train: int = 64, n_test: int = 16, seed: int = 0) -> list[ClientShare]:
    """Return the 4 synthetic clients, in `SYNTHETIC_TASKS` order.

    Each task draws from its own RNG seeded with `f"{seed}:{task}"`, so the same
    seed always gives the same data and one task's data does not depend on the
    others. Prompts are unique within a task, so train and test never overlap.
    """
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{name} must be a non-negative integer, got {value!r}")
    if n_train + n_test > MAX_EXAMPLES_PER_TASK:
        raise UserError(
            f"the synthetic tasks have at most {MAX_EXAMPLES_PER_TASK} examples each, "
            f"asked for {n_train} train + {n_test} test"
        )
    clients = []
    for task in SYNTHETIC_TASKS:
        rng = random.Random(f"{seed}:{task}")
        examples = _unique_examples(_GENERATORS[task], rng, n_train + n_test)
        clients.append(ClientShare(task, examples[:n_train], examples[n_train:]))
    return clients


def synthetic_table(source: str | None, seed: int, max_train: int | None, max_test: int | None) -> Table:
    """The 4 tasks as one table labelled by task: each task's `max_train` (default 64) examples as
    rows and its `max_test` (default 16) as the table's test rows, drawn with `seed`
    (`make_synthetic`). The natural partition on the task and the test rule's own test split give
    client t exactly task t's examples, whichever tasks `data.clients` keeps (each task draws
    from its own RNG)."""
    if source is not None:
        raise UserError(
            f"the synthetic federation is generated in code: it takes no data source ({source!r})"
        )
    tasks = make_synthetic(
        n_train=DEFAULT_TRAIN if max_train is None else max_train,
        n_test=DEFAULT_TEST if max_test is None else max_test,
        seed=seed,
    )
    return Table(
        [e for t in tasks for e in t.train], [t.name for t in tasks for _ in t.train],
        [e for t in tasks for e in t.test], [t.name for t in tasks for _ in t.test],
        info={"source": "the synthetic tasks (generated in code)", "rows": sum(len(t.train) for t in tasks),
              "test_rows": sum(len(t.test) for t in tasks), "dropped": {}},
    )


# generated in code: it reads no file (the data cache keys it by its settings alone), and takes no source
DATASET = Dataset(table=synthetic_table, categories=SYNTHETIC_TASKS, files=lambda source: [] if source is None else None)


def _unique_examples(
    generate: Callable[[random.Random], Example], rng: random.Random, n: int
) -> list[Example]:
    """Draw examples until `n` distinct prompts have been seen, in draw order."""
    examples: dict[str, Example] = {}
    while len(examples) < n:
        example = generate(rng)
        examples.setdefault(example.prompt, example)
    return list(examples.values())


def _arithmetic(rng: random.Random) -> Example:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return Example(f"What is {a} plus {b}?", str(a + b))
    a, b = max(a, b), min(a, b)  # keep answers non-negative
    return Example(f"What is {a} minus {b}?", str(a - b))


def _sorting(rng: random.Random) -> Example:
    numbers = rng.sample(range(1, 100), rng.randint(3, 6))
    prompt = "Sort these numbers in ascending order: " + ", ".join(map(str, numbers))
    return Example(prompt, ", ".join(map(str, sorted(numbers))))


def _uppercase(rng: random.Random) -> Example:
    phrase = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    if rng.random() < 0.5:
        phrase += f" {rng.choice(_VERBS)}"
    return Example(f"Rewrite in capital letters: {phrase}", phrase.upper())


def _key_value(rng: random.Random) -> Example:
    name, city = rng.choice(_NAMES), rng.choice(_CITIES)
    sentence = rng.choice(_KEY_VALUE_TEMPLATES).format(name=name, city=city)
    return Example(
        f"Extract the name and the city as JSON: {sentence}",
        json.dumps({"name": name, "city": city}),
    )


_GENERATORS: dict[str, Callable[[random.Random], Example]] = {
    "arithmetic": _arithmetic,
    "sorting": _sorting,
    "uppercase": _uppercase,
    "key_value": _key_value,
}
