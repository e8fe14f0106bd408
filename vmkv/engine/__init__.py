"""The serving engine: scheduler, model runner, sampler, and the LLM front doors."""

from vmkv.engine.async_engine import AsyncLLM, EngineDead
from vmkv.engine.async_process import AsyncProcessLLM, EngineStartError
from vmkv.engine.config import EngineConfig
from vmkv.engine.data_parallel import DataParallelLLM
from vmkv.engine.errors import RequestRejected
from vmkv.engine.llm import LLM
from vmkv.engine.llm_engine import EngineStats, LLMEngine
from vmkv.engine.logits_processors import LogitsProcessor
from vmkv.engine.lora import LoRARequest
from vmkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.sequence import FinishReason, RequestStatus

__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncProcessLLM",
    "CompletionOutput",
    "DataParallelLLM",
    "EngineConfig",
    "EngineDead",
    "EngineStartError",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "LogitsProcessor",
    "LoRARequest",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
]
