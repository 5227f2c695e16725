"""cfr-atlas: exact long-context LLM inference on the CPU with virtual K/V memory."""

__version__ = "0.1.0"
