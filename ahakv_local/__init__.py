"""ahakv-local: quantized GGUF models through a patched llama.cpp with a bounded KV cache."""

__version__ = "0.1.0"
