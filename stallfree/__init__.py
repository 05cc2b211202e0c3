from .llm import LLM
from .sampling_params import SamplingParams
