"""What a gateway asks of a worker, answered as SGLang answers it, so that cbserve runs behind SGLang's model
gateway (``sglang-router``) as an SGLang worker would:

- ``GET /server_info``, ``GET /model_info`` (and their older names ``/get_server_info``, ``/get_model_info``):
  read once when the gateway adds the worker; ``served_model_name`` becomes the worker's model id.
- ``GET /get_load``: one entry per data-parallel rank (cbserve has one); the gateway's load monitor sums
  ``num_tokens`` (tokens held in the KV cache) for the ``power_of_two`` policy.
- ``POST /flush_cache``: empty the prefix cache (the gateway's own ``/flush_cache`` fans out here); refused
  with 409 while requests hold blocks, as SGLang refuses it while requests run.

``/health`` and ``/metrics`` are server/serving_info.py's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.model_config import ModelConfig
from server.errors import APIError
from server.lifecycle import ServerState
from server.schemas import ERROR_RESPONSES
from server.serving_common import server_state
from server.serving_info import server_version

router = APIRouter()


def _server_info(state: ServerState) -> dict[str, Any]:
    # NOTE: no ``model_path``: the gateway would load a tokenizer from it, from the Hugging Face Hub when it
    # names no local folder. It routes on the text it is sent and needs only the model id.
    engine = state.engine
    return {
        "served_model_name": state.config.served_model_name,
        "version": server_version(),
        "dp_size": 1,
        "tp_size": 1,
        "page_size": engine.block_size,
        "max_total_num_tokens": engine.num_blocks * engine.block_size,
        "context_length": engine.max_model_len,
        "max_running_requests": engine.options.max_num_seqs,
        "max_prefill_tokens": engine.options.max_batch_tokens,
        "enable_prefix_caching": engine.options.enable_prefix_caching,
    }


def _model_info(state: ServerState) -> dict[str, Any]:
    config = state.engine.model_config
    if isinstance(config, ModelConfig):  # the native path: transformers' names from config.json
        hf = config.to_hf_dict()
        model_type, architectures = hf["model_type"], hf["architectures"]
    else:  # the transformers backend knows the class it runs
        model_type, architectures = None, [config.architecture]
    # NOTE: no ``model_path`` or ``tokenizer_path`` here either (see ``_server_info``).
    return {
        "is_generation": True,
        "model_type": model_type,
        "architectures": architectures,
    }


@router.get("/server_info")
@router.get("/get_server_info", include_in_schema=False)
async def server_info(request: Request) -> dict[str, Any]:
    return _server_info(server_state(request))


@router.get("/model_info")
@router.get("/get_model_info", include_in_schema=False)
async def model_info(request: Request) -> dict[str, Any]:
    return _model_info(server_state(request))


@router.get("/get_load", responses=ERROR_RESPONSES)
async def get_load(request: Request) -> list[dict[str, int]]:
    state = server_state(request)
    manager = state.running_manager()
    stats = manager.stats()
    num_tokens = round(stats.kv_cache_usage * stats.num_blocks) * stats.block_size
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.num_requests_running + stats.num_requests_waiting,
            "num_waiting_reqs": stats.num_requests_waiting,
            "num_tokens": num_tokens,
        }
    ]


@router.post("/flush_cache", responses=ERROR_RESPONSES)
async def flush_cache(request: Request) -> JSONResponse:
    manager = server_state(request).running_manager()
    if not await manager.reset_prefix_cache():
        raise APIError(
            409,
            "the prefix cache is in use by running requests; flush it when they are done",
            code="cache_in_use",
        )
    return JSONResponse({"status": "ok", "message": "Cache flushed."})
