"""A transformers model's own tensor-parallel plan (``model.tp_plan``: its config's ``base_model_tp_plan`` and
its class's ``_tp_plan``, e.g. ``{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head":
"colwise_gather_output"}``), applied over cbserve's ranks (engine/executor/parallel/group.py).

transformers applies its plan with DTensor parameters over a ``DeviceMesh``, which needs torch.distributed's
one default process group per process (``init_process_group``). Rank 0 is the server's process: its groups
are plain gloo/NCCL groups of their own, several may live in one process (one per engine), and a dead peer
must fail a step, not the process. So the plan's styles are applied here with the same Megatron rules: a
rank holds the part of each planned module's parameters that ``part_of`` names (read as such from a
safetensors checkpoint, engine/loader/transformers_slices.py; or cut from a whole model, ``cut_to_rank``),
and ``hook_plan`` hooks the modules' forwards to the ranks' collectives (transformers' own inference path
does the same: the local matmul, then one all-reduce):

    colwise                  rows [r O/N, (r+1) O/N) of weight and bias: the rank's heads / intermediate rows
    rowwise                  columns [r I/N, (r+1) I/N) of weight; y = all_reduce(x W_r^T) + b
    colwise_gather_output    rows as colwise (padded to ceil(O/N)); the ranks' outputs gathered side by side
    rowwise_split_input      the rank's slice of a whole input, then as rowwise
    embedding_rowwise        vocabulary rows (padded); ids outside them embed to 0; all_reduce
    replicate, replicated_with_grad_allreduce   whole on every rank (nothing to do at inference)

A model without a plan, or whose plan uses another style (packed MoE experts, MLA's fused projections,
sequence parallelism), is refused with ``ShardingError`` before any rank starts (``planned_modules``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.executor.parallel.group import ShardGroup
from engine.executor.parallel.sharding import ShardingError, vocab_per_rank

LINEAR_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
)
EMBEDDING_STYLES = ("embedding_rowwise",)
WHOLE_STYLES = ("replicate", "replicated_with_grad_allreduce")
ROWWISE_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep")
STYLES = LINEAR_STYLES + EMBEDDING_STYLES + WHOLE_STYLES


def planned_modules(hf_model: nn.Module, world_size: int, model: str) -> dict[str, str]:
    """Every module of ``hf_model`` its plan names (``*`` matches a layer number) -> its style. Raises
    ``ShardingError`` when the model has no plan, its plan has a style this module does not apply, a planned
    module is not the ``Linear`` / ``Embedding`` its style cuts, or ``world_size`` does not divide what
    a style cuts evenly (colwise rows, rowwise columns)."""
    plan: dict[str, str] = dict(getattr(hf_model, "tp_plan", None) or {})
    name = type(hf_model).__name__
    if not plan:
        raise ShardingError(
            f"{model}: transformers has no tensor-parallel plan for {name} (no tp_plan / base_model_tp_plan), "
            "so the transformers backend cannot shard it"
        )
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ShardingError(
            f"{model}: {name}'s tensor-parallel plan uses {', '.join(unknown)}; cbserve applies "
            f"{', '.join(STYLES)}"
        )
    patterns = [
        (re.compile(re.escape(key).replace(r"\*", r"\d+") + "$"), style) for key, style in plan.items()
    ]
    found: dict[str, str] = {}
    for module_name, module in hf_model.named_modules():
        style = next((style for pattern, style in patterns if pattern.match(module_name)), None)
        if style is None or style in WHOLE_STYLES:
            continue
        _check_module(module_name, module, style, world_size, model)
        found[module_name] = style
    if not found:
        raise ShardingError(f"{model}: {name}'s tensor-parallel plan names none of its modules")
    return found


def heads_per_rank(
    modules: dict[str, str], heads: int, kv_heads: int, world_size: int, model: str
) -> tuple[int, int]:
    """The (query heads, KV heads) of one rank under ``modules``' styles: ``1/N`` of them where the plan
    cuts the key projection's columns (transformers' ``get_kv_heads_per_rank``), all where it gathers them.
    ``ShardingError`` when ``world_size`` does not divide the heads it cuts."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    mine = (
        get_kv_heads_per_rank(modules, heads, world_size),
        get_kv_heads_per_rank(modules, kv_heads, world_size),
    )
    if not isinstance(mine[0], int) or not isinstance(mine[1], int):
        raise ShardingError(
            f"{model}: tensor_parallel_size {world_size} must divide its {heads} attention heads and its "
            f"{kv_heads} KV heads"
        )
    return mine[0], mine[1]


def _check_module(name: str, module: nn.Module, style: str, world_size: int, model: str) -> None:
    kind = nn.Embedding if style in EMBEDDING_STYLES else nn.Linear
    if not isinstance(module, kind):
        raise ShardingError(
            f"{model}: {name} is a {type(module).__name__}; the {style} style cuts a {kind.__name__}"
        )
    if style == "colwise" and module.weight.shape[0] % world_size:
        raise ShardingError(
            f"{model}: tensor_parallel_size {world_size} must divide the {module.weight.shape[0]} outputs of {name}"
        )
    if style in ROWWISE_STYLES and module.weight.shape[1] % world_size:
        raise ShardingError(
            f"{model}: tensor_parallel_size {world_size} must divide the {module.weight.shape[1]} inputs of {name}"
        )


@dataclass(frozen=True)
class Part:
    """The part of a whole parameter that one rank holds: ``[start, stop)`` along ``dim`` (0: rows,
    1: columns), zero-padded to ``size`` rows (the last rank's vocabulary rows)."""

    dim: int
    start: int
    stop: int
    size: int

    def take(self, whole: Any) -> torch.Tensor:
        """The part of ``whole``: a tensor, or a safetensors slice (``safe_open(...).get_slice(name)``),
        which then reads only these rows / columns from its file."""
        span = slice(self.start, self.stop)
        mine: torch.Tensor = whole[span] if self.dim == 0 else whole[:, span]
        if mine.shape[0] == self.size or self.dim != 0:
            return mine
        return torch.cat((mine, mine.new_zeros((self.size - mine.shape[0], *mine.shape[1:]))))


def part_of(style: str | None, param: str, shape: torch.Size, rank: int, world_size: int) -> Part | None:
    """The part of parameter ``param`` (``weight``, ``bias``; whole shape ``shape``) of a module planned
    ``style`` (None: not planned) that rank ``rank`` holds, or None where every rank holds it whole."""
    if style in ("colwise", "colwise_gather_output", "colwise_rep") or (
        style in EMBEDDING_STYLES and param == "weight"
    ):
        padded = style != "colwise"  # NOTE: a vocabulary need not divide; heads and intermediate rows do
        per_rank = vocab_per_rank(shape[0], world_size) if padded else shape[0] // world_size
        start = min(rank * per_rank, shape[0])
        return Part(0, start, min(start + per_rank, shape[0]), per_rank)
    if style in ROWWISE_STYLES and param == "weight":
        per_rank = shape[1] // world_size
        return Part(1, rank * per_rank, (rank + 1) * per_rank, per_rank)
    return None  # a row-parallel bias is added once, after the sum


def cut_to_rank(hf_model: nn.Module, modules: dict[str, str], rank: int, world_size: int) -> None:
    """Cut the whole parameters of ``modules`` (``planned_modules``) to rank ``rank``'s parts in place. Tied
    parameters are cut once per module: each module gets its own."""
    named = dict(hf_model.named_modules())
    with torch.no_grad():
        for name, style in modules.items():
            module = named[name]
            for param, value in list(module.named_parameters(recurse=False)):
                part = part_of(style, param, value.shape, rank, world_size)
                if part is not None:
                    _keep(module, param, part.take(value))


def hook_plan(hf_model: nn.Module, modules: dict[str, str], group: ShardGroup) -> None:
    """Hook each of ``modules`` to the collectives its style needs. Its parameters are rank ``group.rank``'s
    parts already (``cut_to_rank``, or read as such: engine/loader/transformers_slices.py); its attributes
    (``out_features``, ``num_embeddings``) still the whole module's, and set here to the part's."""
    named = dict(hf_model.named_modules())
    with torch.no_grad():
        for name, style in modules.items():
            HOOKS[style](named[name], group)


def _keep(module: nn.Module, param: str, value: torch.Tensor) -> None:
    """Replace ``module``'s parameter ``param`` by ``value`` (a fresh parameter: a tied one stays whole)."""
    module.register_parameter(param, nn.Parameter(value.contiguous(), requires_grad=False))


def _columns(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = x.shape[-1] // world_size
    return x[..., rank * per_rank : (rank + 1) * per_rank]


def _colwise(linear: nn.Module, group: ShardGroup) -> None:
    assert isinstance(linear, nn.Linear)
    linear.out_features = linear.weight.shape[0]


def _colwise_gather(linear: nn.Module, group: ShardGroup) -> None:
    assert isinstance(linear, nn.Linear)
    width = linear.out_features
    _colwise(linear, group)

    def gather(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        rows = output.reshape(-1, output.shape[-1])  # [tokens, O / N]
        whole = group.all_gather_columns(rows)[:, :width]
        return whole.reshape(*output.shape[:-1], width)

    linear.register_forward_hook(gather)


def _rowwise(linear: nn.Module, group: ShardGroup, split_input: bool = False) -> None:
    assert isinstance(linear, nn.Linear)
    bias = None if linear.bias is None else linear.bias.detach()
    linear.register_parameter("bias", None)  # NOTE: added once, after the sum
    linear.in_features = linear.weight.shape[1]

    def own_slice(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (_columns(args[0], group.rank, group.world_size), *args[1:])

    def reduce(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        y = group.all_reduce(output.contiguous())
        return y if bias is None else y + bias

    if split_input:
        linear.register_forward_pre_hook(own_slice)
    linear.register_forward_hook(reduce)


def _embedding_rows(embedding: nn.Module, group: ShardGroup) -> None:
    assert isinstance(embedding, nn.Embedding)
    rows = embedding.weight.shape[0]  # [ceil(V / N), hidden]
    start = group.rank * rows
    embedding.num_embeddings = rows
    embedding.padding_idx = None  # NOTE: it only stops gradients, and may lie outside the rank's rows
    outside: list[torch.Tensor] = []  # the ids of the forward under way that other ranks embed

    def local_ids(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        local = args[0] - start
        outside[:] = [(local < 0) | (local >= rows)]
        return (local.masked_fill(outside[0], 0), *args[1:])

    def reduce(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output.masked_fill(outside[0][..., None], 0.0).contiguous())

    embedding.register_forward_pre_hook(local_ids)
    embedding.register_forward_hook(reduce)


HOOKS: dict[str, Callable[[nn.Module, ShardGroup], None]] = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "colwise_gather_output": _colwise_gather,
    "colwise_rep": _colwise_gather,
    "rowwise_split_input": lambda m, g: _rowwise(m, g, split_input=True),
    "rowwise_rep": lambda m, g: _rowwise(m, g, split_input=True),
    "embedding_rowwise": _embedding_rows,
}
