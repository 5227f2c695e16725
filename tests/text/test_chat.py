"""ChatTemplate: the bundled template, ChatML fallback, helpers, sandbox, message validation."""

from datetime import datetime

import pytest
from text_helpers import tiny_fields

from cfr_atlas.errors import ConfigError
from cfr_atlas.text import CHATML_TEMPLATE, ChatTemplate

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_smollm_template_adds_default_system_prompt(smollm, smollm_reader):
    chat = ChatTemplate.from_gguf(smollm_reader, smollm)
    text = chat.render([{"role": "user", "content": "Hi!"}])
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm.encode(text, special=True)
    assert ids[0] == 1 and ids.count(2) == 2
    assert chat.encode(smollm, [{"role": "user", "content": "Hi!"}]) == ids


def test_smollm_template_keeps_given_system_and_no_generation_prompt(smollm, smollm_reader):
    chat = ChatTemplate.from_gguf(smollm_reader, smollm)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = chat.render(messages, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert (chat.bos_token, chat.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_chatml_fallback_when_gguf_has_none(tiny):
    chat = ChatTemplate.from_gguf(tiny_fields(), tiny)
    assert chat.template == CHATML_TEMPLATE
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert chat.render(messages) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_from_tiny_gguf_file(tiny_llama):
    from gguf import GGUFReader

    from cfr_atlas.text import Tokenizer

    reader = GGUFReader(tiny_llama)
    chat = ChatTemplate.from_gguf(reader, Tokenizer.from_gguf(reader))
    text = chat.render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_helpers_and_variables():
    chat = ChatTemplate(
        "{{ bos_token }}{{ strftime_now('%Y') }}|{{ messages[0]['content'] | tojson }}|{{ extra }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}",
        bos_token="<s>",
    )
    text = chat.render([{"role": "user", "content": "é"}], extra=7)
    assert text == f'<s>{datetime.now().year}|"é"|7'


def test_raise_exception_becomes_config_error():
    chat = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ConfigError, match="roles must alternate") as info:
        chat.render([{"role": "user", "content": "x"}])
    assert info.value.field == "messages"


def test_sandbox_blocks_mutation_and_bad_templates_are_config_errors():
    with pytest.raises(ConfigError) as info:
        ChatTemplate("{{ messages.append(1) }}").render([])
    assert info.value.field == "chat_template"
    with pytest.raises(ConfigError, match="chat_template: line 1"):
        ChatTemplate("{% for %}")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list of dicts, got str"),
        ({"role": "user"}, "list of dicts, got dict"),
        (["hi"], "item 0 must be a dict"),
        ([{"role": "user"}], "item 0: 'content' must be a str, got nothing"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], "item 1: 'role'.*int"),
        ([{"role": "user", "content": None}], "'content' must be a str, got NoneType"),
    ],
)
def test_message_validation(messages, match):
    with pytest.raises(ConfigError, match=match) as info:
        ChatTemplate(CHATML_TEMPLATE).render(messages)
    assert info.value.field == "messages"
