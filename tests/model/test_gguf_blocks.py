"""The torch dequantizers of engine/loader/gguf_blocks.py against gguf-py's own, bit for bit: on blocks
gguf-py quantized, on every byte pattern a block can hold, and on the default model's tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from engine.loader import gguf_blocks
from engine.loader.gguf import dequantize_tensor

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def _same_bits(ours: torch.Tensor, theirs_array: np.ndarray) -> None:
    """Equal bit for bit, except that a NaN's payload may differ (both are NaN there)."""
    theirs = torch.from_numpy(np.ascontiguousarray(theirs_array, np.float32))
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    nan = torch.isnan(theirs)
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan].view(torch.int32), theirs[~nan].view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_weights_decode_as_gguf_py_decodes_them(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 3.0, (7, 1))).astype(np.float32)
    data = quantize(weights, qtype)  # [7, 3 blocks x block bytes] uint8
    _same_bits(gguf_blocks.decode(data, qtype), dequantize(data, qtype))
    _same_bits(gguf_blocks.decode(data.reshape(-1), qtype), dequantize(data.reshape(-1), qtype))  # 1-D


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf-py on inf * 0
def test_every_byte_pattern_decodes_as_gguf_py(qtype: GGMLQuantizationType) -> None:
    """Random bytes: any scale (subnormal, huge, negative zero, inf, NaN) and every nibble and int8 value."""
    rng = np.random.default_rng(1)
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (4096, block_bytes), dtype=np.uint8)
    _same_bits(gguf_blocks.decode(data, qtype), dequantize(data, qtype))


def test_other_types_are_left_to_gguf_py_and_partial_blocks_are_refused() -> None:
    data = np.zeros((2, 210), dtype=np.uint8)
    assert gguf_blocks.decode(data, GGMLQuantizationType.Q6_K) is None
    assert not gguf_blocks.supports(GGMLQuantizationType.F32)
    with pytest.raises(ValueError, match="whole number of blocks"):
        gguf_blocks.decode(np.zeros((2, 33), dtype=np.uint8), GGMLQuantizationType.Q8_0)


def test_the_default_models_tensors_decode_as_gguf_py(smollm2_reader: GGUFReader, smollm2_gguf_path: Path) -> None:
    """The file's own tensors, through the loader's ``dequantize_tensor``."""
    seen = set()
    for t in smollm2_reader.tensors:
        qtype = GGMLQuantizationType(int(t.tensor_type))
        if not gguf_blocks.supports(qtype) or qtype in seen:
            continue
        seen.add(qtype)
        ours = dequantize_tensor(t, str(smollm2_gguf_path))
        _same_bits(ours, dequantize(t.data, qtype).reshape(tuple(ours.shape)))
    assert seen == {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
