"""ahakv-local: quantized GGUF models through a patched llama.cpp with a bounded KV cache."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # imported lazily: `ahakv-local build` must run before llama_cpp is importable
    if name == "Llama":
        from .llama import Llama

        return Llama
    raise AttributeError(name)
