"""The CPU serving stack the KDTREE tests stand on: each tiny target served by a plain SGLang server
(no speculative decoding) returns exactly Hugging Face's greedy continuation."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [0, 63, 0, 63, 12, 13, 14, 15, 16, 17, 18]]


def hf_greedy(model_dir, prompt, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt):].tolist()


def test_plain_server_matches_hf_greedy(plain_server, tiny_models):
    out = plain_server.generate(
        {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    )
    for prompt, result in zip(PROMPTS, out):
        assert result["output_ids"] == hf_greedy(tiny_models / plain_server.model_name, prompt, 12)
