"""The engine without HTTP: FIFO order, queue limit, cancellation, shutdown, release and reload, KV
reuse."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server.engine.generation import GenerationRequest, SamplingParams, TextDelta
from server.engine.worker import Engine, EngineState, Failed, Finished, Job
from server.errors import QueueFull, ServiceUnavailable
from server.loading.loader import load_model
from server.settings import load_settings


@pytest.fixture(scope="module")
def engine(tiny_model: Any) -> Iterator[Engine]:
    _, model_settings = load_settings(
        {"model": Path(tiny_model("tiny-qwen3moe")), "ctx_size": 8192, "parallel": 1}
    )
    engine = Engine(lambda: load_model(model_settings), max_queue=2)
    engine.start()
    assert engine.wait_ready(60)
    yield engine
    engine.close()


def _no_eog(engine: Engine) -> tuple[tuple[int, float], ...]:
    """A logit bias that keeps end-of-generation tokens out, so requests run to max_tokens."""
    import llama_cpp

    model = engine.model
    assert model is not None
    vocab = model.llama._model.vocab
    return tuple((t, -100.0) for t in range(model.info.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))


def _request(engine: Engine, text: str, max_tokens: int, **params: Any) -> GenerationRequest:
    model = engine.model
    assert model is not None
    tokens = tuple(model.llama.tokenize(text.encode(), add_bos=False))
    return GenerationRequest(
        tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=_no_eog(engine), **params)
    )


async def _drain(job: Job) -> tuple[str, Finished | Failed]:
    text = ""
    async for event in job.events():
        if isinstance(event, TextDelta):
            text += event.text
        else:
            return text, event
    raise AssertionError("no final event")


def test_jobs_run_in_arrival_order(engine: Engine) -> None:
    async def main() -> list[str]:
        jobs = [engine.submit(f"job-{i}", _request(engine, f"prompt {i}", 8)) for i in range(3)]
        order: list[str] = []

        async def watch(job: Job) -> None:
            await _drain(job)
            order.append(job.id)

        await asyncio.gather(*(watch(j) for j in jobs))
        return order

    before = len(engine.history)
    asyncio.run(main())
    # the worker's own record, in the order it served the jobs
    assert [jid for jid, _ in list(engine.history)[before:]] == ["job-0", "job-1", "job-2"]


def test_queue_limit_and_cancelled_waiting_jobs(engine: Engine) -> None:
    async def main() -> None:
        running = engine.submit("long", _request(engine, "long one", 6000))
        while not engine.running_jobs:
            await asyncio.sleep(0.01)
        waiting = [engine.submit(f"wait-{i}", _request(engine, "short", 4)) for i in range(2)]
        with pytest.raises(QueueFull):
            engine.submit("refused", _request(engine, "short", 4))
        waiting[0].cancel()  # leaves before its turn: the worker must skip it
        running.cancel()
        _, first = await _drain(running)
        _, skipped = await _drain(waiting[0])
        text, served = await _drain(waiting[1])
        assert isinstance(first, Finished) and first.stats.finish_reason == "cancelled"
        assert first.stats.tokens_after_cancel <= 1
        assert isinstance(skipped, Finished) and skipped.stats.completion_tokens == 0
        assert isinstance(served, Finished) and served.stats.completion_tokens == 4

    asyncio.run(main())


def test_prefix_of_the_previous_request_is_reused(engine: Engine) -> None:
    async def main() -> tuple[int, int, int]:
        first_req = _request(engine, "a shared beginning of a conversation", 5)
        _, first = await _drain(engine.submit("first", first_req))
        longer = GenerationRequest(first_req.prompt_tokens + (7, 8, 9), first_req.params)
        _, second = await _drain(engine.submit("second", longer))
        assert isinstance(first, Finished) and isinstance(second, Finished)
        return len(first_req.prompt_tokens), second.stats.cached_tokens, second.stats.prompt_tokens

    n_first, cached, n_second = asyncio.run(main())
    assert cached == n_first
    assert n_second == n_first + 3


def test_same_request_twice_gives_the_same_tokens(engine: Engine) -> None:
    async def main() -> tuple[str, str]:
        request = _request(engine, "determinism", 12, seed=7)
        sampled = GenerationRequest(
            request.prompt_tokens, SamplingParams(max_tokens=12, temperature=0.9, seed=7)
        )
        a, _ = await _drain(engine.submit("a", sampled))
        b, _ = await _drain(engine.submit("b", sampled))
        return a, b

    a, b = asyncio.run(main())
    assert a == b


def test_close_refuses_waiting_jobs_and_new_ones(tiny_model: Any) -> None:
    _, model_settings = load_settings(
        {"model": Path(tiny_model("tiny-qwen3moe")), "ctx_size": 8192, "parallel": 1}
    )
    engine = Engine(lambda: load_model(model_settings), max_queue=4)
    engine.start()
    assert engine.wait_ready(60)

    async def main() -> None:
        running = engine.submit("long", _request(engine, "long", 6000))
        while not engine.running_jobs:
            await asyncio.sleep(0.01)
        waiting = engine.submit("waiting", _request(engine, "short", 4))
        await asyncio.to_thread(engine.close)
        _, last = await _drain(running)
        _, refused = await _drain(waiting)
        assert isinstance(last, Finished) and last.stats.finish_reason == "cancelled"
        assert isinstance(refused, Failed) and isinstance(refused.error, ServiceUnavailable)
        with pytest.raises(ServiceUnavailable):
            engine.submit("late", _request_after_close())

    def _request_after_close() -> GenerationRequest:
        return GenerationRequest((1, 2, 3), SamplingParams(max_tokens=1))

    loaded = engine.model
    asyncio.run(main())
    assert engine.state is EngineState.STOPPED
    assert loaded is not None and loaded._closed and engine.model is None


def test_release_frees_the_model_and_reload_loads_it_again(tiny_model: Any) -> None:
    _, model_settings = load_settings({"model": Path(tiny_model("tiny-qwen3moe")), "ctx_size": 512})
    engine = Engine(lambda: load_model(model_settings))
    engine.start()
    assert engine.wait_ready(60)
    first = engine.model
    assert first is not None
    engine.release()
    assert engine.state is EngineState.RELEASED and engine.model is None and first._closed
    assert engine.info == first.info  # still described while released

    async def submit_late() -> None:
        with pytest.raises(ServiceUnavailable, match="released"):
            engine.submit("late", GenerationRequest((1, 2, 3), SamplingParams(max_tokens=1)))

    asyncio.run(submit_late())
    engine.reload()
    assert engine.wait_ready(60) and engine.loads == 2
    again = engine.model
    assert again is not None and again is not first and again.info == first.info
    engine.release()
    engine.close()  # closing a released engine has nothing left to free
    assert engine.state is EngineState.STOPPED


@pytest.fixture(scope="module")
def windowed(tiny_model: Any) -> Iterator[Engine]:
    """tiny-gemma4 (a 64-token sliding window) as the server loads it: sliding-window caches cut to
    the window plus a micro-batch (256 cells), so long prompts push old positions out."""
    _, model_settings = load_settings(
        {"model": Path(tiny_model("tiny-gemma4")), "ctx_size": 2048, "n_batch": 32}
    )
    engine = Engine(lambda: load_model(model_settings), max_queue=2)
    engine.start()
    assert engine.wait_ready(60)
    yield engine
    engine.close()


def test_a_prefix_whose_window_is_gone_is_decoded_again(windowed: Engine) -> None:
    """After a 900-token request, a request sharing only its first 300 tokens cannot reuse them:
    the window before position 300 has left the cache. It is decoded from scratch and gives what a
    fresh context gives; a request continuing the last one, whose window is still there, reuses."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=_no_eog(windowed))
    long = tuple(5 + (i * 37) % 200 for i in range(900))
    branch = long[:300] + tuple(7 + (i * 11) % 150 for i in range(40))
    unrelated = tuple(9 + (i * 13) % 120 for i in range(20))

    async def run(tokens: tuple[int, ...]) -> tuple[str, Finished]:
        text, done = await _drain(
            windowed.submit(f"job-{len(windowed.history)}", GenerationRequest(tokens, params))
        )
        assert isinstance(done, Finished), done
        return text, done

    async def main() -> None:
        await run(long)
        after_long, branched = await run(branch)
        assert branched.stats.cached_tokens == 0  # the window before 300 is gone
        await run(unrelated)
        fresh, _ = await run(branch)
        assert after_long == fresh
        # the same branch again, one token longer: its window is all there, so it is reused
        again, continued = await run(branch + (11,))
        assert continued.stats.cached_tokens == len(branch)
        await run(unrelated)
        fresh_again, _ = await run(branch + (11,))
        assert again == fresh_again

    asyncio.run(main())
