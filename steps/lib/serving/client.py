"""The client of a served engine's SGLang-native API: /generate requests, many at once, each request's accept
counts, and the target's logit gap between two tokens, as SGLang 0.5.23 and the reference server answer them.

benchmark measures live τ with it and verify (`verify.engine: server`) offline τ, so both read a server's
counts the same way (F9).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from steps.lib.http import post_json
from steps.lib.metrics import AcceptStats


def generate(base_url: str, input_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
             ignore_eos: bool = False, logprob_token_ids: list[int] | None = None) -> dict[str, Any]:
    """One SGLang-native /generate request -> its response (text, output_ids, meta_info). `logprob_token_ids`
    asks for those tokens' logprobs at every output position (SGLang's `token_ids_logprob`)."""
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}}
    if logprob_token_ids is not None:
        body |= {"return_logprob": True, "token_ids_logprob": list(logprob_token_ids)}
    return post_json(f"{base_url}/generate", body)


def generate_all(base_url: str, prompts: list[list[int]], *, concurrency: int, **params: Any) -> list[dict[str, Any]]:
    """Every prompt through /generate, `concurrency` requests in flight at a time; responses in prompt order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda ids: generate(base_url, ids, **params), prompts))


def request_stats(meta: dict[str, Any], num_steps: int) -> AcceptStats:
    """One finished request's accept histogram (SGLang's `spec_correct_drafts_histogram`, padded to
    `num_steps` + 1); empty when the server verified nothing for it (SGLang then omits the spec fields)."""
    histogram = list(meta.get("spec_correct_drafts_histogram") or [])
    width = max(num_steps + 1, len(histogram))
    return AcceptStats(width - 1, [*histogram, *[0] * (width - len(histogram))])


def logit_gap(base_url: str, context: list[int], plain_token: int, spec_token: int) -> float:
    """The target's logit of `plain_token` minus `spec_token`'s after `context`, from one greedy token with
    both tokens' logprobs (the same softmax: their difference is the logits')."""
    meta = generate(base_url, context, max_new_tokens=1, ignore_eos=True,
                    logprob_token_ids=[plain_token, spec_token])["meta_info"]
    first = meta.get("output_token_ids_logprobs") or [None]
    if not first[0]:
        raise RuntimeError(f"{base_url}/generate: meta_info has no output_token_ids_logprobs for "
                           "token_ids_logprob; the server cannot report the logit gap of a near tie")
    logprob = {int(entry[1]): float(entry[0]) for entry in first[0]}
    return logprob[plain_token] - logprob[spec_token]
