"""The pinned Codex CLI against a real server, many times in a row (`make codex-loop`).

Each run is `codex exec` on the demo model's shape (tiny-qwen3moe, random weights) as the agent
test runs it (clis.py). A run passes when Codex exits 0 and the server refused none of its
requests. The loop also counts the runs that sent a function_call_output without a call_id (the
outputs of Codex's goal tools, which the server once refused): the random model calls those tools
in some runs, which is what makes the loop worth its length. It prints one line per run and a
summary, and exits non-zero if a run failed or fewer than --min-no-call-id runs sent such an
output.

    python -m tests.agents.codex_loop [--runs 50] [--min-no-call-id 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from server.modelgen import generate_model, preset
from tests.agents import clis
from tests.agents.harness import recorded_server
from tests.agents.record import PROMPT, SERVER
from tests.agents.sequences import api_requests, without_call_id


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--min-no-call-id", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: tiny-qwen3moe, generated)")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    failed: list[int] = []
    provoked: list[int] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moeflash-codex-loop-") as tmp:
        root = Path(tmp)
        model = args.model or generate_model(preset("tiny-qwen3moe"), root / "tiny-qwen3moe.gguf", seed=0)[0]
        with recorded_server(model, **SERVER) as served:
            for run_no in range(1, args.runs + 1):
                home, work = root / f"run{run_no}" / "home", clis.project(root / f"run{run_no}" / "work")
                first = len(served.recorder.exchanges)
                run = clis.codex(served.base_url, work, home, args.prompt)
                exchanges = served.recorder.exchanges[first:]
                refused = [e for e in exchanges if e.status is None or e.status >= 400]
                requests = api_requests(exchanges)
                no_call_id = without_call_id(requests)
                ok = run.returncode == 0 and not refused
                if not ok:
                    failed.append(run_no)
                if no_call_id:
                    provoked.append(run_no)
                verdict = "pass" if ok else "FAIL"
                print(
                    f"run {run_no}: {verdict} (exit {run.returncode}, {len(requests)} requests, "
                    f"{len(refused)} refused, {no_call_id} outputs without call_id, {run.seconds:.0f} s)",
                    flush=True,
                )
                for exchange in refused:
                    print("  refused:", exchange.summary(), flush=True)
    minutes = (time.monotonic() - started) / 60
    print(
        f"{args.runs - len(failed)} of {args.runs} runs passed in {minutes:.0f} min; "
        f"{len(provoked)} sent a function_call_output without call_id (runs {provoked})"
    )
    if failed or len(provoked) < args.min_no_call_id:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
