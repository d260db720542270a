"""Chat template renders and ids against transformers' apply_chat_template (tests/golden/chat.json)."""

from __future__ import annotations

import pytest

from conftest import golden_json
from hybridgate.models import ChatTemplate, ChatTemplateError

GOLDEN = golden_json("chat.json")
TEMPLATE_CASES = ["system_user", "user_only", "multi_turn"]


@pytest.mark.parametrize("name", TEMPLATE_CASES)
def test_render_and_ids_equal_reference(chat_template, name):
    case = GOLDEN[name]
    assert chat_template.render(case["messages"]) == case["text"]
    assert chat_template.encode(case["messages"]) == case["ids"]


@pytest.mark.parametrize("name", TEMPLATE_CASES)
def test_nothing_prepended_and_one_bos_per_turn(chat_template, name):
    messages = GOLDEN[name]["messages"]
    ids = chat_template.encode(messages)
    turns = len(messages) + 1 + (messages[0]["role"] != "system")  # + generation prompt + default system
    assert ids[0] == 1  # <|im_start|> opens the first turn; no BOS added in front
    assert ids.count(1) == turns
    assert ids.count(2) == turns - 1


def test_user_only_gets_default_system_message(chat_template):
    assert chat_template.render(GOLDEN["user_only"]["messages"]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_special_strings_in_content_are_text(chat_template):
    case = GOLDEN["injection"]
    ids = chat_template.encode(case["messages"])
    assert ids == case["ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2  # only the template's own turns


def test_generation_prompt_off(chat_template):
    messages = GOLDEN["multi_turn"]["messages"]
    assert not chat_template.render(messages, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


def test_template_errors_name_messages(tokenizer):
    broken = ChatTemplate(tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="messages.*roles must alternate"):
        broken.encode([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="messages"):
        broken.encode([])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].content"):
        ChatTemplate(tokenizer).encode([{"role": "user", "content": None}])


def test_sandbox_blocks_attribute_escape(tokenizer):
    evil = ChatTemplate(tokenizer, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        evil.encode([{"role": "user", "content": "x"}])


def test_transformers_helpers(tokenizer):
    t = ChatTemplate(tokenizer, "{{ messages | tojson }}{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}")
    assert t.render([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
