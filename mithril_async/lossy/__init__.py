"""Lossy tier (opt-in): HPΔKV residuals, error-bounded quantisers, ExCP-style lossy deltas.

Nothing here is applied unless the user asks for it; every lossy result carries the parameters
a manifest must record (``has_quantization``), and tensors marked exact are stored losslessly.
Byte layouts and measured numbers: docs/FORMAT.md (HPΔKV section).
"""

from mithril_async.lossy.excp import (
    LossyCheckpoint,
    LossyDeltaConfig,
    LossyDeltaDecoder,
    LossyDeltaEncoder,
    decode_chain,
)
from mithril_async.lossy.fixedpoint import FixedPointTensor, fixed_point_decode, fixed_point_encode
from mithril_async.lossy.hpdkv import estimate_hpdkv_size, pack_residuals, unpack_residuals
from mithril_async.lossy.nf4 import ResidualQuantized, quantize_with_residuals
from mithril_async.lossy.quant import (
    ErrorBound,
    QuantizedTensor,
    allocate_bits,
    dequantize,
    quantize,
)
from mithril_async.lossy.serial import checkpoint_from_bytes, checkpoint_to_bytes
from mithril_async.lossy.training import adam_state, load_adam_state

__all__ = [
    "ErrorBound",
    "FixedPointTensor",
    "LossyCheckpoint",
    "LossyDeltaConfig",
    "LossyDeltaDecoder",
    "LossyDeltaEncoder",
    "QuantizedTensor",
    "ResidualQuantized",
    "adam_state",
    "allocate_bits",
    "checkpoint_from_bytes",
    "checkpoint_to_bytes",
    "decode_chain",
    "dequantize",
    "estimate_hpdkv_size",
    "fixed_point_decode",
    "fixed_point_encode",
    "load_adam_state",
    "pack_residuals",
    "quantize",
    "quantize_with_residuals",
    "unpack_residuals",
]
