"""Entry points: the Python API (`from launch import LLM, SamplingParams`), serve.py, demo."""
from attention_nodes.sampling_params import SamplingParams

from .llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
