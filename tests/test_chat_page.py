"""The chat page at GET / in a real browser (Playwright driving Debian's chromium), against a real
server that needs an API key: a pairing link (#key=...) fills the key in and the page chats; a
browser without the key is asked for it once and keeps it; the streamer's bars move while the
answer streams, not only at its end. Screenshots of each state are saved
in the test's output folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_server_support import RunningServer, running_server

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package, installed by `make setup-dev` as root
KEY = "page key/1"


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=1024, api_key=KEY, mode="streaming") as running:
        yield running


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (make setup-dev installs it when run as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(
            executable_path=str(CHROMIUM),
            # as root (CI) Chromium needs --no-sandbox; the rest keeps it off this machine's closed network
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        try:
            yield launched
        finally:
            launched.close()


def send(page: Any, text: str) -> None:
    page.fill("#q", text)
    page.click("form#f button")
    answered = "[...document.querySelectorAll('.msg.assistant')].some(a => a.textContent.length > 0)"
    page.wait_for_function(answered)


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
    # record, at each change of the compute bar's label, how much of the answer had arrived
    watch = """() => {
        window.barLog = [];
        const answered = () => {
          const answers = document.querySelectorAll('.msg.assistant');
          return answers.length ? answers[answers.length - 1].textContent.length : 0;
        };
        const label = document.getElementById('v-compute');
        new MutationObserver(() => window.barLog.push([label.textContent, answered()]))
          .observe(label, {childList: true, characterData: true, subtree: true});
      }"""
    page.evaluate(watch)
    send(page, "tell me a long story")
    page.wait_for_function("turns.length === 2")  # the page's conversation: the answer is complete
    page.screenshot(path=str(tmp_path / "bars.png"))
    log = page.evaluate("window.barLog")
    final = page.evaluate("[...document.querySelectorAll('.msg.assistant')].pop().textContent.length")
    assert all(label.endswith(" ms") for label, _ in log), log
    assert any(length < final for _, length in log), "the bars only changed once the answer was complete"
