"""Concurrency and lifecycle: requests decoded together, the queue limit, cancellation on
disconnect.

Assertions are on the engine's state (what the worker recorded), never on elapsed time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.servers import RunningServer, running_server, wait_for

# a generation long enough to still be running while the test acts on it (the tiny model
# decodes thousands of tokens per second; the context allows this many)
LONG = 12000


@pytest.fixture(scope="module")
def model_path(tiny_model: Any) -> Path:
    return Path(tiny_model("tiny-qwen3moe"))


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[RunningServer]:
    # one slot: the queue's own behaviour (a request waits while another runs)
    with running_server(
        model_path, ctx_size=16384, parallel=1, max_queue=1, max_completion_tokens=LONG
    ) as running:
        yield running


def _no_eog(server: RunningServer) -> dict[str, int]:
    return {str(t): -100 for t in server.eog_tokens()}


def _long_chat(server: RunningServer, **extra: Any) -> dict[str, Any]:
    return {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": LONG,
        "temperature": 0.0,
        "logit_bias": _no_eog(server),
        **extra,
    }


def _stream_first_chunks(client: httpx.Client, server: RunningServer, n: int) -> str:
    """Start a long stream, read `n` data events, then drop the connection; returns the job id."""
    job_id = ""
    with client.stream("POST", "/v1/chat/completions", json=_long_chat(server, stream=True)) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                job_id = json.loads(line[6:])["id"]
                seen += 1
                if seen >= n:
                    break
    return job_id


def test_eight_simultaneous_streams_complete_with_the_right_content(model_path: Path) -> None:
    """Eight streams on four slots: decoded together, each gives its answer alone, bit for bit
    (every token's log-probability too: each slot's KV stream is its own)."""
    with running_server(model_path, ctx_size=1024, parallel=4, max_queue=8) as server:
        prompts = [f"question number {i}" for i in range(8)]
        with openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120
        ) as client:

            def ask(prompt: str, stream: bool) -> tuple[str, list[tuple[str, float]]]:
                kwargs: dict[str, Any] = {
                    "model": server.model_id,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 24,
                    "temperature": 0.0,
                    "logprobs": True,
                }
                if not stream:
                    choice = client.chat.completions.create(**kwargs).choices[0]
                    assert choice.logprobs is not None and choice.logprobs.content is not None
                    content = choice.logprobs.content
                    return choice.message.content or "", [(t.token, t.logprob) for t in content]
                chunks = list(client.chat.completions.create(stream=True, **kwargs))
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                choices = [c.choices[0] for c in chunks if c.choices]
                logprobs = [
                    (t.token, t.logprob) for c in choices if c.logprobs for t in c.logprobs.content or []
                ]
                return "".join(c.delta.content or "" for c in choices), logprobs

            expected = [ask(p, stream=False) for p in prompts]  # one at a time: the reference
            with ThreadPoolExecutor(max_workers=8) as pool:
                got = list(pool.map(lambda p: ask(p, stream=True), prompts))
        assert [text for text, _ in got] == [text for text, _ in expected]
        assert got == expected
        assert server.engine.slots == 4


def test_a_short_question_is_answered_while_a_long_answer_streams(model_path: Path) -> None:
    """With two slots a short request does not wait for the long one: it is answered while the
    long stream still runs, and the long stream goes on to its end."""
    with running_server(model_path, ctx_size=16384, parallel=2, max_completion_tokens=LONG) as server:
        long = {**_long_chat(server, stream=True), "max_tokens": 3000}
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=long) as running:
                lines = running.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                short = httpx.post(
                    server.base_url + "/v1/chat/completions",
                    json={**_long_chat(server), "max_tokens": 5},
                    timeout=120,
                )
                assert short.status_code == 200
                assert short.json()["usage"]["completion_tokens"] == 5
                assert len(server.engine.running_jobs) == 1  # the long one, still decoding
                finish = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
        assert finish["choices"][0]["finish_reason"] == "length"


def test_sixty_four_clients_at_once_are_all_answered(model_path: Path) -> None:
    """64 requests sent at once with the default queue: every one answered, none refused."""
    with running_server(model_path, ctx_size=512) as server:

        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
                body = {**_long_chat(server), "max_tokens": 8}
                answers = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body) for _ in range(64))
                )
            return [a.status_code for a in answers]

        assert asyncio.run(main()) == [200] * 64
        wait_for(lambda: not server.engine.busy, "the engine to be idle")


def test_a_full_queue_beside_busy_slots_is_429(model_path: Path) -> None:
    """Two slots decoding and one request waiting in a queue of one: the next is refused."""
    with running_server(
        model_path, ctx_size=16384, parallel=2, max_queue=1, max_completion_tokens=LONG
    ) as server:
        with ThreadPoolExecutor(max_workers=3) as pool:
            clients = [httpx.Client(base_url=server.base_url, timeout=120) for _ in range(3)]
            try:
                streams = [pool.submit(_stream_first_chunks, client, server, 10_000) for client in clients]
                wait_for(
                    lambda: len(server.engine.running_jobs) == 2 and server.engine.queue_depth == 1,
                    "two jobs to run and one to wait",
                )
                refused = httpx.post(
                    server.base_url + "/v1/chat/completions", json=_long_chat(server), timeout=30
                )
                assert refused.status_code == 429
            finally:
                for client in clients:
                    client.close()
                for stream in streams:
                    stream.exception()
        wait_for(lambda: not server.engine.busy, "the engine to be idle")


def test_full_queue_is_429_with_retry_after(server: RunningServer) -> None:
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as a,
        httpx.Client(base_url=server.base_url, timeout=120) as b,
    ):
        with a.stream("POST", "/v1/chat/completions", json=_long_chat(server, stream=True)) as running:
            assert running.status_code == 200
            wait_for(lambda: server.engine.running_jobs, "the first job to run")
            with b.stream("POST", "/v1/chat/completions", json=_long_chat(server, stream=True)) as queued:
                assert queued.status_code == 200
                wait_for(lambda: server.engine.queue_depth == 1, "the second job to wait")
                refused = httpx.post(
                    server.base_url + "/v1/chat/completions", json=_long_chat(server), timeout=30
                )
                assert refused.status_code == 429
                assert int(refused.headers["retry-after"]) >= 0
                assert refused.json()["error"]["code"] == "queue_full"
    wait_for(
        lambda: not server.engine.running_jobs and server.engine.queue_depth == 0, "the engine to be idle"
    )


def test_disconnect_mid_stream_frees_the_model_within_one_token(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        job_id = _stream_first_chunks(client, server, 4)
    stats = server.job_stats(job_id)
    assert stats.finish_reason == "cancelled"
    assert stats.completion_tokens < LONG
    assert stats.tokens_after_cancel <= 1
    wait_for(lambda: not server.engine.running_jobs, "the model to be free")


def _answered(server: RunningServer, status: int) -> float:
    """How many /v1/chat/completions requests the server answered with `status`."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    line = f'moeflash_requests_total{{route="/v1/chat/completions",status="{status}"}} '
    return sum(float(row.removeprefix(line)) for row in text.splitlines() if row.startswith(line))


def test_disconnect_of_a_non_streaming_request_cancels_it(server: RunningServer) -> None:
    """The job is cancelled within a token, and the request counts as closed by its client (499),
    not as refused by a server shutting down (503)."""
    before = len(server.engine.history)
    closed, refused = _answered(server, 499), _answered(server, 503)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + "/v1/chat/completions",
            json=_long_chat(server),
            timeout=httpx.Timeout(30, read=0.5),
        )
    wait_for(lambda: len(server.engine.history) > before and not server.engine.running_jobs, "the job to end")
    job_id, stats = server.engine.history[-1]
    assert job_id.startswith("chatcmpl-")
    assert stats.finish_reason == "cancelled"
    assert stats.completion_tokens < LONG
    assert stats.tokens_after_cancel <= 1
    wait_for(lambda: _answered(server, 499) == closed + 1, "the request to count as closed by its client")
    assert _answered(server, 503) == refused


def test_a_queued_request_survives_the_one_before_it_being_cancelled(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as a:
        with a.stream("POST", "/v1/chat/completions", json=_long_chat(server, stream=True)) as first:
            assert first.status_code == 200
            wait_for(lambda: server.engine.running_jobs, "the first job to run")
            with ThreadPoolExecutor(max_workers=1) as pool:
                short = {**_long_chat(server), "max_tokens": 5}
                second = pool.submit(
                    httpx.post, server.base_url + "/v1/chat/completions", json=short, timeout=120
                )
                wait_for(lambda: server.engine.queue_depth == 1, "the second job to wait")
                first.close()  # the client of the running stream leaves
                result = second.result()
    assert result.status_code == 200
    assert result.json()["usage"]["completion_tokens"] == 5


def test_n_choices_decode_side_by_side(model_path: Path) -> None:
    """n > 1 on chat and legacy completions, whole and streamed: one choice per index, usage
    counting the prompt once; greedy choices agree; n beyond the slots is a 400 naming n."""
    with running_server(model_path, ctx_size=1024, parallel=3) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            chat: dict[str, Any] = {
                "model": server.model_id,
                "messages": [{"role": "user", "content": "three ways to say hi"}],
                "max_tokens": 8,
                "logit_bias": _no_eog(server),
            }
            whole = client.chat.completions.create(n=3, temperature=0.9, seed=11, **chat)
            assert [c.index for c in whole.choices] == [0, 1, 2]
            assert whole.usage is not None and whole.usage.completion_tokens == 24
            assert len({c.message.content for c in whole.choices}) > 1  # seeds 11, 12, 13
            texts: dict[int, str] = {}
            usages = []
            for chunk in client.chat.completions.create(
                n=3, temperature=0.9, seed=11, stream=True, stream_options={"include_usage": True}, **chat
            ):
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if chunk.usage is not None:
                    usages.append(chunk.usage)
            assert sorted(texts) == [0, 1, 2] and all(texts.values())
            assert [u.completion_tokens for u in usages] == [24]
            greedy = client.completions.create(
                model=server.model_id, prompt="once", n=2, max_tokens=6, temperature=0
            )
            assert greedy.choices[0].text == greedy.choices[1].text
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(n=4, **chat)
            assert refused.value.body["param"] == "n"  # type: ignore[index]
        wait_for(lambda: not server.engine.busy, "the engine to be idle")
