"""The model behind docs/schedule.png: ``graphshard dump docs/schedule_model.py:build``."""

import torch

from graphshard.models.llama import Llama, llama_config


def build():
    torch.manual_seed(0)
    model = Llama(llama_config("llama-small"))
    tokens = torch.randint(0, 2048, (4, 128))
    return model, (tokens, tokens)
