"""Reasoning splitters: <think> blocks, Gemma 4's thought channel and harmony channels go to
reasoning, whatever the size of the deltas."""

from __future__ import annotations

import pytest

from server.engine.reasoning import GemmaSplitter, HarmonySplitter, ThinkSplitter, make_splitter
from tests.engine.pieces import feed_in_pieces, joined


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_think_blocks_go_to_reasoning_whatever_the_delta_size(size: int) -> None:
    text = "<think>step 1 < step 2</think>\n\nThe answer <is> 42."
    assert joined(feed_in_pieces(ThinkSplitter(), text, size)) == {
        "reasoning": "step 1 < step 2",
        "content": "The answer <is> 42.",
    }


def test_a_think_block_opened_by_the_prompt() -> None:
    splitter = make_splitter("think", "<|im_start|>assistant\n<think>\n")
    assert joined(feed_in_pieces(splitter, "hmm</think>yes", 2)) == {"reasoning": "hmm", "content": "yes"}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_gemma_thought_channel_goes_to_reasoning(size: int) -> None:
    text = "<|channel>thought\nstep 1 <channel 2>\n<channel|>The answer <|channel is 42."
    assert joined(feed_in_pieces(GemmaSplitter(), text, size)) == {
        "reasoning": "step 1 <channel 2>\n",
        "content": "The answer <|channel is 42.",
    }


def test_gemma_prefilled_empty_thought_is_closed() -> None:
    # enable_thinking off: the template writes an empty thought channel; all output is content
    prompt = "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    assert isinstance(make_splitter("gemma", prompt), GemmaSplitter)
    assert joined(feed_in_pieces(make_splitter("gemma", prompt), "Hello!", 2)) == {"content": "Hello!"}
    opened = make_splitter("gemma", "<|turn>model\n<|channel>thought\n")
    assert joined(feed_in_pieces(opened, "hmm<channel|>yes", 2)) == {"reasoning": "hmm", "content": "yes"}


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_harmony_channels(size: int) -> None:
    text = (
        "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    )
    assert joined(feed_in_pieces(HarmonySplitter(), text, size)) == {
        "reasoning": "think hard",
        "content": "Hello!",
    }
