"""Entry points: the Python API (`from launch import LLM, SamplingParams`), serve.py, demo."""
from attention_nodes.sampling_params import SamplingParams

from .beam_search import BeamSearchOutput, BeamSearchParams
from .llm import LLM, RequestOutput

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "RequestOutput", "SamplingParams"]
