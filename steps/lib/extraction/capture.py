"""Capturing the target's aux and final hidden states: the backends `steps/extract.py` runs.

`LocalBackend` runs the target in-process with hooks on exactly the layers needed; `SGLangBackend`
asks SGLang servers of the target (how a TP=8 target is extracted). Both offer `capture(batch)`
(the states, per sequence, on the CPU) and `capture_async(batch, storage_dtype)`, which returns at
once with a `Pending` batch: the states encoded for storage (`steps/lib/data/shards.py`), on their way to
the host. On a GPU the encoding runs on the device and the device→host copies run on a side CUDA
stream into pinned host buffers, double-buffered, while the next batch's forward runs: the
extraction then costs the GPU no more than the bare forward (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from steps.lib import layer_ids as layers
from steps.lib.artifacts import inference_device, load_target
from steps.lib.config import PipelineConfig
from steps.lib.data.shards import encode_states
from steps.lib.http import get_json, post_json
from steps.lib.runtime import distributed
from steps.lib.store import Store

log = logging.getLogger("eaglenest.extract")

#: an extraction planned or measured longer than this is refused, naming the faster backend.
ABSURD_EXTRACT_HOURS = 24 * 7

#: pinned host buffer sets per GPU backend: one being filled by the copies, one being read by the
#: shard writer. A third would only let the forward run further ahead of a writer that is slower.
HOST_SLOTS = 2


class Pending:
    """One captured batch: `host` holds flat rows `[N, W]` per stored tensor (`aux_hidden`, `final_hidden`,
    fp8: `aux_scale`, `final_scale`), sequence k at rows `spans[k]` = (start, length); from a backend made
    with `keep_on_device` (online training's) the rows are still on the device.
    `wait()` blocks until the rows have landed; `release()` hands the host buffers back to the backend
    (call it once the rows are copied out; the next batches reuse the memory)."""

    def __init__(self, host: dict[str, torch.Tensor], spans: list[tuple[int, int]],
                 done: torch.cuda.Event | None = None, on_release: Callable[[], None] | None = None):
        self.host, self.spans, self._done, self._on_release = host, spans, done, on_release

    def wait(self) -> dict[str, torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
        return self.host

    def release(self) -> None:
        if self._on_release is not None:
            self._on_release()
            self._on_release = None


def done(states: dict[str, torch.Tensor], lengths: list[int]) -> Pending:
    """A Pending of rows already on the host, sequences concatenated."""
    spans, at = [], 0
    for n in lengths:
        spans.append((at, n))
        at += n
    return Pending(states, spans)


class CaptureBackend(Protocol):
    """Runs the target over whole sequences. `capture` returns, per sequence, (aux [L, A*H], final [L, H])
    on the CPU, in the target's float dtype (bf16 from a GPU replica, fp32 on a CPU or from SGLang);
    `capture_async` the same states encoded in `storage_dtype`, as a `Pending` batch."""

    def capture(self, batch_input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def capture_async(self, batch_input_ids: list[list[int]], storage_dtype: str) -> Pending: ...


class HostSlot:
    """Contiguous pinned host buffers, one per stored tensor, grown to the largest batch seen.

    Each tensor gets its own contiguous destination: a copy into a strided slice of one shared
    buffer is not asynchronous (measured 0.57x of the bare forward, against 0.99x for this)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != like.dtype or buf.numel() < like.numel():
            buf = self.buffers[name] = torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)
        return buf[: like.numel()].view(like.shape)


class HostCopies:
    """Encoded states on their way to the host: on a GPU, copied on a side CUDA stream into one of
    `HOST_SLOTS` pinned buffer sets (the next forward runs meanwhile); on a CPU, handed over as they are.
    Shared by every in-process backend, so that each feeds the shard writer the same way."""

    def __init__(self, device: torch.device):
        self._slots: queue.Queue[HostSlot] = queue.Queue()
        self._copy_stream = None
        if device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device)
            for _ in range(HOST_SLOTS):
                self._slots.put(HostSlot())
        self.device = device

    def send(self, states: dict[str, torch.Tensor], spans: list[tuple[int, int]]) -> Pending:
        """`states`: flat rows `[N, W]` per stored tensor, on the device -> a Pending of them on the host."""
        if self._copy_stream is None:
            return Pending({k: v.cpu() for k, v in states.items()}, spans)
        slot = self._slots.get()            # blocks while the writer still reads both buffer sets
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the states are computed
        host = {}
        with torch.cuda.stream(self._copy_stream):
            for k, v in states.items():
                host[k] = slot.view(k, v).copy_(v, non_blocking=True)
                v.record_stream(self._copy_stream)   # the allocator keeps v until the copy is done
            landed = torch.cuda.Event()
            landed.record(self._copy_stream)
        return Pending(host, spans, landed, on_release=lambda: self._slots.put(slot))


class LocalBackend:
    """In-process forward with hooks on exactly the layers needed (no `output_hidden_states`).

    A forward PRE-hook on decoder layer i sees its input, which is HF `hidden_states[i]` (the
    internal id i); a hook on the final norm sees HF `hidden_states[-1]`. Materialising all N+1
    hidden states would cost N/A times the memory for nothing. Only the base model runs, so the
    [B, S, vocab] logits are never computed either.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], *, pad_token_id: int = 0,
                 keep_on_device: bool = False):
        self.model, self.layer_ids, self.pad = model.eval(), list(layer_ids), pad_token_id
        # online training reads the states where they were computed: no copy to the host and back
        self.keep_on_device = keep_on_device
        self.base = model.base_model
        self.device = next(model.parameters()).device
        self._seen: dict[Any, torch.Tensor] = {}
        decoder_layers, norm = getattr(self.base, "layers", None), getattr(self.base, "norm", None)
        if decoder_layers is None or norm is None:
            raise ValueError(f"{type(model).__name__}: no base_model.layers / base_model.norm; the local "
                             "backend knows Llama-style models (Llama, Qwen, Mistral); use extract.backend=sglang")
        self._hooks = [decoder_layers[i].register_forward_pre_hook(self._keep_input(i), with_kwargs=True)
                       for i in self.layer_ids]
        self._hooks.append(norm.register_forward_hook(self._keep_output))
        self._to_host = HostCopies(self.device)

    def close(self) -> None:
        """Remove the hooks (the model is left as it was found)."""
        for h in self._hooks:
            h.remove()

    def _keep_input(self, i: int):
        def hook(module, args, kwargs):
            # The residual stream is never modified in place by HF decoder layers: no copy needed.
            self._seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _keep_output(self, module, args, output) -> None:
        self._seen["final"] = output

    def _forward(self, batch_input_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """-> (aux [B, S, A*H], final [B, S, H]) on the model's device, and the sequence lengths."""
        lengths = [len(s) for s in batch_input_ids]
        width = max(lengths)
        # Right padding: real tokens keep positions 0..L-1 and, being causal, never see the pads.
        ids = torch.full((len(lengths), width), self.pad, dtype=torch.long)
        for b, seq in enumerate(batch_input_ids):
            ids[b, :len(seq)] = torch.tensor(seq)
        mask = None
        if min(lengths) < width:   # no padding, no mask: the forward keeps its fastest (causal) attention
            mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long().to(self.device)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        self._seen.clear()
        self.base(input_ids=ids.to(self.device), attention_mask=mask, use_cache=False)
        aux = torch.cat([self._seen[i] for i in self.layer_ids], dim=-1)   # [B, S, A*H]
        final = self._seen["final"]                                        # [B, S, H]
        self._seen.clear()
        return aux, final, lengths

    @torch.inference_mode()
    def capture(self, batch_input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        aux, final, lengths = self._forward(batch_input_ids)
        # One device→host copy per batch, in the target's dtype: on a GPU the states are bf16 already,
        # so fp32 would double the bytes for nothing (shards store bf16 or fp8 of these values).
        aux, final = aux.cpu(), final.cpu()
        return [(aux[b, :n], final[b, :n]) for b, n in enumerate(lengths)]

    @torch.inference_mode()
    def capture_async(self, batch_input_ids: list[list[int]], storage_dtype: str) -> Pending:
        aux, final, lengths = self._forward(batch_input_ids)
        states = encode_states(aux, final, storage_dtype)                 # on the device (fp8: half the copy)
        width = aux.shape[1]
        flat, spans = {k: v.flatten(0, 1) for k, v in states.items()}, [(b * width, n) for b, n in enumerate(lengths)]
        return Pending(flat, spans) if self.keep_on_device else self._to_host.send(flat, spans)


def aux_server_args(layer_ids: list[int], arch: str | None = None) -> list[str]:
    """SGLang's flags for the aux-capture server of extraction (internal layer ids; SGLang's per `arch`'s family rule).

    `--speculative-algorithm EAGLE3` only names the capture convention here: with the aux flag SGLang
    resets it and starts no speculative stack (tests/integration/test_sglang_parser.py runs SGLang's
    parser and validation on exactly these flags).
    """
    return ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *map(str, layers.to_engine(list(layer_ids), "sglang", arch)),
            "--disable-radix-cache"]


#: SGLang's flags for the final-hidden server of extraction (the state after the final norm).
FINAL_SERVER_ARGS = ("--enable-return-hidden-states", "--disable-radix-cache")


class ShardedBackend(LocalBackend):
    """`LocalBackend` on a target sharded over every rank of the process group by transformers'
    tensor-parallel plan (`extract.backend: sharded`).

    The sharded forward is collective: every rank must run it on the same batch at the same time.
    Rank 0 (the one writer) broadcasts each batch before its forward; the other ranks `follow()`,
    running the same forwards and dropping the states, until rank 0 `release()`s them. The hooks read
    the residual stream and final norm output, which transformers' plan leaves replicated (the
    row-wise layers all-reduce), so rank 0's states are the whole model's.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], world: distributed.World, *,
                 pad_token_id: int = 0):
        super().__init__(model, layer_ids, pad_token_id=pad_token_id)
        self.world = world

    def _forward(self, batch_input_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        distributed.broadcast_object(self.world, batch_input_ids)
        return super()._forward(batch_input_ids)

    @torch.inference_mode()
    def follow(self) -> int:
        """Ranks > 0: run rank 0's forwards until it releases us; the number of batches run."""
        return distributed.follow_batches(self.world, super()._forward)

    def release(self) -> None:
        """Rank 0: no more batches (also after a failure)."""
        distributed.release_followers(self.world)


def load_sharded(store: Store, target_id: str, layer_ids: list[int], world: distributed.World) -> ShardedBackend:
    """Every rank together: the target split by transformers' tensor-parallel plan, as a ShardedBackend."""
    device = world.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_target(store, target_id, device=str(device), dtype=dtype, tp_plan="auto")
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    split = sum(p.numel() for p in params if isinstance(p, DTensor) or isinstance(p.data, DTensor))
    total = sum(p.numel() for p in params)
    if not split:
        raise ValueError(f"extract.backend=sharded: transformers has no tensor-parallel plan for "
                         f"{type(model).__name__} (nothing was split over the {world.size} ranks); use "
                         "extract.backend=local on a device that holds it, or sglang")
    log.info("extract: target split over %d ranks by transformers' tensor-parallel plan: %d of %d parameters "
             "in DTensor shards", world.size, split, total)
    return ShardedBackend(model, layer_ids, world, pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0)


def find_field(info: Any, name: str) -> Any:
    """`name` in a server_info answer, at the top level or in a nested section (its layout moves between
    SGLang versions); None when absent."""
    if isinstance(info, dict):
        if name in info:
            return info[name]
        for value in info.values():
            if (found := find_field(value, name)) is not None:
                return found
    return None


def check_chunked_prefill_off(info: dict[str, Any], url: str) -> None:
    """SGLang stores no hidden rows for the middle chunks of a chunked prefill (the H200 default chunk is 8192
    tokens): every longer sequence would come back short. Refused unless the server says it is off (-1)."""
    size = find_field(info, "chunked_prefill_size")
    if size is None or int(size) > 0:
        raise ValueError(f"SGLang server {url}: chunked prefill is "
                         f"{'not reported off' if size is None else f'on (chunked_prefill_size={size})'}, and its "
                         "middle chunks return no hidden states; relaunch it with --chunked-prefill-size -1")


class SGLangBackend:
    """A client for SGLang 0.5.23 servers of the target (how a TP=8 target is extracted).

    Contract relied on (reference/sglang.md §2.2, §8 item 6), per server:
    - aux server, launched with `aux_server_args(layer_ids)`. `POST /generate {"input_ids": [[...], ...],
      "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_hidden_states": true}` answers one object
      per sequence whose `meta_info.hidden_states` is a list with one entry per forward pass: entry
      0 is the prefill, `[L, A*H]` = the aux states concatenated in ascending layer order. With
      max_new_tokens=1 the generated token is never forwarded, so there is exactly that entry.
      SGLang's ids name "output of layer k" and it captures k+1: ids = internal − 1 (F4).
    - final server, launched with `FINAL_SERVER_ARGS` (no aux capture): the same
      request answers `[L, H]`, the hidden state SGLang hands its logits processor, i.e. after the
      final norm = HF `hidden_states[-1]`.
    The aux response does NOT carry the final hidden state, and the final one cannot be captured
    as an aux layer (the last layer's output is never entered by a later layer), hence two servers
    (or one server relaunched between two passes over the data).
    The radix cache must be off: a cached prefix is not recomputed and its rows would be missing
    (checked per request: rows must equal L).
    """

    def __init__(self, aux_url: str, final_url: str | None, layer_ids: list[int], *, hidden_size: int,
                 timeout_s: float = 600.0, target_arch: str | None = None):
        if not final_url:
            raise ValueError("extract.backend=sglang needs two servers: extract.server_url (launched with "
                             f"{' '.join(aux_server_args(layer_ids, target_arch))}) and "
                             f"extract.final_server_url (launched with {' '.join(FINAL_SERVER_ARGS)}), "
                             "because SGLang's aux response does not carry the final hidden state")
        self.aux_url, self.final_url = aux_url.rstrip("/"), final_url.rstrip("/")
        self.layer_ids, self.hidden_size, self.timeout_s = list(layer_ids), hidden_size, timeout_s
        # --return-aux-hidden-state-layer-ids goes through the target class's set_eagle3_layers_to_capture:
        # its family's rule applies (DeepSeek: +1 only when the first id is 1)
        self.target_arch = target_arch
        self.sglang_layer_ids = layers.to_engine(self.layer_ids, "sglang", target_arch)
        #: tokens the job will send (set by `expect`): the first batch's rate gives its ETA.
        self.total_tokens: int | None = None

    def expect(self, total_tokens: int) -> None:
        """The tokens this job will send: after the first batch the ETA is printed, and an absurd one refused."""
        self.total_tokens = total_tokens

    def check_server(self, num_hidden_layers: int) -> None:
        """Refuse a server with chunked prefill on, and an aux server that captures other layers than the ones
        recorded (F4)."""
        for url in (self.aux_url, self.final_url):
            check_chunked_prefill_off(self._get(f"{url}/server_info"), url)
        info = self._get(f"{self.aux_url}/server_info")
        ids = info.get("return_aux_hidden_state_layer_ids")
        if ids is None:  # the server captures the model's EAGLE-3 defaults
            captured = layers.default_aux_layer_ids(num_hidden_layers)
        else:
            captured = layers.from_engine(list(ids), "sglang", self.target_arch)
        if captured != self.layer_ids:
            raise ValueError(
                f"SGLang server {self.aux_url} captures internal layers {captured} "
                f"(--return-aux-hidden-state-layer-ids={ids}), but extract records {self.layer_ids}; "
                f"relaunch it with {' '.join(aux_server_args(self.layer_ids, self.target_arch))}")
        # said once the servers answered: a refused server's error stays the step's one line
        log.info("extract: the sglang backend needs two servers of the target at once (aux %s, final %s), each "
                 "holding all of its weights: twice the target's memory", self.aux_url, self.final_url)

    def capture(self, batch_input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start = time.perf_counter()
        aux = self._prefill_hidden(self.aux_url, batch_input_ids, len(self.layer_ids) * self.hidden_size)
        final = self._prefill_hidden(self.final_url, batch_input_ids, self.hidden_size)
        if self.total_tokens is not None:
            self._check_eta(sum(map(len, batch_input_ids)) / max(time.perf_counter() - start, 1e-9))
        return list(zip(aux, final, strict=True))

    def _check_eta(self, tok_per_s: float) -> None:
        """Once, after the first batch: the whole job's ETA at this rate; refused when absurd."""
        hours, self.total_tokens = self.total_tokens / tok_per_s / 3600, None
        log.info("extract: sglang backend at %.0f tok/s on the first batch: ETA %.1f h", tok_per_s, hours)
        if hours > ABSURD_EXTRACT_HOURS:
            raise ValueError(f"extract.backend=sglang: {tok_per_s:.0f} tok/s on the first batch (hidden states "
                             f"through JSON) puts the job at {hours:,.0f} h; use extract.backend=sharded (the "
                             "target in-process over torchrun's ranks, states binary to the shard writer)")

    def capture_async(self, batch_input_ids: list[list[int]], storage_dtype: str) -> Pending:
        rows = self.capture(batch_input_ids)
        states = encode_states(torch.cat([a for a, _ in rows]), torch.cat([f for _, f in rows]), storage_dtype)
        return done(states, [len(s) for s in batch_input_ids])

    def _prefill_hidden(self, url: str, batch: list[list[int]], width: int) -> list[torch.Tensor]:
        body = {"input_ids": batch, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_hidden_states": True}
        outs = self._post(f"{url}/generate", body)
        result = []
        for seq, out in zip(batch, outs, strict=True):
            states = out["meta_info"].get("hidden_states")
            if not states:
                raise ValueError(f"{url}/generate returned no meta_info.hidden_states; launch the server "
                                 "with --enable-return-aux-hidden-states / --enable-return-hidden-states")
            x = torch.tensor(states[0], dtype=torch.float32)
            if x.ndim != 2 or x.shape[1] != width:
                # H-wide rows from the aux server mean aux capture is off: training on them is F1's
                # silent "accept length 1" in the making.
                raise ValueError(f"{url}/generate returned hidden rows of shape {tuple(x.shape)}, expected "
                                 f"[{len(seq)}, {width}]; check the server's --enable-return-aux-hidden-states "
                                 "/ --enable-return-hidden-states flags and that it serves this target")
            if x.shape[0] != len(seq):
                raise ValueError(f"{url}/generate returned {x.shape[0]} hidden rows for {len(seq)} input "
                                 "tokens; launch the server with --disable-radix-cache")
            result.append(x)
        return result

    def _get(self, url: str) -> dict[str, Any]:
        return get_json(url, self.timeout_s)

    def _post(self, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        out = post_json(url, body, self.timeout_s)
        return out if isinstance(out, list) else [out]


def make_backend(cfg: PipelineConfig, store: Store, target_id: str, layer_ids: list[int],
                 tcfg: dict[str, Any], device: torch.device | None = None, *,
                 keep_on_device: bool = False) -> CaptureBackend:
    """The SGLang client, or the target loaded on `device` (default: the first GPU, else the CPU); with
    `keep_on_device` the local target's captured states stay on its device (online training)."""
    if cfg.extract.backend == "sglang":
        backend = SGLangBackend(str(cfg.extract.server_url), cfg.extract.final_server_url,
                                layer_ids, hidden_size=tcfg["hidden_size"],
                                target_arch=layers.target_architecture(tcfg))
        backend.check_server(tcfg["num_hidden_layers"])
        return backend
    # fp32 on CPU (bf16 is ~20x slower on an AVX2 CPU), bf16 on CUDA.
    device = device or torch.device(inference_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_target(store, target_id, device=str(device), dtype=dtype)
    return LocalBackend(model, layer_ids, pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
                        keep_on_device=keep_on_device)
