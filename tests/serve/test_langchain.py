"""LangChain's standard integration suites (langchain-tests) against a real `cfr-atlas serve`.

`langchain-ollama`'s ChatOllama / OllamaEmbeddings and `langchain-openai`'s ChatOpenAI /
OpenAIEmbeddings, pointed at one `cfr-atlas serve` process (a subprocess, the bundled
SmolLM2-135M-Instruct, started once for this module). The suites are LangChain's code,
installed from PyPI (the dev extra pins them); the capability flags below say honestly what
this server and model do, and docs/SERVING.md lists every test they skip and why:
  * tool calling: off — SmolLM2's chat template renders no tools, so the server answers a
    request with tools with a 400 (tool calling is tested with a tool-capable template in
    test_tools.py and with the real Qwen2.5-Coder there);
  * structured output and JSON mode: on (grammar-constrained, `format` / `response_format`);
  * image, audio, PDF inputs: off (the model reads text).
`max_tokens` / `num_predict` is bounded (256) and `repeat_penalty` 1.3 keeps a 135M model at
temperature 0 from repeating itself inside a JSON string until that bound (the suites check
shapes, and a structured answer cut at the limit cannot be parsed). Needs the bundled model:
skipped without it, like the other slow tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from langchain_ollama import ChatOllama, OllamaEmbeddings
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from langchain_tests.integration_tests import ChatModelIntegrationTests, EmbeddingsIntegrationTests

pytestmark = pytest.mark.slow
NAME = "smol"  # the name the server is started with
URL: dict[str, str] = {}  # filled by the module's server fixture, read by the suites' params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def served(bundled_model_path, tmp_path_factory):
    """`cfr-atlas serve` as its own process, up until the module ends."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve_log") / "serve.log"
    # one numba thread: `make test`'s other worker keeps the second core busy, and a decode
    # step's parallel kernels (a few hundred per token, each microseconds long) would each wait
    # for a thread the OS has descheduled; outputs do not depend on the thread count
    # (tests/quant/test_quant_invariance.py, tests/atlas/test_exactness.py)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "NUMBA_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cfr_atlas.cli", "serve", "--port",
                                 str(port), "--model", str(bundled_model_path), "--name", NAME,
                                 "--max-active", "4"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/api/version", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"cfr-atlas serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        URL["base"] = url
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _json_mode_gives_objects(model) -> None:
    """LangChain's own JSON-mode call (with_structured_output(method="json_mode")) and prompt,
    invoked and streamed, asserted on what JSON mode promises: a JSON object. The suite's
    version also wants the keys its prompt asks for, which constrained decoding does not
    promise and SmolLM2-135M does not follow (docs/SERVING.md)."""
    chat = model.with_structured_output(None, method="json_mode")
    msg = ("Tell me a joke about cats. Return the result as a JSON with 'setup' and "
           "'punchline' keys. Return nothing other than JSON.")
    assert isinstance(chat.invoke(msg), dict)
    chunks = list(chat.stream(msg))
    assert chunks and isinstance(chunks[-1], dict)


class _SmolChatTests(ChatModelIntegrationTests):
    """What both chat suites share: the capability flags of this server and model, and JSON
    mode's test (collected only through the two subclasses below)."""

    @property
    def has_tool_calling(self) -> bool:
        return False  # SmolLM2's template renders no tools: a 400 (see the module docstring)

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.mark.xfail(reason="wants the key names its prompt asks for, which JSON mode does "
                              "not promise and SmolLM2-135M does not follow; what JSON mode "
                              "promises is asserted by test_json_mode_gives_a_json_object",
                       strict=False)
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    def test_json_mode_gives_a_json_object(self, model) -> None:
        _json_mode_gives_objects(model)


class TestChatOllama(_SmolChatTests):
    @property
    def chat_model_class(self):
        return ChatOllama

    @property
    def chat_model_params(self) -> dict:
        return {"model": NAME, "base_url": URL["base"], "num_predict": 256, "temperature": 0,
                "repeat_penalty": 1.3}


class TestChatOpenAI(_SmolChatTests):
    @property
    def chat_model_class(self):
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        return {"model": NAME, "base_url": URL["base"] + "/v1", "api_key": "unused",
                "max_tokens": 256, "temperature": 0, "max_retries": 0, "stream_usage": True,
                "extra_body": {"repeat_penalty": 1.3}}

    @pytest.mark.xfail(reason="langchain-openai turns a pydantic v1 schema into a function "
                              "call (tools), which SmolLM2's template cannot render: a 400",
                       strict=True)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)


class TestOllamaEmbeddings(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self):
        return OllamaEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": NAME, "base_url": URL["base"]}


class TestOpenAIEmbeddings(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self):
        return OpenAIEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        # no tiktoken chunking: it would download an encoding; the server counts tokens itself
        return {"model": NAME, "base_url": URL["base"] + "/v1", "api_key": "unused",
                "check_embedding_ctx_length": False, "max_retries": 0}
