"""Per-request generation: options, batched logits processors, sampling, logprobs, stopping, stop
strings and incremental detokenization. See docs/GENERATION.md."""

from engine.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig, GenerationConfigError
from engine.generation.detokenizer import IncrementalDetokenizer, TokenDecoder
from engine.generation.request_state import RequestGenerationState, TokenResult
from engine.generation.rng import RequestRNG
from engine.generation.rows import SampledToken, SamplingRow
from engine.generation.sampler import Sampler
from engine.generation.stop_strings import StopStringMatcher
from engine.generation.stopping import StoppingCriteria

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "GenerationConfig",
    "GenerationConfigError",
    "IncrementalDetokenizer",
    "RequestGenerationState",
    "RequestRNG",
    "SampledToken",
    "Sampler",
    "SamplingRow",
    "StopStringMatcher",
    "StoppingCriteria",
    "TokenDecoder",
    "TokenResult",
]
