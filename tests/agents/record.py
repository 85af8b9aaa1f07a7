"""Record the agents' follow-up request sequences (`make agent-sequences`).

Runs each pinned CLI (clis.py) against a real server on the demo model's shape (tiny-qwen3moe),
as the agent tests do, until a run sends follow-ups (the model called a tool), and writes them
scrubbed to tests/agents/sequences/<agent>.json. Codex runs go on until one also sends a
function_call_output without a call_id (its goal tools), written as codex-no-call-id.json (the
run that sent one stands for both).

    python -m tests.agents.record [--agents codex,claude-code,opencode,qwen-code] [--tries N] [--seed S]

--seed picks the tiny model's weights: Claude Code calls a tool, and so sends follow-ups, on
seed 1's (`make agent-sequences` records each CLI on the seed it needs).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.modelgen import generate_model, preset
from tests.agents import clis
from tests.agents.harness import SERVED_ID, AgentRun, recorded_server
from tests.agents.sequences import Scrubber, carries_tool_results, follow_ups, without_call_id, write
from tests.commands import REPO

# the prompt of the reported Codex failure: on the tiny model's random weights it leads to tool
# calls (Codex's goal tools among them) in some runs, so follow-ups come; the runs of an agent
# cycle through PROMPTS, whose tool-call rates on the random weights differ by agent
PROMPT = "say hi"
PROMPTS = (PROMPT, clis.PROMPT, "List the files here.", "Read hello.py and run it.")
CLIS: dict[str, Callable[[str, Path, Path, str], AgentRun]] = {
    "codex": clis.codex,
    "claude-code": clis.claude_code,
    "opencode": clis.opencode,
    "qwen-code": clis.qwen_code,
}
# as the agent tests serve: flash attention for the long prompts, any model id (Claude Code's haiku)
SERVER: dict[str, Any] = {"ctx_size": 65536, "flash_attn": "on", "alias": [SERVED_ID, "*"]}


def _record(agent: str, model: Path, tries: int) -> bool:
    """Runs `agent` until a run's follow-ups carry tool results back (and, for Codex, one sends an
    output without call_id), at most `tries` times; then the first run with any follow-ups stands
    in. True when the sequences are written."""
    wanted = {agent} | ({"codex-no-call-id"} if agent == "codex" else set())
    fallback: tuple[list[dict[str, Any]], Scrubber] | None = None
    for attempt in range(1, tries + 1):
        with tempfile.TemporaryDirectory(prefix="moeflash-agent-") as tmp:
            home, work = Path(tmp) / "home", clis.project(Path(tmp) / "work")
            with recorded_server(model, **SERVER) as served:
                run = CLIS[agent](served.base_url, work, home, PROMPTS[(attempt - 1) % len(PROMPTS)])
                port = served.server.port
            requests = follow_ups(served.recorder)
            results = carries_tool_results(requests)
            print(
                f"{agent} run {attempt}: exit {run.returncode}, {len(requests)} follow-ups, "
                f"tool results: {results}",
                flush=True,
            )
            stand_ins = {
                str(work): "/workspace/project",
                str(home): "/workspace/home",
                str(REPO): "/workspace/moeflash",
            }
            scrubber = Scrubber(stand_ins, port)
            if requests and fallback is None:
                fallback = requests, scrubber
            if "codex-no-call-id" in wanted and without_call_id(requests):
                # one run stands for both: its follow-ups, Codex's call-id-less outputs among them
                print("  wrote", write("codex-no-call-id", agent, requests, scrubber), flush=True)
                wanted -= {"codex-no-call-id", agent}
            elif agent in wanted and results:
                print("  wrote", write(agent, agent, requests, scrubber), flush=True)
                wanted.discard(agent)
        if not wanted:
            return True
    if agent in wanted and fallback is not None:
        print(
            f"  no run sent tool results back: wrote {write(agent, agent, *fallback)} "
            "(follow-ups without them)"
        )
        wanted.discard(agent)
    if wanted:
        print(f"{agent}: no run in {tries} sent what {sorted(wanted)} needs", flush=True)
    return not wanted


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", default=",".join(CLIS), help="comma-separated: %(default)s")
    parser.add_argument("--tries", type=int, default=24, help="runs per agent at most")
    parser.add_argument(
        "--seed", type=int, default=0, help="the tiny model's weights (whether its random output calls tools)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeflash-model-") as tmp:
        model = generate_model(preset("tiny-qwen3moe"), Path(tmp) / "tiny-qwen3moe.gguf", seed=args.seed)[0]
        recorded = [_record(agent, model, args.tries) for agent in args.agents.split(",")]
    if not all(recorded):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
