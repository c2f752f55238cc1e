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
from safetensors.torch import save_file

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


def bytes_per_token(hidden_size: int, num_aux: int, storage_dtype: str) -> int:
    """Bytes one token costs in a shard: A aux + 1 final hidden rows, ids, mask (+ fp8 scales)."""
    rows = (num_aux + 1) * hidden_size
    if storage_dtype == "bfloat16":
        return 2 * rows + TOKEN_BYTES
    if storage_dtype == "float8_e4m3fn":
        return rows + 2 * 4 + TOKEN_BYTES
    raise ValueError(f"storage dtype {storage_dtype!r}: expected one of {sorted(STORAGE_DTYPES)}")


def shard_bytes_bound(tokens: int, sequences: int, *, hidden_size: int, num_aux: int,
                      storage_dtype: str) -> int:
    """An upper bound on the file size of a shard of `tokens` tokens in `sequences` sequences."""
    return (tokens * bytes_per_token(hidden_size, num_aux, storage_dtype)
            + 8 * (sequences + 1) + HEADER_BYTES_BOUND)


# --- encode / decode ----------------------------------------------------------------------------

def _encode(x: torch.Tensor, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float [T, D] → (stored tensor, per-token float32 scale [T, 1] or None)."""
    x = x.detach().to("cpu", torch.float32)
    if storage_dtype == "bfloat16":
        return x.to(torch.bfloat16).contiguous(), None
    absmax = x.abs().amax(dim=-1, keepdim=True)
    # An all-zero row (padding never reaches here, but a zero vector is legal) gets scale 1.
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _decode(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    x = stored.to(torch.float32)
    return x * scale if scale is not None else x


def write_shard(path: str | Path, input_ids: list[list[int]], loss_masks: list[list[int]],
                aux: torch.Tensor, final: torch.Tensor, *, layer_ids: list[int],
                storage_dtype: str = "bfloat16") -> dict[str, int]:
    """Write whole sequences as one shard; returns {"tokens", "sequences", "bytes"}.

    aux: [T, A*H] and final: [T, H], rows in the order of the concatenated `input_ids`.
    """
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {storage_dtype!r}: expected one of {sorted(STORAGE_DTYPES)}")
    lengths = [len(s) for s in input_ids]
    if lengths != [len(m) for m in loss_masks]:
        raise ValueError(f"shard {path}: input_ids lengths {lengths} != loss_mask lengths "
                         f"{[len(m) for m in loss_masks]}")
    tokens, hidden = sum(lengths), final.shape[-1]
    if final.shape != (tokens, hidden) or aux.shape != (tokens, len(layer_ids) * hidden):
        raise ValueError(f"shard {path}: aux {tuple(aux.shape)} / final {tuple(final.shape)} do not "
                         f"match {tokens} tokens × {len(layer_ids)} aux layers × hidden {hidden}")
    tensors = {
        "input_ids": torch.tensor([t for s in input_ids for t in s], dtype=torch.int64),
        "loss_mask": torch.tensor([t for m in loss_masks for t in m], dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
    }
    for name, x in (("aux", aux), ("final", final)):
        stored, scale = _encode(x, storage_dtype)
        tensors[f"{name}_hidden"] = stored
        if scale is not None:
            tensors[f"{name}_scale"] = scale
    metadata = {"format": FORMAT, "layer_ids": json.dumps(list(layer_ids)),
                "hidden_size": str(hidden), "num_aux": str(len(layer_ids)), "dtype": storage_dtype}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    canonicalize_header(path)
    return {"tokens": tokens, "sequences": len(lengths), "bytes": path.stat().st_size}


def canonicalize_header(path: str | Path) -> None:
    """Rewrite a safetensors header in place as sorted, compact JSON.

    safetensors serialises `__metadata__` from a hash map, so its key order (and the file's sha256)
    varied from run to run: two extractions of the same id wrote different bytes. The sorted header
    has the same length (the same keys and values, compact either way); padded with spaces as
    safetensors pads, so tensor offsets do not move."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(text) > n:
            raise ValueError(f"{path}: sorted safetensors header is {len(text)} bytes, longer than the {n} written")
        f.seek(8)
        f.write(text.ljust(n, b" "))


def read_shard(path: str | Path) -> dict[str, Any]:
    """Tensors of a shard with float32 `aux_hidden` / `final_hidden`, plus its metadata.

    Keys: input_ids, loss_mask, cu_seqlens, aux_hidden, final_hidden (tensors) and
    layer_ids (list[int], internal convention), hidden_size (int), dtype (str, the storage dtype).
    """
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        raw = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an eaglenest hidden-state shard (metadata format="
                         f"{meta.get('format')!r}, expected {FORMAT!r}); re-run extract")
    return {
        "input_ids": raw["input_ids"], "loss_mask": raw["loss_mask"], "cu_seqlens": raw["cu_seqlens"],
        "aux_hidden": _decode(raw["aux_hidden"], raw.get("aux_scale")),
        "final_hidden": _decode(raw["final_hidden"], raw.get("final_scale")),
        "layer_ids": json.loads(meta["layer_ids"]), "hidden_size": int(meta["hidden_size"]),
        "dtype": meta["dtype"],
    }


def iter_sequences(shard: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """Per-sequence views of a read shard: input_ids, loss_mask, aux_hidden, final_hidden."""
    cu = shard["cu_seqlens"].tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        yield {k: shard[k][start:end] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")}
