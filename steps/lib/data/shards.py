"""The hidden-state shard format: one safetensors file holding whole sequences.

Written by `steps/extract.py`, read by `steps/train.py` (and `steps/mapping.py` for token ids).
A shard `shards/shard-{i:05d}.safetensors` holds, for T tokens of n concatenated sequences:

    input_ids     int64  [T]          the target's token ids
    loss_mask     uint8  [T]          1 on assistant tokens (what the draft is trained on)
    cu_seqlens    int64  [n+1]        sequence boundaries: sequence k is [cu[k], cu[k+1])
    aux_hidden    [T, A*H]            aux layers in ascending internal id order, concatenated
    final_hidden  [T, H]              HF hidden_states[-1] (after the final norm)

Storage: `bfloat16` (both hidden tensors bf16) or `float8_e4m3fn` (both fp8, plus `aux_scale` /
`final_scale` float32 [T, 1], the per-token absmax / 448). fp8 halves the bytes per token, the
second lever after rounds against the disk wall of F8. The safetensors metadata records
`layer_ids` (internal convention, F4), `hidden_size` and `dtype`, so a reader never guesses which
layers a shard holds. `read_shard` always hands back float32 hidden states.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from steps.lib.files import naming

STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
#: largest finite float8_e4m3fn value: a per-token scale of absmax/448 maps each row onto the
#: full fp8 range, so the relative rounding error is that of a 3-bit mantissa (≤ 2^-4).
FP8_MAX = 448.0
#: input_ids (int64) + loss_mask (uint8) per token.
TOKEN_BYTES = 8 + 1
#: safetensors header (JSON of 7 tensor entries + metadata, 8-byte aligned) stays far below this;
#: the extract planner adds it so that its estimate of a shard's size is an upper bound.
HEADER_BYTES_BOUND = 4096
FORMAT = "eaglenest-hidden-v1"


def check_storage_dtype(storage_dtype: str) -> str:
    """The one check of a storage dtype's name (`extract.storage_dtype` is a Literal; this guards callers
    that name one in code)."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {storage_dtype!r}: expected one of {sorted(STORAGE_DTYPES)}")
    return storage_dtype


def bytes_per_token(hidden_size: int, num_aux: int, storage_dtype: str) -> int:
    """Bytes one token costs in a shard: A aux + 1 final hidden rows, ids, mask (+ fp8 scales)."""
    rows = (num_aux + 1) * hidden_size
    if check_storage_dtype(storage_dtype) == "bfloat16":
        return 2 * rows + TOKEN_BYTES
    return rows + 2 * 4 + TOKEN_BYTES


def shard_bytes_bound(tokens: int, sequences: int, *, hidden_size: int, num_aux: int,
                      storage_dtype: str) -> int:
    """An upper bound on the file size of a shard of `tokens` tokens in `sequences` sequences."""
    return (tokens * bytes_per_token(hidden_size, num_aux, storage_dtype)
            + 8 * (sequences + 1) + HEADER_BYTES_BOUND)


# --- encode / decode ----------------------------------------------------------------------------

def encode(x: torch.Tensor, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float [.., D] on any device → (stored tensor, per-token float32 scale [.., 1] or None).

    bf16 states (a GPU replica's) are stored as they are, with no fp32 round trip; fp32 states
    (a CPU replica's, SGLang's) round once. fp8 runs where the states are, so a GPU extraction
    copies half the bytes to the host."""
    if check_storage_dtype(storage_dtype) == "bfloat16":
        return x.detach().to(torch.bfloat16).contiguous(), None
    x = x.detach().float()
    absmax = x.abs().amax(dim=-1, keepdim=True)
    # An all-zero row (padding never reaches here, but a zero vector is legal) gets scale 1.
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def encode_states(aux: torch.Tensor, final: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """The stored hidden tensors of a shard (`aux_hidden`, `final_hidden`, fp8: `aux_scale`, `final_scale`)."""
    out = {}
    for name, x in (("aux", aux), ("final", final)):
        stored, scale = encode(x, storage_dtype)
        out[f"{name}_hidden"] = stored
        if scale is not None:
            out[f"{name}_scale"] = scale
    return out


def _decode(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    x = stored.to(torch.float32)
    return x * scale if scale is not None else x


def decode_states(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`encode_states`' tensors (or a shard's) -> float32 `aux_hidden` / `final_hidden`, as training reads them."""
    return {f"{n}_hidden": _decode(stored[f"{n}_hidden"], stored.get(f"{n}_scale")) for n in ("aux", "final")}


def write_shard(path: str | Path, input_ids: list[list[int]], loss_masks: list[list[int]],
                aux: torch.Tensor, final: torch.Tensor, *, layer_ids: list[int],
                storage_dtype: str = "bfloat16") -> dict[str, int]:
    """Write whole sequences as one shard; returns {"tokens", "sequences", "bytes"}.

    aux: [T, A*H] and final: [T, H], rows in the order of the concatenated `input_ids`.
    """
    check_storage_dtype(storage_dtype)
    tokens, hidden = sum(len(s) for s in input_ids), final.shape[-1]
    if final.shape != (tokens, hidden) or aux.shape != (tokens, len(layer_ids) * hidden):
        raise ValueError(f"shard {path}: aux {tuple(aux.shape)} / final {tuple(final.shape)} do not "
                         f"match {tokens} tokens × {len(layer_ids)} aux layers × hidden {hidden}")
    return write_encoded(path, input_ids, loss_masks, encode_states(aux.cpu(), final.cpu(), storage_dtype),
                         layer_ids=layer_ids, storage_dtype=storage_dtype)


def write_encoded(path: str | Path, input_ids: list[list[int]], loss_masks: list[list[int]],
                  states: dict[str, torch.Tensor], *, layer_ids: list[int], storage_dtype: str) -> dict[str, int]:
    """Write a shard whose hidden tensors are encoded already (`encode_states`, CPU tensors)."""
    lengths = [len(s) for s in input_ids]
    if lengths != [len(m) for m in loss_masks]:
        raise ValueError(f"shard {path}: input_ids lengths {lengths} != loss_mask lengths "
                         f"{[len(m) for m in loss_masks]}")
    tensors = {
        "input_ids": torch.tensor([t for s in input_ids for t in s], dtype=torch.int64),
        "loss_mask": torch.tensor([t for m in loss_masks for t in m], dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        **states,
    }
    metadata = {"format": FORMAT, "layer_ids": json.dumps(list(layer_ids)),
                "hidden_size": str(states["final_hidden"].shape[-1]), "num_aux": str(len(layer_ids)),
                "dtype": storage_dtype}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_sorted(tensors, path, metadata)
    return {"tokens": sum(lengths), "sequences": len(lengths), "bytes": path.stat().st_size}


#: safetensors' dtype names, in the order of its `Dtype` enum: it lays tensors out by descending
#: enum position, then name; `save_sorted` does the same, so its files equal `save_file`'s byte for byte.
_SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
                       torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64",
                       torch.int64: "I64"}
_RANK = {d: i for i, d in enumerate(_SAFETENSORS_DTYPES)}


def save_sorted(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file with a sorted, compact header, written straight from the tensors' memory.

    `safetensors.torch.save_file` copies every tensor into a Python `bytes` first (one more pass
    over ~1 GB a shard on the write path the extraction waits for) and serialises `__metadata__`
    from a hash map, so its key order (and the file's sha256) varied from run to run. Here the
    header is `json.dumps(sort_keys=True)`, padded with spaces to 8 bytes as safetensors pads, and
    each tensor's bytes are written from a zero-copy view (the write releases the GIL). Python's writes
    also raise on a full disk, naming the file (`save_file` on a full device returned without an error);
    without metadata the file equals `save_file`'s without metadata."""
    order = sorted(tensors, key=lambda k: (-_RANK[tensors[k].dtype], k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata is not None else {}
    at = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text = text.ljust(-(-len(text) // 8) * 8, b" ")
    with naming(Path(path)), open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for k in order:
            t = tensors[k].detach().cpu().contiguous()
            if t.numel():
                f.write(t.view(-1).view(torch.uint8).numpy().data)


def read_shard(path: str | Path, device: torch.device | None = None) -> dict[str, Any]:
    """Tensors of a shard with float32 `aux_hidden` / `final_hidden`, plus its metadata; with `device`, the
    stored tensors go there before they are decoded (a GPU receives bf16 or fp8 bytes, not float32).

    Keys: input_ids, loss_mask, cu_seqlens, aux_hidden, final_hidden (tensors) and
    layer_ids (list[int], internal convention), hidden_size (int), dtype (str, the storage dtype).
    """
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        raw = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an eaglenest hidden-state shard (metadata format="
                         f"{meta.get('format')!r}, expected {FORMAT!r}); re-run extract")
    if device is not None:          # the offsets stay on the host: batches are planned there
        raw = {k: v if k == "cu_seqlens" else v.to(device) for k, v in raw.items()}
    return {
        "input_ids": raw["input_ids"], "loss_mask": raw["loss_mask"], "cu_seqlens": raw["cu_seqlens"],
        **decode_states(raw),
        "layer_ids": json.loads(meta["layer_ids"]), "hidden_size": int(meta["hidden_size"]),
        "dtype": meta["dtype"],
    }


def iter_sequences(shard: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """Per-sequence views of a read shard: input_ids, loss_mask, aux_hidden, final_hidden."""
    cu = shard["cu_seqlens"].tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        yield {k: shard[k][start:end] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")}
