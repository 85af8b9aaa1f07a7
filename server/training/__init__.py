"""Training the demo's qwen3moe model here, on the CPU (a dev tool; needs the `training` extra).

corpus (the corpus from installed Debian packages), tokenizer (BPE trained on it, as a GGUF
vocabulary), model (the torch model, llama.cpp's qwen3moe graph), train (the resumable run),
export (the run's checkpoint as a GGUF). docs/training.md says how to run each.
"""
