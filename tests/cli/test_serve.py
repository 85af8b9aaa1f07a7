"""`moeflash serve` as a user runs it: a subprocess, the documented curl and Python examples,
a clean exit on SIGTERM, and the LAN binding with an API key."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import running_server, serve_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples.md"
DEMO_ID = "demo-qwen3moe"


def _code_block(language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", EXAMPLES.read_text(), flags=re.S)
    # the first bash block is `make serve`; the curl example is the one that calls the API
    return next(block for block in blocks if "127.0.0.1:8000" in block)


@pytest.fixture(scope="module")
def demo_server(tiny_model: Any) -> Iterator[tuple[subprocess.Popen[str], int]]:
    with serve_process(tiny_model("tiny-qwen3moe"), "--alias", DEMO_ID, "--ctx-size", "1024") as running:
        yield running


def test_curl_example_from_the_docs_streams_a_chat(demo_server: tuple[subprocess.Popen[str], int]) -> None:
    _, port = demo_server
    command = _code_block("bash").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=True)
    events = [line for line in result.stdout.split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events), result.stdout[:500]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert {chunk["model"] for chunk in chunks} == {DEMO_ID}


def test_python_example_from_the_docs_runs(demo_server: tuple[subprocess.Popen[str], int]) -> None:
    _, port = demo_server
    code = _code_block("python").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert re.search(r"\[\d+ tokens\]", result.stdout), result.stdout


def test_readme_python_examples_run(demo_server: tuple[subprocess.Popen[str], int]) -> None:
    """Every Python block of the README (chat, Responses, Anthropic Messages), run in order in one
    interpreter as a reader would paste them, against the demo server."""
    _, port = demo_server
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) >= 3, "the README shows one example per API"
    code = "\n".join(blocks).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\[\d+ tokens\]", result.stdout), result.stdout
    assert re.search(r"(end_turn|max_tokens|stop_sequence)\s*$", result.stdout), result.stdout


def test_sigterm_during_a_stream_exits_cleanly(tiny_model: Any) -> None:
    with serve_process(
        tiny_model("tiny-qwen3moe"), "--ctx-size", "16384", "--max-completion-tokens", "16000"
    ) as (
        proc,
        port,
    ):
        lines: list[str] = []
        body = {
            "model": "x",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 16000,
            "stream": True,
        }
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        body["model"] = models["data"][0]["id"]
        body["logit_bias"] = {str(t): -100 for t in _eog_tokens(tiny_model("tiny-qwen3moe"))}

        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream(
                    "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60
                ) as r:
                    for line in r.iter_lines():
                        lines.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: len(lines) > 2, "the stream to start")
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal: the status says "SIGTERM"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        reader.join(60)
        _, stderr = proc.communicate(timeout=30)
    assert "Traceback" not in stderr
    events = [line for line in lines if line]
    # the stream was cut short by the shutdown and said so, in the OpenAI error shape
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    assert re.search(r"engine stopped: .*, model released", stderr)
    assert "serving on http://127.0.0.1:" in stderr
    assert "model ready" in stderr and "architecture qwen3moe" in stderr
    assert "flash attention off, repacked layouts on" in stderr


def test_the_lan_needs_a_key_or_insecure_no_key(tiny_model: Any) -> None:
    model = str(tiny_model("tiny-qwen3moe"))
    refused = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", model, "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode != 0
    assert "needs an API key" in refused.stderr and "--insecure-no-key" in refused.stderr
    with serve_process(tiny_model("tiny-qwen3moe"), "--host", "0.0.0.0", "--insecure-no-key") as (proc, _):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        _, stderr = proc.communicate(timeout=30)
    assert "WARNING: serving on 0.0.0.0 WITHOUT an API key" in stderr


def test_lan_start_up_prints_the_pairing_link_and_qr_code(tiny_model: Any) -> None:
    """The link opens the chat page with the key in its fragment; the QR code holds the same link."""
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with serve_process(tiny_model("tiny-qwen3moe"), "--host", "0.0.0.0", "--api-key", "pair me") as (
        proc,
        port,
    ):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        _, stderr = proc.communicate(timeout=30)
    assert f"http://{address}:{port}/#key=pair%20me" in stderr
    assert "████" in stderr  # the QR code's quiet zone, in block characters


def _lan_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("8.8.8.8", 9))  # UDP connect sends no packet: it only picks a route
        except OSError:
            return None
        address = str(sock.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_lan_binding_with_a_key(tiny_model: Any) -> None:
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with running_server(
        tiny_model("tiny-qwen3moe"), host="0.0.0.0", api_key="lan-key", ctx_size=512
    ) as server:
        url = f"http://{address}:{server.port}/v1/models"
        assert httpx.get(url, headers={"Authorization": "Bearer lan-key"}, timeout=10).status_code == 200
        refused = httpx.get(url, timeout=10)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        # no Host allow-list off loopback: a LAN client names the machine by its address
        assert httpx.get(f"http://{address}:{server.port}/health", timeout=10).status_code == 200


def test_environment_variables_configure_serve(tiny_model: Any, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {**os.environ, "MOEFLASH_API_KEY_FILE": str(key_file), "MOEFLASH_CTX_SIZE": "1280"}
    with serve_process(tiny_model("tiny-qwen3moe"), env=env) as (_, port):
        refused = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert refused.status_code == 401
        models = httpx.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer from-file"}, timeout=10
        )
        assert models.json()["data"][0]["context_length"] == 1280


def _eog_tokens(model: Path) -> list[int]:
    import llama_cpp

    llama = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        vocab = llama._model.vocab
        return [t for t in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    finally:
        llama.close()
