"""Chat templates other than the model's over real HTTP: the server's --chat-template renders
every chat (and /tokenize's messages), a request's own chat_template only where the server
trusts requests with one, and a broken template is a clear error, at start or as a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import MODEL, LiveServer, Served, start_engine

from vmkv.model.store import load_tokenizer
from vmkv.server import build_app
from vmkv.server.chat_template import load_chat_template

PLAIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SWITCHED = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{{ ' think' if enable_thinking else ' answer' }}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    engine = start_engine(str(tiny_model_dir), "paged", in_process=True)
    yield Served("", engine, "paged")
    engine.shutdown()


def prompt_tokens(client: openai.OpenAI, **extra: object) -> int:
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=extra or None
    ).usage.prompt_tokens


def test_the_servers_template_renders_every_chat_in_place_of_the_models(
    served: Served, tiny_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    expected = tokenizer("system: Be brief.\nuser: Hi!\nassistant:", add_special_tokens=False)["input_ids"]
    with LiveServer(build_app(served.engine, MODEL, chat_template=PLAIN)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert prompt_tokens(client) == len(expected)
        tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
        assert tokenized["tokens"] == expected
        with pytest.raises(openai.BadRequestError) as caught:  # not trusted: the server's own is used
            prompt_tokens(client, chat_template=SWITCHED)
        assert caught.value.body["param"] == "chat_template"


def test_a_trusted_request_renders_with_its_own_template(served: Served, tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    with LiveServer(build_app(served.engine, MODEL, trust_request_chat_template=True)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model_default = prompt_tokens(client)
        assert model_default == len(
            tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
        )
        tokenized = httpx.post(
            f"{server.url}/tokenize", json={"messages": MESSAGES, "chat_template": SWITCHED}
        ).json()
        assert tokenizer.decode(tokenized["tokens"]) == "Be brief.Hi! answer"
        # reasoning_effort reads the request's template: this one has a switch
        assert prompt_tokens(client, chat_template=SWITCHED, reasoning_effort="low") == len(
            tokenizer("Be brief.Hi! think", add_special_tokens=False)["input_ids"]
        )
        with pytest.raises(openai.BadRequestError) as caught:
            prompt_tokens(client, chat_template="{% for m in messages %}")
        assert caught.value.body["param"] == "chat_template"
        with pytest.raises(openai.BadRequestError) as caught:
            prompt_tokens(client, chat_template="{{ raise_exception('no system messages') }}")
        assert caught.value.body["param"] == "messages" and "no system messages" in caught.value.message
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_broken_server_template_stops_the_start(served: Served) -> None:
    with pytest.raises(ValueError, match="does not render"):
        build_app(served.engine, MODEL, chat_template="{% if %}")


def test_the_flag_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    assert load_chat_template(str(path)) == PLAIN == load_chat_template(PLAIN)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
