"""Engine adapters: ingest every engine's routing layout into records, and export records back.

One module per engine family: :mod:`~routelog.engines.vllm`, :mod:`~routelog.engines.sglang`,
:mod:`~routelog.engines.hf` (record and replay in HF transformers), the envelopes of frameworks built on vLLM
(:mod:`~routelog.engines.nemo_rl`, :mod:`~routelog.engines.ms_swift`), the trainer-side layouts
:mod:`~routelog.engines.verl` and :mod:`~routelog.engines.slime`, and megatron-core's R2 recordings
(:mod:`~routelog.engines.megatron_r2`). :mod:`~routelog.engines.common` holds the shared rules (layer axes, EPLB
tables, missing rows, provenance, multi-turn stitching) and :mod:`~routelog.engines.versions` what each engine
version emits.
"""

from routelog.engines.common import (
    Payload,
    TurnStitcher,
    logical_ids,
    payload_to_record,
    resolve_layer_axis,
    to_full_axis,
    to_moe_axis,
)

__all__ = [
    "Payload",
    "TurnStitcher",
    "logical_ids",
    "payload_to_record",
    "resolve_layer_axis",
    "to_full_axis",
    "to_moe_axis",
]
