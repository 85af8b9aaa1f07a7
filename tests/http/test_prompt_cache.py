"""The prompt cache through the HTTP API: two agents with different long system prompts take
turns (issue 40's table), across a restart, and Claude Code's billing header; the official openai
and anthropic clients against a real server on a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from tests.servers import RunningServer, running_server

# two agents' system prompts, several hundred tokens each on the tiny model's vocabulary
SYSTEM_A = "You are agent A, a careful code reviewer who reads every line twice. " * 12
SYSTEM_B = "You are agent B, who writes short titles and summaries of conversations. " * 10
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


def _ask(server: RunningServer, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one chat completion."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        done = c.chat.completions.create(model=server.model_id, messages=messages, **GREEDY)
    usage = done.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return (
        done.choices[0].message.content or "",
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens or 0,
    )


def _metrics(server: RunningServer) -> dict[str, float]:
    """/metrics' unlabelled samples by name."""
    lines = httpx.get(server.base_url + "/metrics").text.splitlines()
    return {
        name: float(value) for name, _, value in (line.partition(" ") for line in lines if line[:1] != "#")
    }


def test_alternating_agents_keep_their_prefixes(tiny_model: Any, tmp_path: Path) -> None:
    """A, A, B, A (issue 40's table): the third A request restores A's state, saved when B came,
    and prefills only its last turn; after a restart its states come back from flash."""
    model = tiny_model("tiny-qwen3moe")
    a: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "first?"}]
    b = [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "a title, please"}]
    with running_server(model, ctx_size=4096, state_dir=tmp_path) as server:
        answer, a1, a1_cached = _ask(server, a)
        a += [{"role": "assistant", "content": answer}, {"role": "user", "content": "second?"}]
        answer, a2, a2_cached = _ask(server, a)
        _, b1, b1_cached = _ask(server, b)
        a += [{"role": "assistant", "content": answer}, {"role": "user", "content": "third?"}]
        answer, a3, a3_cached = _ask(server, a)
        cache = server.model.prompt_cache
        assert cache is not None and cache.hits == 1
        # the RAM it holds is the budget's term, and stays within it
        memory = server.model.llama.memory
        assert memory is not None and cache.ram_limit == memory.prompt_cache > 0
        assert 0 < cache.stats().ram_bytes <= cache.ram_limit
        metrics = _metrics(server)
        assert metrics["moeflash_prompt_cache_hits_total"] == 1
        assert metrics["moeflash_prompt_cache_restored_tokens_total"] == a3_cached
        assert metrics["moeflash_prompt_cache_ram_bytes"] == cache.stats().ram_bytes > 0
    assert a1_cached == 0 and a1 > 300 and b1 > 300
    assert a2_cached >= a1 - 8  # the live KV cache: the first answer's rendering may differ at its end
    assert b1_cached < 16  # only the template's opening is shared
    assert a3_cached >= a2 - 8 and a3_cached >= 0.9 * a3, (a3, a3_cached)  # nearly all of the prompt
    states = list((tmp_path / "prompt-cache").glob("*/*.state"))
    # A's state when B came (its second answer's tokens, which the third prompt renders otherwise),
    # B's, and A's at shutdown
    assert len(states) == 3
    a += [{"role": "assistant", "content": answer}, {"role": "user", "content": "after the restart?"}]
    with running_server(model, ctx_size=4096, state_dir=tmp_path) as server:
        _, a4, a4_cached = _ask(server, a)
        _, _, b2_cached = _ask(server, b)
    assert a4_cached >= a3 - 8 and a4_cached >= 0.9 * a4, (a4, a4_cached)
    assert b2_cached == b1 - 1  # all of B's prompt but its last token, whose logits are needed


def test_prompt_cache_off(tiny_model: Any, tmp_path: Path) -> None:
    """--prompt-cache-ram 0: only the live KV cache is reused, and nothing is written."""
    model = tiny_model("tiny-qwen3moe")
    a = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "first?"}]
    b = [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "a title, please"}]
    with running_server(model, ctx_size=4096, state_dir=tmp_path, prompt_cache_ram=0) as server:
        _ask(server, a)
        _ask(server, b)
        _, a2, a2_cached = _ask(server, a)
        assert server.model.prompt_cache is None
        assert server.model.llama.memory is not None and server.model.llama.memory.prompt_cache == 0
    assert a2_cached < 16
    assert not (tmp_path / "prompt-cache").exists()


def test_billing_header_does_not_defeat_the_cache(tiny_model: Any, tmp_path: Path) -> None:
    """Claude Code's first system block changes its cch= on every request: it is dropped before
    rendering, so the next turn reads its prefix from the cache and counts it as
    cache_read_input_tokens, and count_tokens agrees."""

    def system(cch: str) -> list[dict[str, str]]:
        header = f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};"
        return [{"type": "text", "text": header}, {"type": "text", "text": SYSTEM_A}]

    first_turn = [{"role": "user", "content": "first?"}]
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=4096, state_dir=tmp_path) as server:
        with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            first = c.messages.create(
                model=server.model_id, system=system("fa690"), messages=first_turn, max_tokens=8
            )
            second_turn = [
                *first_turn,
                {"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "second?"},
            ]
            second = c.messages.create(
                model=server.model_id, system=system("1c8b4"), messages=second_turn, max_tokens=8
            )
            counted = c.messages.count_tokens(
                model=server.model_id, system=system("defa0"), messages=second_turn
            )
            plain = c.messages.count_tokens(model=server.model_id, system=SYSTEM_A, messages=second_turn)
    prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.cache_read_input_tokens is not None
    assert second.usage.cache_read_input_tokens >= prompt - 8
    assert counted.input_tokens == plain.input_tokens
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_the_chat_page_shows_the_prompt_cache(tiny_model: Any, tmp_path: Path, chromium: Any) -> None:
    """The chat page's header names the whole answer's prompt and how much of it was reused (the
    request's usage). The page's conversation is interrupted by another client's, then
    continued: its prefix is restored from the prompt cache and shown as reused."""
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=4096, state_dir=tmp_path) as server:
        page = chromium.new_page()
        page.goto(server.base_url + "/")
        page.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
        for turn, question in enumerate((SYSTEM_A, "and then?"), start=1):
            page.fill("#q", question)
            page.click("#send")
            # the answer is complete once it is in the page's conversation
            page.wait_for_function(
                f"!document.getElementById('send').disabled && turns.length === {2 * turn}"
            )
            if question == SYSTEM_A:
                first = page.text_content("#pcache") or ""
                _ask(
                    server, [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "a title"}]
                )
        page.wait_for_function("document.getElementById('pcache').textContent.endsWith(' reused')")
        shown = page.text_content("#pcache") or ""
        page.wait_for_function("document.getElementById('pstore').textContent !== ''")
        store = page.text_content("#pstore") or ""
        restored = int(_metrics(server)["moeflash_prompt_cache_restored_tokens_total"])
        page.screenshot(path=str(tmp_path / "prompt-cache.png"))
    assert first.startswith("prompt ") and first.endswith(" tokens, 0 reused"), first
    assert restored > 0 and shown.endswith(f" tokens, {restored} reused"), (shown, restored)
    # the states it holds now, RAM and flash (gauges, read after each answer)
    assert store.startswith("prompt cache now: ") and "iB RAM, " in store and store.endswith(" flash"), store
