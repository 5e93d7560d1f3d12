"""Shared fixtures: a tokenizer trained offline and tiny models of real architectures."""
import pytest
import torch

from minscope.envs.wordgame import WordGame
from minscope.models import build_tiny_model, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(WordGame().corpus() + ["hello there", "how are you"], vocab_size=300)


@pytest.fixture(params=["llama", "qwen3"])
def tiny_model(request, tokenizer):
    torch.manual_seed(0)
    return build_tiny_model(tokenizer, request.param, hidden_size=32, num_layers=2)
