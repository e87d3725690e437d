"""Engine-side helpers shared by the end-to-end modules (each module owns one engine at a time)."""

from __future__ import annotations

import torch

LOGPROB_ATOL = 1e-4  # fp32 on both sides; only reduction order may differ
NEW_TOKENS = 40


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) from the engine, ``[len(ids) - 1]``."""
    out = engine.generate(
        input_ids=[ids],
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return torch.tensor([lp for lp, _, _ in out[0]["meta_info"]["input_token_logprobs"][1:]])


def engine_greedy(engine, prompts: list[list[int]], new: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations of a batch, EOS ignored so every prompt yields ``new`` tokens."""
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    )
    return [o["output_ids"] for o in outs]
