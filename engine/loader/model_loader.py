"""``load_model``: from what the user named to a model with weights, its tokenizer and its defaults.

    source = resolve_model(model, load_format)         # default / GGUF / HF folder / dummy
    config, tokenizer, defaults = <read the source>    # ModelConfig, Tokenizer, generation_config.json
    model = build_model(config, dtype, device)         # engine.executor.models.registry
    model.load_weights(<the source's weights>)         # (hf_name, tensor) pairs, one at a time
    apply_cpu_fast_paths(model, <its blocks>)          # the CPU kernels' modules swapped in

The last step changes no result beyond float rounding; engine/executor/fast_paths.py says what goes where.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from gguf import ReaderTensor
from torch import nn

from engine.cpu.native_build import KernelUnavailable
from engine.errors import ModelLoadError, TokenizerMismatchError
from engine.executor.kernels.block_codes import BlockCodes
from engine.loader.dummy import get_preset, iter_dummy_weights
from engine.loader.gguf import config_from_gguf, iter_gguf_weights, open_gguf
from engine.loader.hf import iter_safetensors_weights, load_generation_config, load_hf_config, read_json
from engine.loader.source import DEFAULT_MODEL, ModelSource, resolve_model
from engine.loader.source import PRESETS as DUMMY_PRESETS
from engine.loader.tokenizer import Tokenizer
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.executor.models.transformers_config import TransformersModelConfig
    from engine.executor.parallel.sharded_transformers import ShardedTransformersForCausalLM

# NOTE: a model's config: the native one, or the shape the transformers backend serves.
AnyModelConfig = TypeVar("AnyModelConfig", "ModelConfig", "TransformersModelConfig")

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class LoadedModel:
    """A model ready to run: weights loaded, in eval mode, on ``device`` in ``dtype``.

    ``generation_defaults`` is the model's ``generation_config.json`` (for a GGUF, its special token ids):
    the defaults a request's sampling parameters override. ``config.eos_token_ids`` already includes the
    EOS ids of the generation config and the tokenizer."""

    config: ModelConfig | TransformersModelConfig
    model: nn.Module
    tokenizer: Tokenizer | None
    generation_defaults: dict[str, Any]
    chat_template: str | None
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    # every row's result is the same bits whatever else shares its step (CpuFastPaths.batch_invariant)
    batch_invariant: bool = False


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}: {e}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """``"auto"``: float32 on CPU (the oracle's precision), bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(
    model: str = DEFAULT_MODEL,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    prepack: bool = True,
    model_impl: str = "auto",
    batch_invariant: bool = False,
    tensor_parallel_size: int = 1,
) -> LoadedModel:
    """Load ``model`` (see ``resolve_model``) and its tokenizer. Raises ``ModelLoadError`` subclasses naming
    the file at fault, ``TokenizerMismatchError`` when the tokenizer has more ids than the embedding.
    ``model_impl``: ``native`` (cbserve's Llama-family code), ``transformers`` (any decoder-only causal LM
    through transformers' modeling code: engine/executor/models/transformers_backend.py) or ``auto`` (native
    where it implements the architecture). ``prepack``: on the CPU, swap in the kernels' modules of the
    native model (engine/executor/fast_paths.py): matmuls over prepacked weights, the fused element-wise
    ops; in float32 (and bfloat16 on AMX) the engine then runs decode steps' layers in one C call (engine/executor/decode_stack.py).
    ``batch_invariant``: insist on kernels whose result for a row does not depend on its batch (the native
    model's CPU kernels: float32 anywhere, bfloat16 on AMX-BF16 tiles or else in float32 on the small
    kernel over its weights; on CUDA its Triton kernels), ``ValueError``
    where they cannot run.
    ``tensor_parallel_size`` > 1: the native model in that many shards, one process per rank, this one
    rank 0 (engine/loader/shards.py), each rank's matmuls and element-wise ops on the CPU fast paths too
    (``prepack``), not the decode stack."""
    # NOTE: imported here: models import engine.model_config
    from engine.executor.models.registry import choose_model_impl

    source = resolve_model(model, load_format)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    impl = choose_model_impl(_raw_config(source), model_impl)
    _check_torchrun(tensor_parallel_size)
    if tensor_parallel_size != 1 and batch_invariant:
        raise ValueError("tensor_parallel_size > 1 runs without batch_invariant's kernels")
    if impl == "transformers":
        if batch_invariant:
            raise ValueError(
                "batch_invariant needs the native model's CPU kernels, not the transformers backend"
            )
        return _load_with_transformers(
            source, torch_dtype, torch_device, tensor_parallel_size, model, load_format
        )
    if tensor_parallel_size != 1:
        return _load_sharded(
            model, load_format, source, torch_dtype, torch_device, prepack, tensor_parallel_size
        )
    if batch_invariant and not (torch_device.type == "cuda" or (torch_device.type == "cpu" and prepack)):
        raise ValueError(
            "batch_invariant needs cbserve's kernels: the CPU's (prepacked weights) or CUDA's (Triton)"
        )
    return _load_native(source, torch_dtype, torch_device, prepack, batch_invariant)


def _check_torchrun(tensor_parallel_size: int) -> None:
    """Under torchrun every process it started is one rank of one model: ``ValueError`` unless
    ``tensor_parallel_size`` is its ``WORLD_SIZE`` (engine/executor/parallel/torchrun.py)."""
    from engine.executor.parallel.torchrun import TorchrunRank

    torchrun = TorchrunRank.from_env()
    if torchrun is not None and torchrun.world_size != tensor_parallel_size:
        raise ValueError(
            f"started by torchrun with WORLD_SIZE={torchrun.world_size}: give tensor_parallel_size "
            f"{torchrun.world_size} (every process torchrun starts is one rank of the model), not "
            f"{tensor_parallel_size}"
        )


def _load_native(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    prepack: bool,
    batch_invariant: bool = False,
) -> LoadedModel:
    from engine.executor.fast_paths import apply_cpu_fast_paths
    from engine.executor.kernels.cuda_batch_invariant import apply_cuda_batch_invariance
    from engine.executor.kernels.triton_elementwise import use_triton_elementwise
    from engine.executor.kernels.triton_rms_norm import use_triton_rms_norms
    from engine.executor.models.registry import build_model

    opened = open_source(source, dtype, device)
    if opened.tokenizer is not None and opened.tokenizer.vocab_size > opened.config.vocab_size:
        raise TokenizerMismatchError(opened.tokenizer.vocab_size, opened.config.vocab_size, source.name)
    config = _with_all_eos(opened.config, opened.generation_defaults, opened.tokenizer)
    net = build_model(config, dtype, device)
    invariant = False
    with torch.no_grad():
        net.load_weights(opened.weights)
        if prepack:
            invariant = apply_cpu_fast_paths(net, opened.blocks, batch_invariant).batch_invariant
    if device.type == "cuda":
        try:
            use_triton_rms_norms(net)
            use_triton_elementwise(net)
        except KernelUnavailable as e:
            logger.warning("the norms, rotations and gates run in PyTorch (%s)", e)
    if batch_invariant and device.type == "cuda":
        try:
            apply_cuda_batch_invariance(net)
        except KernelUnavailable as e:
            raise ValueError(f"batch_invariant on CUDA needs Triton's kernels: {e}") from e
        invariant = True
    if batch_invariant and not invariant:
        raise ValueError(
            f"batch_invariant: no batch-invariant matmul kernel for {dtype} on this CPU (cbserve's small "
            "matmul kernel could not be built here: the log says why)"
        )
    net.eval()
    return LoadedModel(
        config=config,
        model=net,
        tokenizer=opened.tokenizer,
        generation_defaults=opened.generation_defaults,
        chat_template=opened.tokenizer.chat_template if opened.tokenizer is not None else None,
        source=source,
        dtype=dtype,
        device=device,
        batch_invariant=invariant,
    )


def _load_sharded(
    model: str,
    load_format: str,
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    prepack: bool,
    world_size: int,
) -> LoadedModel:
    """The native model in ``world_size`` shards (engine/loader/shards.py): this process holds rank 0's."""
    from engine.loader.shards import load_sharded

    opened = open_source(source, dtype, device)  # its config, tokenizer and defaults: no weight is read
    if opened.tokenizer is not None and opened.tokenizer.vocab_size > opened.config.vocab_size:
        raise TokenizerMismatchError(opened.tokenizer.vocab_size, opened.config.vocab_size, source.name)
    net = load_sharded(model, load_format, opened.config, dtype, device, world_size, open_source, prepack)
    return LoadedModel(
        config=_with_all_eos(opened.config, opened.generation_defaults, opened.tokenizer),
        model=net,
        tokenizer=opened.tokenizer,
        generation_defaults=opened.generation_defaults,
        chat_template=opened.tokenizer.chat_template if opened.tokenizer is not None else None,
        source=source,
        dtype=dtype,
        device=device,
    )


def _load_with_transformers(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int,
    model: str,
    load_format: str,
) -> LoadedModel:
    """The source's model through the transformers backend (``transformers_model``), wrapped to serve from
    cbserve's paged KV cache; ``world_size`` > 1: in that many shards by the model's own tensor-parallel
    plan, this process rank 0 (engine/loader/shards.py), ``ShardingError`` before any rank starts where
    the model has no plan or its plan does not divide by ``world_size``."""
    from engine.executor.models.transformers_backend import TransformersForCausalLM

    tokenizer, defaults = _tokenizer_and_defaults(source, dtype, device)
    net: TransformersForCausalLM
    if world_size == 1:
        net = TransformersForCausalLM.wrap(transformers_model(source, dtype, device), source.name)
        full = net.config
        _check_tokenizer(tokenizer, full.vocab_size, source)
    else:
        sharded = _load_transformers_sharded(model, load_format, source, dtype, device, world_size, tokenizer)
        net, full = sharded, sharded.full_config
    config = _with_all_eos(full, defaults, tokenizer)
    if world_size == 1:
        net.config = config
    return LoadedModel(
        config=config,
        model=net,
        tokenizer=tokenizer,
        generation_defaults=defaults,
        chat_template=tokenizer.chat_template if tokenizer is not None else None,
        source=source,
        dtype=dtype,
        device=device,
    )


def _check_tokenizer(tokenizer: Tokenizer | None, vocab_size: int, source: ModelSource) -> None:
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise TokenizerMismatchError(tokenizer.vocab_size, vocab_size, source.name)


def _load_transformers_sharded(
    model: str,
    load_format: str,
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int,
    tokenizer: Tokenizer | None,
) -> ShardedTransformersForCausalLM:
    """The transformers model in ``world_size`` shards (engine/loader/shards.py), each rank's made by
    ``transformers_rank_model``; its plan and tokenizer checked on the model built on the meta device
    before any rank starts."""
    from engine.executor.parallel.sharded_transformers import ShardedTransformersForCausalLM
    from engine.executor.parallel.transformers_plan import heads_per_rank, planned_modules
    from engine.loader import transformers_weights
    from engine.loader.shards import load_sharded

    meta = transformers_weights.meta_model(_raw_config(source), source.name)  # no weight read
    hf_config: Any = meta.config
    text = hf_config.get_text_config()
    _check_tokenizer(tokenizer, int(text.vocab_size), source)
    modules = planned_modules(meta, world_size, source.name)
    heads = int(text.num_attention_heads)
    heads_per_rank(
        modules, heads, int(getattr(text, "num_key_value_heads", None) or heads), world_size, source.name
    )
    net = load_sharded(
        model,
        load_format,
        None,
        dtype,
        device,
        world_size,
        transformers_rank_model,
        model_impl="transformers",
    )
    assert isinstance(net, ShardedTransformersForCausalLM)
    return net


def transformers_rank_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, rank: int, world_size: int
) -> tuple[nn.Module, dict[str, str]]:
    """Rank ``rank`` of ``world_size``'s transformers model, holding its parts of the modules its
    tensor-parallel plan cuts, and those modules (``planned_modules``): a safetensors folder read slice by
    slice, a GGUF's tensors cut as they come (engine/loader/transformers_slices.py); a dummy model is built
    whole (seeded: every rank builds the same), then cut."""
    from engine.executor.parallel.transformers_plan import cut_to_rank, planned_modules
    from engine.loader import transformers_slices

    raw = _raw_config(source)
    if source.kind == "safetensors":
        folder = _path_of(source)
        return transformers_slices.load_rank_slices(folder, raw, dtype, device, rank, world_size, source.name)
    if source.kind == "gguf":
        weights = open_source(source, dtype, device).weights
        return transformers_slices.cut_rank_tensors(
            weights, raw, dtype, device, rank, world_size, source.name
        )
    hf_model = transformers_model(source, dtype, device)
    modules = planned_modules(hf_model, world_size, source.name)
    cut_to_rank(hf_model, modules, rank, world_size)
    return hf_model, modules


def _tokenizer_and_defaults(
    source: ModelSource, dtype: torch.dtype, device: torch.device
) -> tuple[Tokenizer | None, dict[str, Any]]:
    """The tokenizer and generation defaults of a source served by the transformers backend."""
    if source.kind == "gguf":
        opened = open_source(source, dtype, device)  # NOTE: the weights are lazy: none is read
        return opened.tokenizer, opened.generation_defaults
    folder = source.folder if source.kind != "dummy" or source.preset is None else None
    defaults = load_generation_config(folder) if folder is not None else {}
    return _tokenizer_of(source), defaults


def transformers_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The source's transformers model, weights in: ``from_pretrained`` for a folder, a GGUF's tensors, or
    random (seeded: every rank of a sharded model builds the same) for a dummy."""
    from engine.loader import transformers_weights

    raw = _raw_config(source)
    if source.kind == "safetensors":
        return transformers_weights.from_pretrained(_path_of(source), raw, dtype, device)
    if source.kind == "gguf":
        opened = open_source(source, dtype, device)
        return transformers_weights.from_tensors(raw, opened.weights, dtype, device, source.name)
    return transformers_weights.random_weights(raw, dtype, device, source.name)


def _raw_config(source: ModelSource) -> dict[str, Any]:
    """The source's ``config.json`` as a dict (for a GGUF or a preset, the one its config writes)."""
    if source.kind == "safetensors":
        return read_json(_path_of(source) / "config.json")
    if source.kind == "dummy" and source.path is not None and source.path.suffix.lower() == ".json":
        return read_json(source.path)
    return _native_config(source).to_hf_dict()


def load_tokenizer(model: str = DEFAULT_MODEL) -> Tokenizer:
    """Only the tokenizer of ``model`` (no weights read): for clients that build prompts of exact token
    lengths. A dummy preset name gives the tokenizer its dummy model would use."""
    source = resolve_model(model, "dummy" if model in DUMMY_PRESETS else "auto")
    tokenizer = _tokenizer_of(source)
    if tokenizer is None:
        raise ModelLoadError(f"{source.name} has no tokenizer (no tokenizer.json next to its config.json)")
    return tokenizer


# ---------------------------------------------------------------------- per source kind
@dataclass
class OpenedSource:
    """A model source read but not built: its config, tokenizer, defaults and a lazy iterator over its
    weights in Hugging Face names (what ``load_model`` loads, and what a peer such as transformers can load
    to run the very same weights: bench/offline.py)."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    generation_defaults: dict[str, Any]
    weights: Iterator[tuple[str, torch.Tensor]]
    # float32 GGUF: the block-quantized matrices as stored, filled in as ``weights`` is read (for the
    # small-batch kernel's quantized panels; engine/executor/kernels/block_codes.py)
    blocks: dict[str, BlockCodes] = field(default_factory=dict)


def open_source(source: ModelSource, dtype: torch.dtype, device: torch.device) -> OpenedSource:
    if source.kind == "gguf":
        path = _path_of(source)
        parsed = _parse_gguf(path)
        blocks: dict[str, BlockCodes] = {}
        weights = iter_gguf_weights(parsed.tensors, parsed.config, dtype, str(path), blocks)
        defaults = _gguf_generation_defaults(parsed.tokenizer)
        return OpenedSource(parsed.config, parsed.tokenizer, defaults, weights, blocks)
    if source.kind == "safetensors":
        path = _path_of(source)
        config = load_hf_config(path)
        weights = iter_safetensors_weights(path, dtype=dtype, device=device)
        return OpenedSource(config, _tokenizer_of(source), load_generation_config(path), weights)
    config = _dummy_config(source)
    tokenizer = _tokenizer_of(source)
    # a dummy built from a config.json uses that folder's generation defaults too
    json_path = source.path if source.path is not None and source.path.suffix == ".json" else None
    defaults = load_generation_config(json_path.parent) if json_path is not None else {}
    return OpenedSource(config, tokenizer, defaults, iter_dummy_weights(config, dtype, device))


def _path_of(source: ModelSource) -> Path:
    if source.path is None:
        raise ModelLoadError(f"model source {source.name!r} ({source.kind}) has no path")
    return source.path


def _native_config(source: ModelSource) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF or a dummy source."""
    if source.kind == "gguf":
        return _parse_gguf(_path_of(source)).config
    return _dummy_config(source)


def _dummy_config(source: ModelSource) -> ModelConfig:
    if source.preset is not None:
        return get_preset(source.preset)
    path = _path_of(source)
    if path.suffix.lower() == ".gguf":
        return _parse_gguf(path).config
    return ModelConfig.from_hf_dict(read_json(path), where=str(path))


def _tokenizer_of(source: ModelSource) -> Tokenizer | None:
    """The source's tokenizer. A dummy preset has no files: it borrows the default model's tokenizer
    (its ids fit every preset's vocabulary), so benchmarks can still turn text into prompts."""
    if source.path is not None and source.path.suffix.lower() == ".gguf":
        return _parse_gguf(source.path).tokenizer
    folder = source.folder
    if folder is not None and (folder / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(folder)
    if source.kind == "dummy" and source.preset is not None:
        try:
            return _tokenizer_of(resolve_model(DEFAULT_MODEL))
        except ModelLoadError as e:
            logger.warning("dummy preset %s: no tokenizer (%s)", source.preset, e)
            return None
    logger.warning("%s: no tokenizer.json; text prompts and chat are unavailable", source.name)
    return None


@dataclass(frozen=True)
class ParsedGGUF:
    """What loading needs from a GGUF file, read once: its config, its tokenizer, and its tensors (views of
    the memory-mapped file, still quantized)."""

    config: ModelConfig
    tokenizer: Tokenizer
    tensors: tuple[ReaderTensor, ...]


def _parse_gguf(path: Path) -> ParsedGGUF:
    """The file's parse, shared by every load of the same file (path, size and modification time) in this
    process. gguf-py reads a vocabulary's strings one by one, seconds for the default model, paid again by
    every engine a test suite or a benchmark builds. Only what loading uses is kept, not the reader's
    metadata objects."""
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"GGUF file {path} cannot be read: {e}") from e
    return _parse_gguf_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parse_gguf_cached(path: str, size: int, mtime_ns: int) -> ParsedGGUF:
    reader = open_gguf(path)
    return ParsedGGUF(
        config_from_gguf(reader, path), Tokenizer.from_gguf(reader, path), tuple(reader.tensors)
    )


def _gguf_generation_defaults(tokenizer: Tokenizer) -> dict[str, Any]:
    """A GGUF carries no generation_config.json; its special ids are the generation defaults there are."""
    defaults: dict[str, Any] = {}
    if tokenizer.bos_token_id is not None:
        defaults["bos_token_id"] = tokenizer.bos_token_id
    if tokenizer.eos_token_ids:
        ids = list(tokenizer.eos_token_ids)
        defaults["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if tokenizer.pad_token_id is not None:
        defaults["pad_token_id"] = tokenizer.pad_token_id
    return defaults


def _with_all_eos(
    config: AnyModelConfig, defaults: dict[str, Any], tokenizer: Tokenizer | None
) -> AnyModelConfig:
    """``config`` whose ``eos_token_ids`` also holds generation_config.json's and the tokenizer's EOS ids
    (Llama 3 Instruct ends turns with <|eot_id|>, listed only in generation_config.json)."""
    ids = list(config.eos_token_ids)
    eos = defaults.get("eos_token_id")
    ids += [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None:
        ids += list(tokenizer.eos_token_ids)
    merged = tuple(dict.fromkeys(int(i) for i in ids if 0 <= int(i) < config.vocab_size))
    return config if merged == config.eos_token_ids else config.replace(eos_token_ids=merged)
