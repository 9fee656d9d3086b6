"""The format's version and the sizes a model spec may have (FORMAT.md sections 1 and 9): constants only, so that
the command line reads them (``routelog --version``, its options' bounds) without loading the format's models."""

from __future__ import annotations

from typing import Final

FORMAT_VERSION: Final = 4
"""The format this routelog writes, and the newest it reads (it reads every older one too)."""

MAX_STEP: Final = 10**10 - 1
"""The highest step a store keeps (step directories are named with ten digits)."""
MAX_RECORD_TOKENS: Final = 1 << 22
"""Tokens of one record (prompt and response); 4 Mi tokens, far above any context length in use."""
MAX_EXPERTS: Final = 65536
"""Routed experts of a MoE layer, and the universe of a stream: IDs are stored as uint16."""
MAX_TOPK: Final = 1024
"""Experts chosen per token per layer (the routing array's last axis), for the decoder and for every stream."""
MAX_MOE_LAYERS: Final = 4096
"""MoE layers of a model (the routing array's layer axis), layers of a stream and MTP layers."""
MAX_LAYERS: Final = 1 << 16
"""Decoder layers of a model, dense and MoE (``num_layers``): far above any model's depth, and a bound on every
per-layer list routelog builds from a spec or a config, checked before the list is built."""
