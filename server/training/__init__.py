"""Training the demo's qwen3moe model here, on the CPU (a dev tool; needs the `training` extra).

corpus (the corpus from installed Debian packages), tokenizer (BPE trained on it, as a GGUF
vocabulary), model (the torch model, llama.cpp's qwen3moe graph), train (the resumable run),
export (the run's checkpoint as a GGUF), measure (its quality and routing). docs/training.md
says how to run each.

trained/ holds what the run made and the repository ships: the demo model `make serve` serves
(with its sha256), the run's run.json, tokenizer.json and loss curve. Serving it needs none of
the training extra.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "trained"
DEMO_MODEL = DEMO_DIR / "demo-qwen3moe.gguf"
