"""Kept responses over real HTTP with the `openai` client: fetched again, continued with
previous_response_id as the same conversation sent whole, deleted, run in the background
(polled, streamed again from any event, cancelled with their KV freed), and the store's
budget. One engine process over the tiny fp32 model serves the module."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, LiveServer, Served, live_server

from vmkv.server import build_app
from vmkv.server.drain import Drain
from vmkv.server.protocol import ChatMessage
from vmkv.server.response_store import ResponseStore, StoredResponse
from vmkv.server.responses_protocol import ResponseObject

QUESTION = "Which layout keeps each sequence's keys and values contiguous in virtual memory?"
FOLLOW_UP = "And which one reads them through a block table?"
LONG = 180  # output tokens: a run that is still going when the test acts on it


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    with live_server(tiny_model_dir, "paged") as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return served.openai()


def greedy(**extra: object) -> dict:
    return dict(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0.0) | extra


def ended(client: openai.OpenAI, response_id: str, timeout: float = 30.0) -> openai.types.responses.Response:
    """The response once its run has ended, polled as a client of background responses does."""
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"response still {response.status}"
        time.sleep(0.02)
    return response


def test_a_kept_response_is_fetched_continued_and_deleted(client: openai.OpenAI) -> None:
    """A continuation is the earlier conversation and answer, then the new input, without the
    earlier instructions: the same prompt, and so the same greedy answer, as that chat sent whole."""
    first = client.responses.create(**greedy(instructions="Answer in one sentence."))
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    second = client.responses.create(**greedy(input=FOLLOW_UP, previous_response_id=first.id))
    whole = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": FOLLOW_UP},
        ],
        max_tokens=6,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == whole.usage.prompt_tokens
    assert second.output_text == whole.choices[0].message.content

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(**greedy(previous_response_id=first.id))
    assert caught.value.body["param"] == "previous_response_id"
    third = client.responses.create(**greedy(input="Why?", previous_response_id=second.id))
    assert third.usage.input_tokens > second.usage.input_tokens  # the chain holds without its first link


def test_a_kept_responses_input_items_are_listed_back_a_page_at_a_time(client: openai.OpenAI) -> None:
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a layout."}]},
        {"role": "assistant", "content": "Paged."},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}", "id": "fc_given"},
        {"type": "function_call_output", "call_id": "call_1", "output": "vattention"},
        {"role": "user", "content": "Another one?"},
    ]
    response = client.responses.create(**greedy(input=conversation))
    items = list(client.responses.input_items.list(response.id, order="asc"))
    assert [item.type for item in items] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert items[0].content[0].text == "Name a layout." and items[1].content[0].type == "output_text"
    assert items[2].id == "fc_given" and items[3].output == "vattention" and len({i.id for i in items}) == 5
    newest = client.responses.input_items.list(response.id, limit=2)  # newest first by default
    assert [item.id for item in newest.data] == [items[4].id, items[3].id] and newest.has_more
    rest = client.responses.input_items.list(response.id, limit=10, after=newest.last_id)
    assert [item.id for item in rest.data] == [items[2].id, items[1].id, items[0].id] and not rest.has_more
    (only,) = client.responses.input_items.list(client.responses.create(**greedy()).id).data
    assert only.role == "user" and only.content[0].text == QUESTION
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(response.id, after="msg_nowhere")
    assert caught.value.body["param"] == "after"


def test_a_response_with_store_false_is_not_kept(client: openai.OpenAI) -> None:
    response = client.responses.create(**greedy(store=False))
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_background_response_is_polled_to_the_answer_a_request_gets(client: openai.OpenAI) -> None:
    answered = client.responses.create(**greedy(max_output_tokens=8))
    queued = client.responses.create(**greedy(max_output_tokens=8, background=True))
    assert queued.background is True and queued.status in ("queued", "in_progress") and not queued.output
    done = ended(client, queued.id)
    assert done.status == answered.status == "incomplete"
    assert done.output_text == answered.output_text and done.usage.output_tokens == 8
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(done.id)
    assert caught.value.body["param"] == "response_id"


def test_a_cancelled_background_response_stops_and_frees_its_kv(
    client: openai.OpenAI, served: Served
) -> None:
    with client.responses.create(**greedy(max_output_tokens=LONG, background=True, stream=True)) as events:
        response_id = next(events).response.id
        for event in events:  # running: it has made a token
            if event.type == "response.output_text.delta":
                break
        cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled"
    served.wait_idle()
    again = client.responses.cancel(cancelled.id)  # cancelling twice changes nothing
    assert again.status == client.responses.retrieve(cancelled.id).status == "cancelled"
    answered = client.responses.create(**greedy())
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(answered.id)
    assert caught.value.body["param"] == "response_id"


def test_a_background_stream_is_streamed_again_from_any_event(client: openai.OpenAI) -> None:
    events = list(client.responses.create(**greedy(background=True, stream=True)))
    response_id = events[0].response.id
    assert events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def dumped(stream: openai.Stream) -> list[dict]:
        return [event.model_dump() for event in stream]

    original = [event.model_dump() for event in events]
    assert dumped(client.responses.retrieve(response_id, stream=True)) == original
    assert dumped(client.responses.retrieve(response_id, stream=True, starting_after=3)) == original[4:]
    assert ended(client, response_id).output_text == events[-1].response.output_text

    answered = client.responses.create(**greedy())
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.retrieve(answered.id, stream=True)
    assert caught.value.body["param"] == "stream"


def test_a_server_keeping_nothing_refuses_what_needs_a_kept_response(served: Served) -> None:
    with LiveServer(build_app(served.engine, MODEL, response_store=ResponseStore(0))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert client.responses.create(**greedy()).store is False
        for extra, param in [
            ({"previous_response_id": "resp-1"}, "previous_response_id"),
            ({"background": True}, "background"),
        ]:
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(**greedy(**extra))
            assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:
        served.openai().responses.create(**greedy(background=True, store=False))
    assert caught.value.body["param"] == "store"


def test_a_drain_refuses_new_responses_and_waits_for_background_runs(served: Served) -> None:
    store = ResponseStore(1 << 20)
    drain = Drain(build_app(served.engine, MODEL, response_store=store), background=lambda: store.num_running)
    with LiveServer(drain) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        running = client.responses.create(**greedy(max_output_tokens=LONG, background=True))
        assert not asyncio.run(drain.wait_idle(0.01))  # the run holds the drain though its request returned
        assert store_gauges(server.url) == {
            "responses_stored": 1,
            "responses_stored_bytes": 0,
            "responses_running": 1,
        }
        drain.draining = True
        refused = httpx.post(f"{server.url}/v1/responses", json=greedy())
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert asyncio.run(drain.wait_idle(60))
        assert client.responses.retrieve(running.id).status in ("completed", "incomplete")
        gauges = store_gauges(server.url)
        assert gauges["responses_running"] == 0 and gauges["responses_stored_bytes"] == store.num_bytes > 0


def store_gauges(url: str) -> dict[str, float]:
    """The response store's gauges on /metrics."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {f.name.removeprefix("vmkv:"): f.samples[0].value for f in families if "responses_" in f.name}


def stored(response_id: str, text: str, running: bool = False) -> StoredResponse:
    response = ResponseObject(
        id=response_id, status="completed", model=MODEL, temperature=1.0, top_p=1.0, text={}
    )
    return StoredResponse(response, [ChatMessage(role="user", content=text)], done=not running)


def test_the_store_drops_the_least_recently_used_finished_response_past_its_budget() -> None:
    size = stored("a", "x" * 1000).size
    store = ResponseStore(int(2.5 * size))
    store.add(stored("a", "x" * 1000))
    store.add(stored("b", "x" * 1000))
    store.get("a")  # used: b is now the least recent
    store.add(stored("c", "x" * 1000))
    assert list(store.entries) == ["a", "c"] and store.num_bytes == 2 * size
    running = stored("d", "x" * 1000, running=True)
    store.add(running)
    store.add(stored("e", "x" * 1000))
    assert list(store.entries) == ["c", "d", "e"]  # a running response is never dropped, nor counted
    running.done = True
    store.finished(running)  # counted once it has ended: the least recent finished one goes
    assert list(store.entries) == ["d", "e"] and store.num_bytes == 2 * size
    store.delete("d")
    assert store.num_bytes == size
    with pytest.raises(ValueError, match="max_bytes"):
        ResponseStore(-1)


def test_a_follower_sees_every_event_of_a_run_and_stops_at_its_end() -> None:
    async def scenario() -> list[str]:
        entry = stored("a", "x", running=True)
        entry.events = []
        seen: list[str] = []

        async def follow() -> None:
            async for event in entry.follow(None):
                seen.append(event)

        follower = asyncio.create_task(follow())
        for event in ["e0", "e1", "e2"]:
            entry.append(event)
            await asyncio.sleep(0)
        entry.done = True
        entry.wake()
        await asyncio.wait_for(follower, 5)
        return seen

    assert asyncio.run(scenario()) == ["e0", "e1", "e2"]
