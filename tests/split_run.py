"""A model loaded as `serve` loads it, decoded greedily, in a process of its own: how the tests run
a main server with RPC helpers (ggml's device registry is the process's, so the pytest process
registers none). Prints one JSON line: the tokens, a sha256 of every logits row, the layers kept
here and the streamer's counters.

    python -m tests.split_run SETTINGS_JSON PROMPT_JSON N_TOKENS
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from server.errors import MoeflashError
from server.loading.loader import load_model
from server.settings import load_settings
from tests.models import greedy


def main(argv: list[str]) -> int:
    settings_json, prompt_json, n_tokens = argv
    _, settings = load_settings(json.loads(settings_json))
    try:
        model = load_model(settings)
    except MoeflashError as exc:  # as the command line says it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        tokens, digest = greedy(model.llama, json.loads(prompt_json), int(n_tokens))
        streamer = model.llama.streamer
        print(
            json.dumps(
                {
                    "tokens": tokens,
                    "digest": digest,
                    "stats": asdict(streamer.stats()) if streamer is not None else None,
                    "moe_layers_streamed": streamer.n_moe_layers if streamer is not None else None,
                }
            )
        )
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
