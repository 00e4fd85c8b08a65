"""Quantized weight formats of Beam checkpoints (BEAM_SPEC.md, "Checkpoint layout").

NVFP4 (NVIDIA ModelOpt, group size 16) stores each weight as 4-bit E2M1 codes (magnitudes
0, .5, 1, 1.5, 2, 3, 4, 6 and a sign bit) packed two per byte, one float8_e4m3fn scale per 16
values along the input dim and one fp32 global scale per matrix: `W = e2m1 * f32(block) * global`.
FP8 stores float8_e4m3fn values with an fp32 scale per output channel (compressed-tensors
FP8_DYNAMIC, whose activations are quantized per token at run time) or per tensor (ModelOpt FP8,
with a static `input_scale`). Quantizers and the reference dequantizers are numpy (host side); the
`dequantize_*` and activation functions are jnp and run under jit. Both weight classes are jax
pytrees whose leading dims may stack experts `[E, out, in]`.
"""

from beam_jax.quant.fp8 import (
    FP8Weight,
    dequantize_activations,
    dequantize_fp8,
    dequantize_fp8_reference,
    quantize_activations_per_token,
    quantize_activations_static,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    stack_fp8,
)
from beam_jax.quant.nvfp4 import (
    E2M1_VALUES,
    NVFP4Weight,
    decode_e2m1,
    dequantize_nvfp4,
    dequantize_nvfp4_reference,
    encode_e2m1,
    pack_nibbles,
    quantize_nvfp4,
    stack_nvfp4,
    unpack_nibbles,
)

__all__ = [
    "E2M1_VALUES",
    "FP8Weight",
    "NVFP4Weight",
    "decode_e2m1",
    "dequantize_activations",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "dequantize_nvfp4",
    "dequantize_nvfp4_reference",
    "encode_e2m1",
    "pack_nibbles",
    "quantize_activations_per_token",
    "quantize_activations_static",
    "quantize_fp8_per_channel",
    "quantize_fp8_per_tensor",
    "quantize_nvfp4",
    "stack_fp8",
    "stack_nvfp4",
    "unpack_nibbles",
]
