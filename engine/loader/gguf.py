"""Weights from a llama.cpp GGUF file, dequantized and renamed to Hugging Face parameter names.

Two things differ from a Hugging Face checkpoint besides quantization:
- names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``;
- llama.cpp's converter PERMUTES the rows of Llama's q/k projections into its own rotary layout (pairs
  of adjacent dimensions rotate together there, halves rotate together in Hugging Face). We un-permute
  them so the model code sees Hugging Face's layout. Qwen2/Qwen3 are converted without that permutation.

Shapes: GGUF lists dimensions fastest-first (``ne``: ``[in_features, out_features]``); the reader's numpy
arrays are already row-major ``[out_features, in_features]``, which is the Hugging Face order.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.executor.kernels.block_codes import BlockCodes
from engine.loader import gguf_blocks
from engine.model_config import GGUF_ARCHITECTURES, ModelConfig, optional_int

_MISSING: Any = object()

# Types stored as plain floats: no dequantization, just a dtype conversion.
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Architectures whose q/k rows llama.cpp's converter permuted (LlamaModel and its subclasses).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")
# the dtypes whose kernels read a matrix's blocks as stored: float32 (small_gemm.c), bfloat16 (amx_qgemm.c)
_BLOCK_DTYPES = (torch.float32, torch.bfloat16)


def open_gguf(path: str | Path) -> GGUFReader:
    """Open (memory-map) a GGUF file; a missing, truncated or corrupt file raises ``ModelLoadError``."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # NOTE: the reader fails with ValueError/IndexError/struct errors on bad bytes.
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt: {type(e).__name__}: {e}") from e
    file_size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise ModelLoadError(
                f"GGUF file {path} is truncated: tensor {t.name} needs bytes up to {end} but the file has "
                f"{file_size} bytes"
            )
    return reader


def gguf_field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key`` (str, int, float, bool or list), or ``default`` when absent."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face parameter name of GGUF tensor ``name``, or ``None`` when it has none."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    layer, kind, param = m.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{param}"


def reverse_permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a q or k projection (weight ``[heads*head_dim, in]`` or bias).

    llama.cpp wrote ``w.view(heads, 2, head_dim/2, ...).transpose(1, 2)``; this is its inverse."""
    half = w.shape[0] // num_heads // 2
    # [num_heads, head_dim/2, 2, *rest] -> [num_heads, 2, head_dim/2, *rest]
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(reader_tensor: Any, where: str) -> torch.Tensor:
    """One GGUF tensor as a float tensor (float32, or float16 when stored so) in Hugging Face shape."""
    qtype = GGMLQuantizationType(int(reader_tensor.tensor_type))
    shape = tuple(int(n) for n in reversed(reader_tensor.shape.tolist()))  # ne order -> row-major
    try:
        decoded = gguf_blocks.decode(reader_tensor.data, qtype)  # the common block types, in torch (fast)
        if decoded is not None:
            return decoded.reshape(shape)
        if qtype in _FLOAT_TYPES:
            array = np.array(reader_tensor.data, dtype=_FLOAT_TYPES[qtype], copy=True)
        else:
            array = dequantize(reader_tensor.data, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{where}: tensor {reader_tensor.name} uses GGML type {qtype.name}, which cannot be dequantized"
        ) from e
    except Exception as e:
        raise ModelLoadError(f"{where}: tensor {reader_tensor.name} ({qtype.name}) is corrupt: {e}") from e
    return torch.from_numpy(np.ascontiguousarray(array).reshape(shape))


def split_tensor(reader_tensor: Any, where: str) -> BlockCodes | None:
    """A 2-D GGUF tensor of one of gguf_blocks' types as its codes, scales and offsets in Hugging Face
    shape; None for other types and shapes."""
    qtype = GGMLQuantizationType(int(reader_tensor.tensor_type))
    shape = tuple(int(n) for n in reversed(reader_tensor.shape.tolist()))  # ne order -> row-major
    if len(shape) != 2 or not gguf_blocks.supports(qtype):
        return None
    try:
        codes = gguf_blocks.split(reader_tensor.data, qtype)
    except Exception as e:
        raise ModelLoadError(f"{where}: tensor {reader_tensor.name} ({qtype.name}) is corrupt: {e}") from e
    if codes is None or tuple(codes.shape) != shape:
        raise ModelLoadError(
            f"{where}: tensor {reader_tensor.name} ({qtype.name}) does not hold {shape} weights"
        )
    return codes


def iter_gguf_weights(
    tensors: Iterable[ReaderTensor],
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    where: str = "GGUF file",
    blocks: dict[str, BlockCodes] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of ``tensors`` (a reader's ``tensors``), one tensor
    dequantized at a time, cast to ``dtype``. With ``blocks`` (and ``dtype`` float32 or bfloat16), a matrix
    stored in Q4_0, Q4_1 or Q8_0 blocks is also put there under its name, as codes, scales and offsets whose
    ``dequantize()`` is the yielded tensor before the cast, bit for bit.

    Unknown tensors raise ``ModelLoadError``: silently skipping one would leave a parameter random."""
    permute = config.architecture in _PERMUTED_ARCHITECTURES
    for t in tensors:
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            raise ModelLoadError(f"{where}: tensor {t.name!r} has no Hugging Face equivalent in cbserve")
        codes = split_tensor(t, where) if blocks is not None and dtype in _BLOCK_DTYPES else None
        w = dequantize_tensor(t, where) if codes is None else codes.dequantize()
        if permute and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
            w = reverse_permute_qk(w, heads)
            codes = (
                None
                if codes is None
                else codes.map_rows(functools.partial(reverse_permute_qk, num_heads=heads))
            )
        if blocks is not None and codes is not None:
            blocks[hf_name] = codes
        yield hf_name, w.to(dtype)


def config_from_gguf(reader: GGUFReader, where: str | None = None) -> ModelConfig:
    """Read llama.cpp's metadata keys (``{arch}.block_count``, ...). Whether the output projection is
    tied, and whether q/k/v have biases or q/k norms, is read from which tensors the file holds."""
    where = where or "GGUF file"
    gguf_arch = gguf_field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(gguf_arch), tuple(GGUF_ARCHITECTURES), where)
    architecture = GGUF_ARCHITECTURES[gguf_arch]
    tensor_names = {t.name for t in reader.tensors}

    def key(suffix: str, default: Any = None, required: bool = True) -> Any:
        value = gguf_field(reader, f"{gguf_arch}.{suffix}", default)
        if value is None and required:
            raise ModelLoadError(f"{where}: GGUF metadata key {gguf_arch}.{suffix!s} is missing")
        return value

    _refuse_unsupported_rope(reader, tensor_names, key, where)
    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", None)
    vocab_size = key("vocab_size", required=False)
    if vocab_size is None:
        if tokens is None:
            raise ModelLoadError(f"{where}: no {gguf_arch}.vocab_size and no tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    head_dim = key("attention.key_length", required=False) or key("rope.dimension_count", required=False)
    eos_ids = [gguf_field(reader, f"tokenizer.ggml.{name}_token_id", None) for name in ("eos", "eot", "eom")]
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(key("attention.head_count_kv", required=False) or num_heads),
            head_dim=int(head_dim) if head_dim else hidden_size // num_heads,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=optional_int(gguf_field(reader, "tokenizer.ggml.bos_token_id", None)),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
            sliding_window=optional_int(key("attention.sliding_window", required=False)),
        )
    except ValueError as e:
        if isinstance(e, UnsupportedArchitectureError):
            raise
        raise ModelLoadError(f"{where}: invalid model metadata: {e}") from e


def _refuse_unsupported_rope(
    reader: GGUFReader, tensor_names: set[str], key: Callable[..., Any], where: str
) -> None:
    """Rope scaling this loader cannot honour is an error, never silently ignored."""
    if "rope_freqs.weight" in tensor_names:
        # NOTE: Llama 3.1+ GGUFs bake their rope scaling into a ``rope_freqs`` tensor instead of metadata;
        # loading without it would silently give wrong attention beyond the original context.
        raise ModelLoadError(
            f"{where}: rope scaling stored as a rope_freqs tensor is not supported; load the Hugging "
            f"Face folder of this model instead"
        )
    scaling_type = key("rope.scaling.type", required=False)
    if scaling_type not in (None, "none"):
        raise ModelLoadError(f"{where}: GGUF rope scaling type {scaling_type!r} is not supported")
