"""Chat data (issue 42): `data.name=files` reads the common `messages` format (a list of
{role, content} turns per row), learns the assistant turns only through the model's chat
template, and evaluates on the conversation up to its last assistant turn against that turn."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from pflalign import checkpoint as ckpt  # noqa: E402
from pflalign.cli import main  # noqa: E402
from pflalign.config import build_config  # noqa: E402
from pflalign.data import Example  # noqa: E402
from pflalign.data.files import read_table  # noqa: E402
from pflalign.run.engine import run as run_in_process  # noqa: E402
from pflalign.errors import UserError  # noqa: E402
from pflalign.prompts import IGNORE, encode_prompt, encode_train  # noqa: E402

# ChatML, the template of SmolLM2 and Qwen (without SmolLM2's default system turn)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def turn(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    {"messages": [turn("system", "Be brief."), turn("user", "Hi"), turn("assistant", "Hello!"),
                  turn("user", "2+2?"), turn("assistant", "4")], "topic": "math"},
    {"messages": [turn("user", "Capital of France?"), turn("assistant", "Paris")], "topic": "geo"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def chatml(tiny_llama):
    """The tiny model's byte-level tokenizer with a ChatML template (its own renders every turn
    as a user turn, which no conversation survives: see the refusal test)."""
    tok = copy.deepcopy(tiny_llama.tokenizer)
    tok.chat_template = CHATML
    return tok


def test_messages_rows_become_conversations(tmp_path):
    table = read_table(str(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)), label="topic")
    first, second = table.examples
    assert first == Example(
        prompt="System: Be brief.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: 2+2?", response="4",
        messages=(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?"),
                  ("assistant", "4")))
    # one user turn and its answer: an instruction example like any instruction/response row
    assert second == Example(prompt="Capital of France?", response="Paris")
    assert table.labels == ["math", "geo"]
    assert table.info["columns"] == {"messages": "messages", "label": "topic"}


def test_assistant_turns_only_are_learned_through_the_chat_template(chatml):
    example = read_example(CONVERSATIONS[0])
    enc = encode_train(chatml, example, 1024)
    text = chatml.apply_chat_template([turn(r, c) for r, c in example.messages], tokenize=False)
    assert chatml.decode(enc.input_ids) == text + "</s>"  # the whole conversation, then EOS
    learned = [chatml.decode([i for i, label in zip(enc.input_ids, enc.labels) if label != IGNORE])]
    # both assistant turns, each with its end-of-turn marker; the last one then EOS (the template has none)
    assert learned == ["Hello!<|im_end|>\n4<|im_end|>\n</s>"]
    spans, current = [], []
    for i, label in zip(enc.input_ids, enc.labels):
        if label != IGNORE:
            assert label == i
            current.append(i)
        elif current:
            spans.append(chatml.decode(current))
            current = []
    spans.append(chatml.decode(current))
    assert spans == ["Hello!<|im_end|>\n", "4<|im_end|>\n</s>"]
    assert not enc.truncated


def test_evaluation_prompt_is_the_conversation_before_the_last_answer(chatml):
    example = read_example(CONVERSATIONS[0])
    ids, cut = encode_prompt(chatml, example, 1024)
    assert chatml.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                  "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert not cut and example.response == "4"
    # the training sequence begins with exactly this prompt
    assert encode_train(chatml, example, 1024).input_ids[:len(ids)] == ids


def test_a_long_conversation_keeps_its_last_answer_and_the_generation_prompt(chatml):
    example = read_example({"messages": [turn("user", "u" * 60), turn("assistant", "a" * 40),
                                         turn("user", "q"), turn("assistant", "b" * 10)]})
    enc = encode_train(chatml, example, 96)  # byte-level: a token per character
    assert enc.truncated and len(enc.input_ids) == 96
    # the last answer (10 + 11 + EOS = 22 tokens, under half of 96) whole; before it the last 74
    # tokens of the conversation: the generation prompt, and the earlier answer's end still learned
    text = chatml.decode(enc.input_ids)
    assert text == "a" * 12 + "<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n" + \
        "b" * 10 + "<|im_end|>\n</s>"
    learned = chatml.decode([i for i, label in zip(enc.input_ids, enc.labels) if label != IGNORE])
    assert learned == "a" * 12 + "<|im_end|>\n" + "b" * 10 + "<|im_end|>\n</s>"


def test_plain_template_learns_the_last_answer_of_the_transcript(chatml):
    example = read_example(CONVERSATIONS[0])
    enc = encode_train(chatml, example, 1024, template="plain")
    learned = chatml.decode([i for i, label in zip(enc.input_ids, enc.labels) if label != IGNORE])
    assert learned == "4</s>"
    assert chatml.decode(enc.input_ids).startswith(
        "### Instruction:\nSystem: Be brief.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: 2+2?\n\n### Response:\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_llama):
    with pytest.raises(UserError, match="does not render a conversation's first turns as the beginning"):
        encode_train(tiny_llama.tokenizer, read_example(CONVERSATIONS[0]), 1024)


def read_example(row):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        return read_table(str(write_jsonl(Path(tmp) / "one.jsonl", [row]))).examples[0]


@pytest.mark.parametrize("messages, match", [
    ([turn("user", "hi")], "ends with a user turn; it must end with the assistant turn"),
    ([turn("user", "hi"), turn("bot", "yo")], "turn 2 has role 'bot'; the roles are system, user, assistant"),
    ("hello", "column 'messages' must be a list of {role, content} turns"),
    ([turn("system", "s"), turn("assistant", "a")], "empty instruction"),
    ([turn("user", "q"), turn("assistant", "")], "empty response"),
    # issue 57: a turn's content that is not text is refused, not trained on as "42"
    ([turn("user", "q"), turn("assistant", 42)], r"field 'messages\[2\]\.content' must be a string, got int"),
    ([turn("user", True), turn("assistant", "a")], r"field 'messages\[1\]\.content' must be a string, got bool"),
])
def test_bad_conversations_are_one_line(tmp_path, messages, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [CONVERSATIONS[1], {"messages": messages, "topic": "x"}])
    with pytest.raises(UserError, match=match) as info:
        read_table(str(path))
    assert "row 2" in str(info.value) and "\n" not in str(info.value)


def test_a_conversational_federation_trains_and_scores(tmp_path, monkeypatch):
    """Through the engine, with the tiny model's tokenizer given ChatML: the predictions'
    references are the last assistant turns and their prompts the transcripts before them."""
    import pflalign.model.base as model  # where the base model and its tokenizer are made

    real = model._tiny_tokenizer

    def chatml_tokenizer(chat):
        tok = real(chat)
        tok.chat_template = CHATML
        return tok

    monkeypatch.setattr(model, "_tiny_tokenizer", chatml_tokenizer)
    rows = [{"messages": [turn("user", f"hi {i}"), turn("assistant", f"hello {i}"), turn("user", f"sum {i}+1?"),
                          turn("assistant", str(i + 1))], "topic": "ab"[i % 2]} for i in range(16)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = build_config(None, {
        "model": "tiny-llama", "method": "fedavg", "lora": {"r": 4, "alpha": 8}, "rounds": 1, "local_steps": 1,
        "batch_size": 2, "max_seq_len": 96, "eval": {"max_new_tokens": 3, "batch_size": 4, "base_model": False},
        "data": {"name": "files", "dir": str(data), "partition_by": "topic", "test_set": "per_client",
                 "test_fraction": 0.25}})
    run_in_process(cfg, tmp_path / "run", progress=False)
    predictions = [json.loads(line) for line in (tmp_path / "run" / ckpt.PREDICTIONS).read_text().splitlines()]
    assert predictions
    by_reference = {str(i + 1): f"User: hi {i}\n\nAssistant: hello {i}\n\nUser: sum {i}+1?" for i in range(16)}
    for p in predictions:
        assert by_reference[p["reference"]] == p["prompt"]


def test_the_tokenized_data_cache_keeps_the_turns(tmp_path, monkeypatch, chatml):
    """A second load of the same file is a cache hit; its examples are still conversations
    (else evaluation would prompt with the plain transcript)."""
    from pflalign.run import data_cache

    monkeypatch.setenv("PFLALIGN_CACHE", str(tmp_path / "cache"))
    rows = [dict(CONVERSATIONS[0], topic="a"), dict(CONVERSATIONS[1], topic="a")] * 4
    cfg = build_config(None, {"model": "tiny-llama", "max_seq_len": 96, "batch_size": 2, "data": {
        "name": "files", "dir": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "partition_by": "topic"}})
    first, encoded = data_cache.client_data(cfg, chatml, 0)
    assert list((tmp_path / "cache" / "tokenized").iterdir())  # written
    second, encoded_again = data_cache.client_data(cfg, chatml, 0)
    assert second.train == first.train and second.test == first.test and encoded_again == encoded
    assert any(ex.messages is not None for ex in second.train + second.test)


def test_cli_run_on_conversations_with_a_template_that_cannot_split_them_is_one_line(tmp_path, capsys):
    rows = [{"messages": [turn("system", "s"), turn("user", f"q{i}"), turn("assistant", f"a{i}")], "topic": "ab"[i % 2]}
            for i in range(12)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    code = main(["run", "--out", str(tmp_path / "run"), "--set", "model=tiny-llama", "--set", "rounds=1",
                 "--set", "local_steps=1", "--set", "batch_size=2", "--set", "max_seq_len=64",
                 "--set", "data.name=files", "--set", f"data.dir={data}", "--set", "data.partition_by=topic",
                 "--set", "eval.base_model=false", "--set", "eval.max_new_tokens=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.template=plain" in err[0], err
    assert not (tmp_path / "run").exists()  # refused before the run folder was made
