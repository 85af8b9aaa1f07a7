"""Chat pieces -> Ollama's answer: message text, thinking, tool calls, logprobs and durations.

`Collected` gathers the pieces of one stream line (or of the whole answer): content and
reasoning text as they come, and tool calls, which Ollama sends whole (the name and the
arguments as an object), so they are held until the generation ends and then sent in one line
before the last. Reasoning is `thinking`, dropped when the request said think: false. A call
whose arguments are not a JSON object (cut short by num_predict) is left out, with a log line.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

from server.engine.generation import GenerationStats, TokenLogprob
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart
from server.http.ollama.protocol import Durations, FunctionOut, LogprobOut, ToolCallOut, TopLogprobOut

logger = logging.getLogger(__name__)


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def logprobs_out(lps: list[TokenLogprob], top: bool) -> list[LogprobOut]:
    return [
        LogprobOut(
            token=lp.token,
            logprob=lp.logprob,
            top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob) for t in lp.top_logprobs]
            if top
            else None,
        )
        for lp in lps
    ]


class Collected:
    """Text, thinking and tool calls out of chat pieces."""

    def __init__(self, keep_thinking: bool) -> None:
        self._keep_thinking = keep_thinking
        self._calls: dict[int, tuple[str, list[str]]] = {}  # index -> (name, argument text)
        self.content = ""
        self.thinking = ""

    def feed(self, pieces: list[OutPiece]) -> None:
        for piece in pieces:
            if isinstance(piece, ToolCallStart):
                self._calls[piece.index] = (piece.name, [])
            elif isinstance(piece, ToolCallArgs):
                self._calls[piece.index][1].append(piece.text)
            elif piece[0] == "reasoning":
                if self._keep_thinking:
                    self.thinking += piece[1]
            else:
                self.content += piece[1]

    def take_text(self) -> tuple[str, str]:
        """The content and thinking gathered since the last take (a stream line's)."""
        text, self.content, thinking, self.thinking = self.content, "", self.thinking, ""
        return text, thinking

    def tool_calls(self) -> list[ToolCallOut]:
        """Every complete call, in order."""
        out: list[ToolCallOut] = []
        for index in sorted(self._calls):
            name, parts = self._calls[index]
            try:
                arguments = json.loads("".join(parts) or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                logger.warning("tool call %d (%s) left out: its arguments are no JSON object", index, name)
                continue
            out.append(ToolCallOut(function=FunctionOut(name=name, arguments=arguments)))
        return out


def durations(stats: GenerationStats, started_ns: int) -> Durations:
    """The last line's fields; `started_ns` is when the request arrived (time.monotonic_ns)."""
    return Durations(
        done_reason="length" if stats.finish_reason == "length" else "stop",
        total_duration=time.monotonic_ns() - started_ns,
        load_duration=0,  # the model is loaded before any request is taken
        prompt_eval_count=stats.prompt_tokens,
        prompt_eval_duration=stats.prompt_ns,
        eval_count=stats.completion_tokens,
        eval_duration=stats.decode_ns,
    )
