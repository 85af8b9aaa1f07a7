"""Faults of pooled devices, as a user meets them (patch 0014: ggml's RPC client reports a lost
helper instead of aborting the process): a helper gone at start-up is named; one killed, or its
link cut, mid-stream fails that request with a clear error event while the server stays up and
loads the model again, without the helper (--rpc-optional) or with it once it is back."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from gguf import GGUFReader

from server.bench.link import ShapedLink
from tests.rpc.helpers import helper
from tests.servers import free_port, serve_process, wait_for

# large enough that a long answer takes seconds: the helper goes while it streams
SHAPE = {"n_embd": 1024, "n_ff_exp": 768, "n_expert": 32}
SERVE = ("--mode", "streaming", "--rpc-layers", "2", "--parallel", "1", "-c", "4096", "--alias", "*")


def _eos(path: Path) -> int:
    field = GGUFReader(path).fields["tokenizer.ggml.eos_token_id"]
    return int(field.parts[field.data[0]][0])


def test_a_helper_gone_at_start_up_is_named(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("tiny-qwen3moe")
    endpoint = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "server.cli", "generate", "-m", str(path), "--mode", "streaming", "-n", "4"]
    argv += ["--rpc", endpoint]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"RPC helper {endpoint} cannot be reached" in refused.stderr
    alone = subprocess.run(
        [*argv, "--rpc-optional"], capture_output=True, text=True, timeout=300, check=False
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "left out, its layers run here" in alone.stderr


def _stream_until_lost(port: int, eos: int, lose: Callable[[], None]) -> tuple[int, str]:
    """Stream a long answer, `lose` the helper after its first pieces: (pieces received, the
    error the stream ended with)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=3000,
        logit_bias={str(eos): -100},
        stream=True,
    )
    pieces = 0
    with pytest.raises(openai.APIError) as failed:
        for _ in stream:
            pieces += 1
            if pieces == 3:
                lose()
    return pieces, str(failed.value)


def _health(port: int) -> dict[str, object]:
    """/health's body; /metrics answers too, whatever the engine is doing (a reload included)."""
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).status_code == 200
    body: dict[str, object] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
    return body


def _answer(port: int) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize("how", ["killed", "link cut"])
def test_a_helper_lost_mid_stream_fails_that_request_only(
    tiny_model: Callable[..., Path], tmp_path: Path, how: str
) -> None:
    path = tiny_model("tiny-qwen3moe", **SHAPE)
    # the relay of the RPC benchmark, unshaped: closing it cuts the link as a tunnel's end does
    with helper(tmp_path, memory="1G") as running, ShapedLink(running.endpoint) as link:
        linked = link.endpoint
        lose = link.close if how == "link cut" else running.proc.kill
        with serve_process(path, "--rpc", linked, "--rpc-optional", *SERVE, log_level="WARNING") as (
            proc,
            port,
        ):
            assert _health(port)["helpers"] == {linked: {"layers": 2}}
            pieces, error = _stream_until_lost(port, _eos(path), lose)
            assert "was lost during a decode step" in error, error
            # the server stays up and loads the model again, the helper left out
            wait_for(lambda: _health(port).get("helpers") == {linked: {"left_out": True}}, "the reload")
            assert _answer(port)
            assert proc.poll() is None
    assert pieces >= 3


def test_a_helper_back_after_a_loss_is_used_again(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = tiny_model("tiny-qwen3moe", **SHAPE)
    port = free_port()
    with helper(tmp_path, memory="1G", port=port) as first:
        with serve_process(path, "--rpc", first.endpoint, *SERVE, log_level="WARNING") as (proc, server_port):
            _, error = _stream_until_lost(server_port, _eos(path), first.proc.kill)
            assert "was lost during a decode step" in error, error
            # without --rpc-optional the reload fails while the helper is gone, and says why
            wait_for(
                lambda: "cannot be reached" in str(_health(server_port).get("error")), "the failed reload"
            )
            with helper(tmp_path, memory="1G", port=port):
                assert _answer(server_port)  # the request loads the model again, with the helper
                assert _health(server_port)["helpers"] == {first.endpoint: {"layers": 2}}
            assert proc.poll() is None
