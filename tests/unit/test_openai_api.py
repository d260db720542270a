"""The HTTP door's request handling that needs no server: field conversion, refusals, --chat-template."""

from __future__ import annotations

import pytest

from conftest import golden_json
from hybridgate.config import resolve
from hybridgate.cli import build_parser
from hybridgate.gateway import openai_api as api
from hybridgate.gateway.errors import HTTP_OF, status_of
from hybridgate.router import Router, RouterConfig
from hybridgate.router.errors import ContextLengthError
from hybridgate.wire import InvalidFieldError

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def chat(**fields) -> api.ChatCompletionRequest:
    return api.ChatCompletionRequest(messages=CHAT, **fields)


def test_max_completion_tokens_wins_and_stop_takes_both_forms():
    assert api.sampling_params(chat(max_tokens=20, max_completion_tokens=3), None).max_tokens == 3
    assert api.sampling_params(chat(max_tokens=20), None).max_tokens == 20
    assert api.sampling_params(chat(stop="x"), None).stop == ("x",)
    assert api.sampling_params(chat(stop=["a", "b"]), None).stop == ("a", "b")
    p = api.sampling_params(chat(presence_penalty=0.5, frequency_penalty=-1, min_p=0.1, top_k=5,
                                 stop_token_ids=[7]), 3)
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.top_k, p.stop_token_ids, p.logprobs) == \
        (0.5, -1.0, 0.1, 5, (7,), 3)
    assert api.sampling_params(chat(), None).temperature == 1.0  # unset fields keep the spec's defaults


@pytest.mark.parametrize(("fields", "param"), [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
])
def test_unsupported_api_fields_are_refused_by_name(fields, param):
    with pytest.raises(InvalidFieldError) as e:
        api.refuse_unsupported(chat(**fields))
    assert e.value.field == param
    api.refuse_unsupported(chat(response_format={"type": "text"}, tools=[]))  # what is supported passes


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidFieldError) as e:
        api.tool_request(chat(**fields))
    assert e.value.field == param


def test_a_tool_message_needs_its_call_id_and_only_an_assistant_calls():
    with pytest.raises(InvalidFieldError) as e:
        api.chat_messages(api.ChatCompletionRequest(messages=[{"role": "tool", "content": "17"}]))
    assert e.value.field == "messages[0].tool_call_id"
    with pytest.raises(InvalidFieldError) as e:
        api.chat_messages(api.ChatCompletionRequest(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]))
    assert e.value.field == "messages[0].tool_calls"


def test_chat_logprobs_and_choice_limits():
    assert api.chat_logprobs_count(chat()) is None
    assert api.chat_logprobs_count(chat(logprobs=True)) == 0
    assert api.chat_logprobs_count(chat(logprobs=True, top_logprobs=5)) == 5
    with pytest.raises(InvalidFieldError, match="top_logprobs"):
        api.chat_logprobs_count(chat(top_logprobs=5))
    for n in (0, 17):
        with pytest.raises(InvalidFieldError, match="n"):
            api.sampling_params(chat(n=n), None)
    assert api.param_of("logprobs", chat()) == "top_logprobs"
    assert api.param_of("max_tokens", chat(max_completion_tokens=4)) == "max_completion_tokens"
    assert api.param_of("prompt", chat()) == "messages"  # a chat has no prompt field: its messages made it
    assert api.param_of("prompt", api.CompletionRequest(prompt="p")) == "prompt"


def test_a_chat_too_long_for_the_model_names_its_messages():
    from hybridgate.gateway.http import api_error
    from hybridgate.router.errors import ContextLengthError

    exc = ContextLengthError("prompt", "20031 tokens, but the max model length is 8192 tokens")
    error = api_error(exc, chat()).envelope()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert error["message"] == "messages: 20031 tokens, but the max model length is 8192 tokens"
    assert api_error(exc, api.CompletionRequest(prompt="p")).envelope()["error"]["param"] == "prompt"


def test_text_parts_are_joined():
    body = api.ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}])
    assert api.chat_messages(body) == [{"role": "user", "content": "a\nb"}]
    image = api.ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidFieldError, match=r"messages\[0\].content\[0\].type"):
        api.chat_messages(image)


def test_one_table_answers_both_doors():
    assert HTTP_OF[status_of(ContextLengthError("prompt", "too long"))] == (400, "invalid_request_error")
    from hybridgate.router import ResourceExhaustedError, UnavailableError

    assert HTTP_OF[status_of(ResourceExhaustedError("full"))][0] == 429
    assert HTTP_OF[status_of(UnavailableError("none"))][0] == 503


def test_chat_template_file_changes_the_rendered_prompt(tmp_path, gguf_model, tokenizer):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}ASSISTANT:")
    settings = resolve(build_parser().parse_args(["serve", "--chat-template", str(template)])).settings
    assert settings.router.chat_template == str(template)
    ids = Router(gguf_model, [], settings.router).tokenize(CHAT)
    assert tokenizer.decode(ids) == "[user] What is the capital of France?\nASSISTANT:"
    assert Router(gguf_model, [], RouterConfig()).tokenize(CHAT) == golden_json("greedy.json")["france"]["prompt_ids"]
    with pytest.raises(ValueError, match="--chat-template"):
        Router(gguf_model, [], RouterConfig(chat_template=str(tmp_path / "missing.jinja")))
