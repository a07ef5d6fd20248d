"""The quantized-weight types' old address (plugin API 1.1-1.3): they live in :mod:`plinth.platform.quant`.

Moved with the contract objects in 1.4; this module re-exports them so a plugin written against an
older minor, which imported ``plinth.quant``, keeps working (minors only add). New code imports
:mod:`plinth.platform.quant`.
"""

from plinth.platform.quant import QUANT_BLOCKS, QuantizedWeight, dequantize, dequantize_blocks, quantize_q8_0

__all__ = ["QUANT_BLOCKS", "QuantizedWeight", "dequantize", "dequantize_blocks", "quantize_q8_0"]
