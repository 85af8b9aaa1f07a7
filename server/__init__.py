"""moeflash: run Mixture-of-Experts models larger than RAM behind an OpenAI-compatible server."""

__version__ = "0.1.0"
