"""Batched decoding with the target alone: the loop datagen answers prompts with.

A plain KV-cache loop instead of `model.generate`, for three reasons measured on a 2-core CPU
(benchmarks/datagen_speed.py): rows that have stopped leave the batch at once (generate keeps
computing them until the longest row ends), the padding columns no live row needs are cut from the
cache, and the prefill computes logits for the last position only. Greedy output is token for token
what greedy `generate` gives on the same batch (tests/unit/test_decode.py).

`steps/lib/model/reference_engine.py` decodes one request at a time with a draft; this is the batched, draft-free loop.
Both name the KV-cache argument through `cache_kwarg`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the KV-cache argument: transformers ≥5.2x says `cache`, older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cpu_threads(load: float | None = None, cores: int | None = None) -> int:
    """Torch threads for a CPU decode: every core when the machine is quiet, fewer when others load it.

    On a shared 2-core machine with a load of ~10, two OpenMP threads spin-wait for each other and
    decode ~6x slower than one thread (benchmarks/README.md); on a quiet one, two are ~1.6x faster.
    Only the load beyond the cores counts as others': the load average also holds this pipeline's own
    previous step (a quiet machine reads ~1 right after the target step), which took 1 of 2 threads.
    """
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    load = os.getloadavg()[0] if load is None else load
    others = max(0, round(load) - cores)
    return max(1, cores - others)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` torch threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Answer:
    """One row's new tokens (without the stop token) and whether a stop token ended it."""
    tokens: list[int]
    finished: bool


def _trim_left(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop leading columns that every remaining row masks out (padding of rows that left the batch)."""
    live = mask.any(dim=0).nonzero()
    start = int(live[0]) if len(live) else 0
    if start == 0:
        return mask
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, start:]
        layer.values = layer.values[:, :, start:]
    return mask[:, start:]


def sampling_generator(model: torch.nn.Module, seed: int) -> torch.Generator:
    """The seeded generator `decode` samples with, on the model's device. Samples are reproducible on one
    kind of device; a GPU's generator draws other numbers than the CPU's, so datagen records the device."""
    return torch.Generator(device=next(model.parameters()).device).manual_seed(seed)


@torch.no_grad()
def decode(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stops: Iterable[int],
           pad: int, *, temperature: float = 0.0, generator: torch.Generator | None = None) -> list[Answer]:
    """Answer each prompt (token ids): greedy at temperature 0, else sampled from softmax(logits / T)
    with `generator`, which must live on the model's device (`sampling_generator`).

    The batch is left padded; each finished row is removed from the batch and its KV cache.
    """
    stop_set = set(stops)
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, kw = DynamicCache(), cache_kwarg(model)
    answers = [Answer([], False) for _ in prompts]
    alive = list(range(len(prompts)))            # batch row -> prompt index
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                   **{kw: cache}).logits[:, -1]
    next_pos = pos[:, -1:] + 1
    for step in range(max_new_tokens):
        if temperature > 0:
            # sampled where the logits are: copying a batch's probabilities to the host every step (rows x
            # vocab floats, 50 MB at batch 256) and drawing there kept an H200 waiting on the host's cores
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            tok = logits.argmax(dim=-1)
        keep = []
        for row, t in enumerate(tok.tolist()):
            a = answers[alive[row]]
            if t in stop_set:
                a.finished = True
            else:
                a.tokens.append(t)
                keep.append(row)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            mask, tok, next_pos = mask[rows], tok[rows], next_pos[rows]
            alive = [alive[r] for r in keep]
            mask = _trim_left(cache, mask)
        mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                       **{kw: cache}).logits[:, -1]
        next_pos = next_pos + 1
    return answers


@torch.no_grad()
def generate_reference(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stops: list[int],
                       pad: int) -> list[Answer]:
    """Greedy `model.generate` on the same left-padded batch, cut at the first stop token: what `decode`
    must equal token for token (tests/unit/test_decode.py) and what datagen ran before it (the benchmark)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         top_p=None, top_k=None, eos_token_id=stops, pad_token_id=pad)
    answers = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), None)
        answers.append(Answer(row[:end], True) if end is not None else Answer(row, False))
    return answers


__all__ = ["Answer", "cache_kwarg", "cpu_threads", "decode", "generate_reference", "sampling_generator",
           "torch_threads"]
