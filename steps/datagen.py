"""Datagen: the target regenerates the assistant turns, then each conversation is tokenized.

Reads the prompts of `cfg.dataset` (steps/lib/data/prompts.py) and a target artifact; writes a `dataset`
artifact of `conversations/part-{i:05d}.jsonl` chunks, each row `{"id", "source", "messages",
"input_ids", "loss_mask", "finished"}`. The draft must imitate what *this* target says in the mode
it is served in (greedy by default), not what some other model once answered: training on foreign
answers is the cheapest way to a low acceptance rate that no check notices (F9).

Generation runs in-process (`local`: the batched decode loop of `steps/lib/model/decode.py`, finished rows leaving
the batch, as many torch threads as the machine's load leaves free, in float32; on a GPU the decode engine of
`steps/lib/model/decode_engine.py` in bf16, the served dtype, which is then part of the dataset's id) or
against any OpenAI-compatible server (`openai`: /v1/chat/completions, `concurrency` threads, each
request retried with doubling waits). No prompt is dropped silently: one that still fails makes the
step fail naming how many and why, and the answers so far stay staged, so the next run asks only for
the missing ones. Each chunk is uploaded as soon as it is written, so a crashed run
resumes from its committed chunks; the manifest is written last and only if something succeeded.

A `synthetic` source's prompts are written by the target itself first (steps/lib/data/synthetic.py: its
chat template up to a user turn, sampled; filtered, deduplicated, decontaminated), each round of candidates
kept under `synthetic/` in the artifact so a killed run replays them. With `datagen.turns: 2` the target
then writes a second user turn after its own first answer and answers it, turn by turn. Every count of
what was dropped goes into the manifest's metrics (docs/DATASETS.md).

The chat template is applied in one place, steps/lib/data/chat.py, exactly as serving applies it: the
prompts as the server renders them, and the loss mask (`tokenize_conversation`) 1 exactly on every
assistant turn's tokens including its end-of-turn token, 0 on system/user/template tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from steps.lib.artifacts import conversations_path, inference_device, load_target, load_tokenizer, target_config
from steps.lib.config import DatagenConfig, PipelineConfig, SyntheticConfig
from steps.lib.data.chat import chat_token_ids, tokenize_conversation
from steps.lib.data.prompts import benchmark_index, source_files_sha256, training_prompts
from steps.lib.data.size import answers_needed, size_warning
from steps.lib.data.synthetic import Generate, Stage, write_prompts, write_user_turns
from steps.lib.http import get_json, post_json
from steps.lib.model.decode import cpu_threads, decode, sampling_generator, torch_threads
from steps.lib.model.decode_engine import ENGINE_MODEL_TYPES, decode_engine
from steps.lib.runtime import progress
from steps.lib.store import Manifest, Store, artifact_id, canonical_json
from steps.registry import step_main

log = logging.getLogger("eaglenest.datagen")

#: prompts per committed chunk: the unit of resume (a crash loses at most one chunk of work).
CHUNK_PROMPTS = 64
#: seconds one OpenAI-compatible request may take before it is counted as an error.
REQUEST_TIMEOUT_S = 600.0
#: the longest wait between two tries of one request.
MAX_BACKOFF_S = 30.0
#: HTTP statuses worth another try (overload, timeouts); any other 4xx is the request's fault.
RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class MissingAnswers(ConnectionError):
    """Some prompts got no answer after every retry: the run fails (one line, exit 2) and keeps what it has."""
STAT_KEYS = ("ok", "errors", "skipped", "empty", "truncated", "tokens", "assistant_tokens",
             "generated_tokens", "gen_s")
#: a dataset's candidate first turns written by the target (`synthetic` sources), one file a round.
SYNTHETIC_DIR = "synthetic"


# --- identity ------------------------------------------------------------------------------------------

#: datagen fields that change speed, not content (for greedy decoding).
PERFORMANCE_KNOBS = ("batch_size", "concurrency", "server_url", "retries", "retry_backoff_s")


def dataset_identity(cfg: PipelineConfig, prompts: list[dict[str, Any]], chunk_prompts: int, *,
                     dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What determines the dataset besides the target: configs, seed, chunking, the prompts' content and the
    dtype the target decodes them in (`answer_dtype`; None for a server)."""
    digest = hashlib.sha256(canonical_json(prompts).encode()).hexdigest()
    # Where a server lives is not what the dataset is (and a URL may carry credentials): never in the id.
    datagen = cfg.datagen.model_dump(mode="json", exclude={"server_url"})
    if datagen.get("decoder") == "auto":
        datagen.pop("decoder")     # the default: ids of datasets made before the field existed stay
    if cfg.datagen.temperature == 0 and cfg.datagen.samples_per_prompt == 1:
        # Greedy answers do not depend on how requests are batched or where they are served from
        # (the target artifact is an input of the id), so these knobs do not change the dataset.
        for knob in PERFORMANCE_KNOBS:
            datagen.pop(knob, None)
    identity = {"dataset": _without_neutral_defaults(cfg, datagen), "datagen": datagen,
                "seed": cfg.seed, "chunk_prompts": chunk_prompts, "prompts_sha256": digest}
    if dtype is not None and dtype != torch.float32:
        # bf16 answers (the engine on a GPU) are other texts than float32 ones (~2 % of argmaxes differ on
        # SmolLM2-135M, benchmarks/dtype_flips.py): a store shared by CPU and GPU workers must not reuse one as
        # the other. float32 stays out, so ids of datasets made on CPUs (and before this field) stay.
        identity["answer_dtype"] = str(dtype).removeprefix("torch.")
    files = source_files_sha256(cfg.dataset)    # local `file` sources: their bytes, not only their parse
    return {**identity, "files_sha256": files} if files else identity


def _without_neutral_defaults(cfg: PipelineConfig, datagen: dict[str, Any]) -> dict[str, Any]:
    """The dataset section for the id, less the fields added since ids existed where they are at their
    defaults (ids of datasets made before them stay); drops `datagen.turns: 1` from `datagen` too."""
    dataset = cfg.dataset.model_dump(mode="json")
    for src in dataset["sources"]:
        if src["count"] is None:
            del src["count"]
    if not dataset["decontaminate"]:
        del dataset["decontaminate"]
    if datagen.get("turns") == 1:
        del datagen["turns"]
    if cfg.datagen.turns == 1 and not any(s.kind == "synthetic" for s in cfg.dataset.sources):
        del dataset["synthetic"]        # nothing is written by the target: its settings change nothing
    return dataset


# --- generation backends ------------------------------------------------------------------------------
# Each backend maps a list of prompts (with their rendered token ids) to one result per prompt:
# {"text": str | None, "tokens": int, "finished": bool, "error": str | None}.

def stop_token_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """eos plus the ChatML end-of-turn token when the vocabulary has one."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    eos_cfg = getattr(model_config, "eos_token_id", None)
    ids |= set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg])
    return sorted(i for i in ids if i is not None)


def resolve_decoder(choice: str, device: str, model_type: str | None) -> str:
    """`datagen.decoder` on `device` for a target of `model_type`: `auto` is the engine on a GPU for a model
    type it supports, else the loop."""
    if choice != "auto":
        return choice
    return "engine" if device.startswith("cuda") and model_type in ENGINE_MODEL_TYPES else "loop"


def engine_dtype(device: str) -> torch.dtype:
    """The engine's dtype: bfloat16 on a GPU (what production serves), float32 on the CPU (deterministic)."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def answer_dtype(decoder: str, device: str) -> torch.dtype:
    """The dtype the target writes prompts and answers in: the engine's, else the loop's float32."""
    return engine_dtype(device) if decoder == "engine" else torch.float32


def generate_local(model: Any, tokenizer: Any, batch: list[list[int]], dg: DatagenConfig,
                   seed: int, temperature: float | None = None) -> list[dict[str, Any]]:
    """Greedy (or seeded sampled) batched decoding: `steps.lib.model.decode.decode`, finished rows leave the batch."""
    stops = stop_token_ids(tokenizer, model.config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    temperature = dg.temperature if temperature is None else temperature
    generator = sampling_generator(model, seed) if temperature > 0 else None
    if resolve_decoder(dg.decoder, next(model.parameters()).device.type, model.config.model_type) == "engine":
        answers = decode_engine(model, batch, dg.max_new_tokens, stops, pad, temperature=temperature,
                                generator=generator, slots=dg.batch_size)
    else:
        answers = decode(model, batch, dg.max_new_tokens, stops, pad, temperature=temperature,
                         generator=generator)
    return [{"text": tokenizer.decode(a.tokens, skip_special_tokens=True), "finished": a.finished,
             "tokens": len(a.tokens) + a.finished, "error": None} for a in answers]


def user_turn_writer(model: Any, tokenizer: Any, dg: DatagenConfig) -> Generate:
    """steps/lib/data/synthetic.py's `generate`: the target continues each text, batched like its answers."""
    def generate(prefixes: list[str], temperature: float, max_tokens: int, seed: int) -> list[tuple[str, bool]]:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes]
        short = dg.model_copy(update={"max_new_tokens": max_tokens})
        out: list[tuple[str, bool]] = []
        with torch_threads(cpu_threads()):
            for b in range(0, len(ids), dg.batch_size):
                out += [(r["text"], r["finished"]) for r in
                        generate_local(model, tokenizer, ids[b:b + dg.batch_size], short, seed + b, temperature)]
        return out
    return generate


def chat_completions_url(server_url: str) -> str:
    base = server_url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


def served_model_name(server_url: str, fallback: str) -> str:
    """The first model the server lists (vLLM rejects requests naming any other)."""
    try:
        return get_json(chat_completions_url(server_url).replace("/chat/completions", "/models"),
                        timeout_s=30)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return fallback


def _openai_one(url: str, model: str, prompt: dict[str, Any], dg: DatagenConfig, seed: int) -> dict[str, Any]:
    """One chat completion, tried up to 1 + dg.retries times with doubling waits; an error result after that."""
    temperature = answer_temperature(prompt, dg)
    payload = {"model": model, "messages": prompt["messages"], "temperature": temperature,
               "max_tokens": dg.max_new_tokens}
    if temperature > 0:
        payload["seed"] = seed
    for attempt in range(dg.retries + 1):
        try:
            resp = post_json(url, payload, timeout_s=REQUEST_TIMEOUT_S)
            choice = resp["choices"][0]
            return {"text": choice["message"]["content"] or "", "finished": choice.get("finish_reason") == "stop",
                    "tokens": int((resp.get("usage") or {}).get("completion_tokens") or 0), "error": None}
        except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
            http = isinstance(err, urllib.error.HTTPError)
            detail = err.read().decode(errors="replace")[:200] if http else ""
            error = f"{type(err).__name__}: {err} {detail}".strip()
            if (http and err.code not in RETRY_STATUS) or attempt == dg.retries:
                return {"text": None, "finished": False, "tokens": 0, "error": error,
                        "attempts": attempt + 1}
            time.sleep(min(MAX_BACKOFF_S, dg.retry_backoff_s * 2 ** attempt))
    raise AssertionError("unreachable: the last try returns")


def generate_openai(prompts: list[dict[str, Any]], dg: DatagenConfig, model: str, seed: int) -> list[dict[str, Any]]:
    """One chat completion per prompt over `concurrency` threads; failures become per-prompt errors."""
    url = chat_completions_url(str(dg.server_url))
    with ThreadPoolExecutor(max_workers=dg.concurrency) as pool:
        return list(pool.map(lambda ip: _openai_one(url, model, ip[1], dg, seed + ip[0]), enumerate(prompts)))


# --- one chunk ----------------------------------------------------------------------------------------

def _log_too_long(prompts: list[dict[str, Any]], prompt_ids: list[list[int]], max_tokens: int) -> None:
    """Name the prompts dropped for length (counted in `skipped` too): none is dropped silently."""
    long = [f"{p['id']} ({len(ids)} tokens)" for p, ids in zip(prompts, prompt_ids, strict=True)
            if len(ids) > max_tokens]
    if long:
        more = f" and {len(long) - 5} more" if len(long) > 5 else ""
        log.warning("datagen: skipped %d prompts longer than datagen.max_prompt_tokens=%d: %s%s",
                    len(long), max_tokens, ", ".join(long[:5]), more)


def answer_chunk(prompts: list[dict[str, Any]], tokenizer: Any, dg: DatagenConfig, *, model: Any = None,
                 served_name: str = "", seed: int = 0, known: dict[str, dict[str, Any]] | None = None,
                 syn: SyntheticConfig | None = None) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Results for the chunk's prompts that fit (by index); `known` answers (by prompt id) are not asked again.
    With `dg.turns == 2` each answered conversation gets a second user turn written by the target (`syn`)
    and its answer (`followup` in the result)."""
    stats: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
    prompt_ids = [chat_token_ids(tokenizer, p["messages"]) for p in prompts]
    todo = [i for i, ids in enumerate(prompt_ids) if len(ids) <= dg.max_prompt_tokens]
    stats["skipped"] = len(prompts) - len(todo)
    _log_too_long(prompts, prompt_ids, dg.max_prompt_tokens)
    results = {i: known[prompts[i]["id"]] for i in todo if prompts[i]["id"] in (known or {})}
    todo = [i for i in todo if i not in results]
    t0 = time.perf_counter()
    if dg.backend == "local":
        results.update(_decode_local(model, tokenizer, prompt_ids, {i: answer_temperature(prompts[i], dg)
                                                                    for i in todo}, dg, seed))
        if dg.turns == 2:
            _second_turns(prompts, results, tokenizer, dg, syn or SyntheticConfig(), model=model, seed=seed,
                          stats=stats)
    elif todo:
        results.update(zip(todo, generate_openai([prompts[i] for i in todo], dg, served_name, seed), strict=True))
    stats["gen_s"] = time.perf_counter() - t0
    return results, stats


def _decode_local(model: Any, tokenizer: Any, prompt_ids: Any, temps: dict[int, float], dg: DatagenConfig,
                  seed: int) -> dict[int, dict[str, Any]]:
    """Answers of the prompts `temps` names (index → its temperature), batched by temperature and length."""
    todo = sorted(temps, key=lambda i: len(prompt_ids[i]))  # similar lengths share a batch: less padding
    results: dict[int, dict[str, Any]] = {}
    # threads are picked per chunk: the load of a shared machine changes during a long run
    with torch_threads(cpu_threads()):
        # one batch decodes at one temperature: the extra samples (`samples_per_prompt`) are batched apart
        for g, temp in enumerate(sorted(set(temps.values()))):
            group = [i for i in todo if temps[i] == temp]
            for b in range(0, len(group), dg.batch_size):
                idx = group[b:b + dg.batch_size]
                answers = generate_local(model, tokenizer, [prompt_ids[i] for i in idx], dg,
                                         seed + 100_003 * g + b, temperature=temp)
                results.update(zip(idx, answers, strict=True))
    return results


#: the counts of second turns (`datagen.turns: 2`) in a chunk's stats and the manifest's metrics.
TURN2_KEYS = ("two_turn", "turn2_written", "turn2_empty", "turn2_too_long", "turn2_not_request",
              "turn2_contaminated", "turn2_prompt_too_long", "turn2_empty_answer")


def _second_turns(prompts: list[dict[str, Any]], results: dict[int, dict[str, Any]], tokenizer: Any,
                  dg: DatagenConfig, syn: SyntheticConfig, *, model: Any, seed: int, stats: dict[str, Any]) -> None:
    """Turn by turn: the target writes the next user turn after its own first answer, then answers it, the
    history rendered as a server renders it; a conversation whose turn is dropped stays one turn (counted)."""
    stats.update(dict.fromkeys(TURN2_KEYS, 0))
    first = [i for i in sorted(results) if results[i]["error"] is None and results[i]["text"].strip()]
    history = {i: prompts[i]["messages"] + [{"role": "assistant", "content": results[i]["text"].strip()}]
               for i in first}
    users, counts = write_user_turns([history[i] for i in first], tokenizer, user_turn_writer(model, tokenizer, dg),
                                     syn, benchmark_index(), seed=seed + 7_000_003)
    stats.update({f"turn2_{k}": v for k, v in counts.items()})
    convs = {i: history[i] + [{"role": "user", "content": u}] for i, u in zip(first, users, strict=True) if u}
    ids = {i: chat_token_ids(tokenizer, c) for i, c in convs.items()}
    fits = {i: answer_temperature(prompts[i], dg) for i in convs if len(ids[i]) <= dg.max_prompt_tokens}
    stats["turn2_prompt_too_long"] = len(convs) - len(fits)
    for i, a in _decode_local(model, tokenizer, ids, fits, dg, seed + 13_000_027).items():
        if not a["text"].strip():
            stats["turn2_empty_answer"] += 1
            continue
        results[i] = {**results[i], "finished": a["finished"], "tokens": results[i]["tokens"] + a["tokens"],
                      "followup": [convs[i][-1], {"role": "assistant", "content": a["text"].strip()}]}


def conversation_rows(prompts: list[dict[str, Any]], results: dict[int, dict[str, Any]], tokenizer: Any,
                      stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The tokenized conversations of the answered prompts, in prompt order; counts into `stats`."""
    rows = []
    for i in sorted(results):
        row = _conversation_row(prompts[i], results[i], tokenizer, stats)
        if row is not None:
            rows.append(row)
    return rows


def generate_chunk(prompts: list[dict[str, Any]], tokenizer: Any, dg: DatagenConfig, *, model: Any = None,
                   served_name: str = "", seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Answer one chunk of prompts and tokenize the conversations; returns (rows, stats)."""
    results, stats = answer_chunk(prompts, tokenizer, dg, model=model, served_name=served_name, seed=seed)
    return conversation_rows(prompts, results, tokenizer, stats), stats


def _conversation_row(prompt: dict[str, Any], result: dict[str, Any], tokenizer: Any,
                      stats: dict[str, Any]) -> dict[str, Any] | None:
    if result["error"] is not None:
        stats["errors"] += 1
        stats.setdefault("first_error", result["error"])
        return None
    text = result["text"].strip()
    if not text:
        stats["empty"] += 1
        return None
    messages = prompt["messages"] + [{"role": "assistant", "content": text}] + result.get("followup", [])
    input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
    stats["ok"] += 1
    if "followup" in result:
        stats["two_turn"] += 1
    stats["truncated"] += not result["finished"]
    stats["tokens"] += len(input_ids)
    stats["assistant_tokens"] += sum(loss_mask)
    stats["generated_tokens"] += result["tokens"]
    return {"id": prompt["id"], "source": prompt["source"], "messages": messages, "input_ids": input_ids,
            "loss_mask": loss_mask, "finished": result["finished"]}


# --- step ---------------------------------------------------------------------------------------------

def _totals(chunk_stats: list[dict[str, Any]], n_prompts: int) -> dict[str, Any]:
    keys = STAT_KEYS + (TURN2_KEYS if any("two_turn" in s for s in chunk_stats) else ())
    total = {k: sum(s.get(k, 0) for s in chunk_stats) for k in keys}
    total["gen_s"] = round(total["gen_s"], 2)
    total["tokens_per_s"] = round(total["generated_tokens"] / total["gen_s"], 1) if total["gen_s"] else 0.0
    return {**total, "prompts": n_prompts}


def _chunk(writer: Any, rel: str, chunk: list[dict[str, Any]], tokenizer: Any, cfg: PipelineConfig, *,
           model: Any, served: str, seed: int) -> dict[str, Any]:
    """Answer one chunk (only its missing prompts when an earlier run answered the rest) and upload it.

    A chunk with failed requests is uploaded too, with the answers it has in its upload record and the
    failures under `missing`, so the next run asks only for those; the run then fails (`run`)."""
    done = writer.uploaded(rel)
    if done is not None and not done.get("missing"):    # committed complete by an earlier, interrupted run
        return done["stats"]
    known = (done or {}).get("answers", {})
    results, stats = answer_chunk(chunk, tokenizer, cfg.datagen, model=model, served_name=served, seed=seed,
                                  known=known, syn=cfg.dataset.synthetic)
    stats["gen_s"] += (done or {}).get("stats", {}).get("gen_s", 0.0)
    rows = conversation_rows(chunk, results, tokenizer, stats)
    missing = {chunk[i]["id"]: r["error"] for i, r in results.items() if r["error"] is not None}
    if rows or missing:   # a chunk with nothing usable and nothing to retry (all empty or too long) is skipped
        writer.path(rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
        extra: dict[str, Any] = {"stats": stats, "first_id": chunk[0]["id"]}
        if missing:
            extra |= {"missing": missing, "answers": {chunk[i]["id"]: r for i, r in results.items()
                                                       if r["error"] is None}}
        writer.upload(rel, extra=extra)
    return {**stats, "missing": missing} if missing else stats


def with_samples(prompts: list[dict[str, Any]], dg: DatagenConfig) -> list[dict[str, Any]]:
    """Each prompt, then its `samples_per_prompt - 1` extra samples (id `<id>~<k>`, at `sample_temperature`)."""
    extra = [{**p, "id": f"{p['id']}~{k}", "temperature": dg.sample_temperature}
             for k in range(1, dg.samples_per_prompt) for p in prompts]
    return prompts + extra


def decoding(cfg: PipelineConfig, store: Store, target_id: str, device: str) -> tuple[str | None, torch.dtype | None]:
    """How the target will write this dataset on `device`: (decoder, dtype), or (None, None) for a server.
    Known before anything is decoded, so the dtype can be part of the id that decides reuse."""
    if cfg.datagen.backend != "local":
        return None, None
    # only a GPU's `auto` depends on the model type (the CPU's is the loop): no fetch of the target on a CPU
    model_type = target_config(store, target_id).get("model_type") if device.startswith("cuda") else None
    decoder = resolve_decoder(cfg.datagen.decoder, device, model_type)
    return decoder, answer_dtype(decoder, device)


def answer_temperature(prompt: dict[str, Any], dg: DatagenConfig) -> float:
    """The temperature a prompt is answered at: an extra sample's own (`with_samples`), else the config's."""
    return prompt.get("temperature", dg.temperature)


def run(cfg: PipelineConfig, store: Store, target_id: str, *, chunk_prompts: int | None = None) -> Manifest:
    """Regenerate the assistant turns of cfg.dataset's prompts with the target (resumable).

    Every prompt gets an answer or the step fails: requests are retried (`datagen.retries`), and the
    prompts that still failed are named in a MissingAnswers error; the next run asks only for them.
    """
    offline, dropped = training_prompts(cfg.dataset, cfg.seed, cfg.datagen.max_prompt_tokens)
    prompts = with_samples(offline, cfg.datagen)
    # a chunk holds at least one full batch (a GPU decodes hundreds of rows at once)
    chunk_prompts = chunk_prompts or max(CHUNK_PROMPTS, cfg.datagen.batch_size)
    local = cfg.datagen.backend == "local"
    device = inference_device()
    decoder, dtype = decoding(cfg, store, target_id, device)
    # synthetic prompts are a function of the config, the seed and the target (an input of the id)
    identity = dataset_identity(cfg, prompts, chunk_prompts, dtype=dtype)
    did = artifact_id("dataset", identity, {"target": target_id})
    if store.exists("dataset", did):
        return store.manifest("dataset", did)
    model, tokenizer = (load_target(store, target_id, device=device) if local
                        else (None, load_tokenizer(store, target_id)))
    if local:
        model = model.to(dtype)
    served = "" if local else served_model_name(str(cfg.datagen.server_url), cfg.target.display_name)
    writer = store.begin("dataset", did, step="datagen", inputs={"target": target_id}, config=identity)
    synthetic, written = synthetic_prompts(cfg, writer, model, tokenizer, chunk_prompts)
    prompts = with_samples(offline + synthetic, cfg.datagen) if synthetic else prompts
    small = size_warning(len(prompts), cfg, what="datagen")    # said before the target answers them
    if small:
        log.warning("%s", small)
    chunk_stats: list[dict[str, Any]] = []
    with progress.bar(total=len(prompts), desc="datagen", unit="prompt") as bar:
        for i, start in enumerate(range(0, len(prompts), chunk_prompts)):
            chunk = prompts[start:start + chunk_prompts]
            chunk_stats.append(_chunk(writer, conversations_path(i), chunk, tokenizer, cfg, model=model,
                                      served=served, seed=cfg.seed * 1_000_003 + start))
            bar.update(len(chunk))
            bar.set_postfix(ok=sum(s["ok"] for s in chunk_stats), errors=sum(s["errors"] for s in chunk_stats))
    metrics = {**_totals(chunk_stats, len(prompts)), **{f"dropped_{k}": v for k, v in dropped.items()}, **written}
    missing = {pid: err for s in chunk_stats for pid, err in s.get("missing", {}).items()}
    if missing:
        pid, err = next(iter(missing.items()))
        raise MissingAnswers(f"datagen: {len(missing)} of {len(prompts)} prompts got no answer after "
                             f"{cfg.datagen.retries} retries each (first: prompt {pid!r}: {err}); the "
                             f"{metrics['ok']} answers so far are kept: re-run datagen to ask only for the "
                             "missing ones (check the server at datagen.server_url, or raise datagen.retries)")
    if metrics["ok"] == 0:
        raise RuntimeError(f"datagen: no prompt of {len(prompts)} got a usable answer ({metrics['skipped']} too "
                           f"long, {metrics['empty']} empty)")
    # the device a local backend decoded on: its generator draws the sampled answers (`sampling_generator`)
    # and the decoder and dtype it ran (bf16 answers differ from float32 ones: they are the served target's)
    ran = str(next(model.parameters()).dtype).removeprefix("torch.") if local else None
    return writer.commit(metrics={**metrics, "answers_needed": answers_needed(cfg)},
                         meta={"backend": cfg.datagen.backend, "device": device if local else None,
                               "decoder": decoder, "dtype": ran,
                               "chunks": len(chunk_stats),
                               "size_warning": size_warning(metrics["ok"], cfg, what="datagen")})


def synthetic_prompts(cfg: PipelineConfig, writer: Any, model: Any, tokenizer: Any, round_size: int,
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The first turns the target writes itself for a `synthetic` source (none without one), each round of
    candidates kept in the artifact under `synthetic/` so a resumed run replays them; (prompts, metrics:
    `synthetic_written`, `synthetic_kept`, `synthetic_<why dropped>`, `synthetic_s`, `synthetic_prompts_per_s`)."""
    count = sum(s.count or 0 for s in cfg.dataset.sources if s.kind == "synthetic")
    if not count:
        return [], {}
    t0 = time.perf_counter()
    with progress.bar(total=count * cfg.dataset.synthetic.max_attempts, desc="synthetic prompts",
                      unit="prompt") as bar:
        prompts, counts = write_prompts(count, tokenizer, user_turn_writer(model, tokenizer, cfg.datagen),
                                        cfg.dataset.synthetic, benchmark_index(), seed=cfg.seed,
                                        round_size=round_size, stage=_synthetic_stage(writer, bar.update))
    seconds = time.perf_counter() - t0
    if len(prompts) < count:
        log.warning("datagen: the target wrote %d of %d synthetic prompts in %d candidates (the rest were "
                    "dropped: %s); raise dataset.synthetic.max_attempts for more", len(prompts), count,
                    counts["written"], {k: v for k, v in counts.items() if k != "written" and v})
    return prompts, {**{f"synthetic_{k}": v for k, v in counts.items()}, "synthetic_kept": len(prompts),
                     "synthetic_s": round(seconds, 2),
                     "synthetic_prompts_per_s": round(len(prompts) / seconds, 3) if seconds else 0.0}


def _synthetic_stage(writer: Any, on_round: Any) -> Stage:
    """synthetic's `stage`: a round of candidates from its upload record, or written, uploaded and recorded."""
    def stage(r: int, make: Any) -> list[dict[str, Any]]:
        rel = f"{SYNTHETIC_DIR}/part-{r:05d}.jsonl"
        done = writer.uploaded(rel)
        if done is not None:        # written by an earlier, interrupted run: the same seed gave these
            rows = done["candidates"]
        else:
            rows = make()
            writer.path(rel).write_text("".join(json.dumps(c) + "\n" for c in rows))
            writer.upload(rel, extra={"candidates": rows})
        on_round(len(rows))
        return rows
    return stage


def main(argv: list[str] | None = None) -> int:
    return step_main("datagen", argv)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["run", "main", "tokenize_conversation", "answer_chunk", "generate_chunk", "generate_local", "with_samples",
           "MissingAnswers",
           "generate_openai", "stop_token_ids", "dataset_identity", "resolve_decoder", "engine_dtype",
           "answer_dtype"]
