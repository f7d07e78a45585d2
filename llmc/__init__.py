"""llmc: a compiler for Llama-family LLM inference."""

__version__ = "0.1.0"
