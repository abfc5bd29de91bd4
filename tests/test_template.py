"""data.template: the chat template as today, or the plain instruction template for base models."""

import pytest

from pflalign.config import build_config, parse_set
from pflalign.data import Example
from pflalign.errors import UserError
from pflalign.prompts import IGNORE, PLAIN_TEMPLATE, encode_prompt, encode_train, format_prompt

EX = Example(prompt="Add 2 and 3.", response="5")


def test_plain_template_on_a_chat_model(tiny_llama):
    tok = tiny_llama.tokenizer
    assert tok.chat_template  # tiny-llama has one: "chat" uses it, "plain" must not
    assert format_prompt(tok, EX.prompt) == format_prompt(tok, EX.prompt, "chat") != PLAIN_TEMPLATE.format(prompt=EX.prompt)
    assert format_prompt(tok, EX.prompt, "plain") == PLAIN_TEMPLATE.format(prompt=EX.prompt)
    ids, _ = encode_prompt(tok, EX, 512, "plain")
    assert tok.decode(ids, skip_special_tokens=True) == PLAIN_TEMPLATE.format(prompt=EX.prompt)
    assert encode_prompt(tok, EX, 512) == encode_prompt(tok, EX, 512, "chat")  # the default is today's
    enc = encode_train(tok, EX, 512, "plain")
    assert enc.input_ids[: len(ids)] == ids and enc.labels[: len(ids)] == [IGNORE] * len(ids)
    assert tok.decode([t for t in enc.labels if t != IGNORE], skip_special_tokens=True) == EX.response


def test_plain_model_is_plain_either_way(tiny_opt):
    tok = tiny_opt.tokenizer
    assert encode_prompt(tok, EX, 512, "chat") == encode_prompt(tok, EX, 512, "plain")


def test_template_config_key():
    assert build_config().data.template == "chat"
    assert build_config(None, parse_set(["data.template=plain"])).data.template == "plain"
    with pytest.raises(UserError, match="data.template must be chat or plain, got 'raw'"):
        build_config(None, parse_set(["data.template=raw"]))
    with pytest.raises(ValueError, match="template must be one of chat, plain"):
        format_prompt(None, "x", "raw")
