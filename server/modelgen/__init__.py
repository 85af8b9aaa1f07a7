"""Synthetic Mixture-of-Experts GGUF models with random weights, in the real models' layouts.

    from server.modelgen import ModelSpec, preset, generate_model, estimate_size
    spec = dataclasses.replace(preset("tiny-qwen3moe"), n_layer=3)
    paths = generate_model(spec, Path("tiny.gguf"), seed=0)

Modules: spec (ModelSpec, QType, validation), presets, archs (tensors and hparams per
architecture), tokenizer and templates (vocabulary, chat templates), quant (random block
data), gguf_format (header bytes), layout (files, splits, offsets), writer (streaming to disk),
the `moeflash make-model` command line is server/cli/make_model.py.
"""

from server.errors import ModelGenError
from server.modelgen.presets import Preset, preset, preset_names, presets
from server.modelgen.spec import ARCHITECTURES, ModelSpec, QType
from server.modelgen.writer import estimate_size, generate_model

__all__ = [
    "ARCHITECTURES",
    "ModelGenError",
    "ModelSpec",
    "Preset",
    "QType",
    "estimate_size",
    "generate_model",
    "preset",
    "preset_names",
    "presets",
]
