"""The hidden-state shard format: exact bf16 round trip, bounded fp8 error, metadata, boundaries."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from steps.lib.data.shards import bytes_per_token, iter_sequences, read_shard, shard_bytes_bound, write_shard
from steps.lib.store import sha256_file

REPO = Path(__file__).resolve().parents[2]

H, LAYER_IDS = 32, [1, 2, 3]
A = len(LAYER_IDS)


def _sequences(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    masks = [[int(i >= n // 2) for i in range(n)] for n in lengths]
    t = sum(lengths)
    # Hidden states with a realistic spread of magnitudes, incl. a few outlier channels.
    aux = torch.randn(t, A * H, generator=g) * torch.logspace(-2, 1, A * H)
    final = torch.randn(t, H, generator=g) * 3.0
    return ids, masks, aux, final


def test_bf16_round_trip_is_exact_against_bf16_rounded_input(tmp_path):
    ids, masks, aux, final = _sequences([5, 9, 1, 12])
    info = write_shard(tmp_path / "s.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS)
    shard = read_shard(tmp_path / "s.safetensors")
    assert shard["aux_hidden"].dtype == torch.float32 and shard["final_hidden"].dtype == torch.float32
    assert torch.equal(shard["aux_hidden"], aux.to(torch.bfloat16).float())
    assert torch.equal(shard["final_hidden"], final.to(torch.bfloat16).float())
    assert shard["input_ids"].tolist() == [t for s in ids for t in s]
    assert shard["loss_mask"].dtype == torch.uint8 and shard["loss_mask"].tolist() == [m for s in masks for m in s]
    assert info == {"tokens": 27, "sequences": 4, "bytes": (tmp_path / "s.safetensors").stat().st_size}


def test_metadata_and_cu_seqlens_describe_the_sequences(tmp_path):
    ids, masks, aux, final = _sequences([5, 9, 1, 12])
    write_shard(tmp_path / "s.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS)
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert f.get_tensor("aux_hidden").dtype == torch.bfloat16
    assert meta["layer_ids"] == "[1, 2, 3]" and meta["hidden_size"] == "32" and meta["dtype"] == "bfloat16"
    shard = read_shard(tmp_path / "s.safetensors")
    assert shard["layer_ids"] == LAYER_IDS and shard["hidden_size"] == H and shard["dtype"] == "bfloat16"
    assert shard["cu_seqlens"].dtype == torch.int64 and shard["cu_seqlens"].tolist() == [0, 5, 14, 15, 27]
    seqs = list(iter_sequences(shard))
    assert [s["input_ids"].tolist() for s in seqs] == ids
    assert [s["loss_mask"].tolist() for s in seqs] == masks
    assert torch.equal(seqs[1]["aux_hidden"], aux[5:14].to(torch.bfloat16).float())
    assert seqs[3]["final_hidden"].shape == (12, H)


def test_fp8_error_is_bounded_by_the_e4m3_mantissa(tmp_path):
    """Bound: per element |x̂ − x| ≤ 2^-4·|x| + 2^-10·s, with s = absmax(row)/448 the per-token scale.

    2^-4 is half an ulp of e4m3's 3-bit mantissa (relative), 2^-10·s half the subnormal spacing
    (2^-9) for values that scale below e4m3's smallest normal. Per token the relative L2 error is
    therefore ≤ 2^-4 as well; measured it is ≈ 2-3%.
    """
    ids, masks, aux, final = _sequences([40, 24])
    aux[3] = 0.0  # an all-zero token must survive (scale 1, not a division by zero)
    write_shard(tmp_path / "s.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS,
                storage_dtype="float8_e4m3fn")
    shard = read_shard(tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        assert f.get_tensor("aux_hidden").dtype == torch.float8_e4m3fn
        assert f.get_tensor("final_scale").shape == (64, 1) and f.get_tensor("aux_scale").dtype == torch.float32
    assert shard["dtype"] == "float8_e4m3fn"
    for x, x_hat in ((aux, shard["aux_hidden"]), (final, shard["final_hidden"])):
        s = x.abs().amax(-1, keepdim=True) / 448
        assert ((x_hat - x).abs() <= 2**-4 * x.abs() + 2**-10 * s + 1e-12).all()
        rel = (x_hat - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
        assert rel.max() <= 2**-4
    assert torch.equal(shard["aux_hidden"][3], torch.zeros(A * H))


def test_bytes_per_token_and_bound_match_real_files(tmp_path):
    assert bytes_per_token(576, 3, "bfloat16") == 2 * 4 * 576 + 9
    assert bytes_per_token(7168, 3, "float8_e4m3fn") == 4 * 7168 + 8 + 9
    for dtype in ("bfloat16", "float8_e4m3fn"):
        ids, masks, aux, final = _sequences([30, 50, 7])
        info = write_shard(tmp_path / f"{dtype}.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS,
                           storage_dtype=dtype)
        bound = shard_bytes_bound(87, 3, hidden_size=H, num_aux=A, storage_dtype=dtype)
        payload = 87 * bytes_per_token(H, A, dtype) + 8 * 4
        assert payload < info["bytes"] <= bound


def test_mismatched_shapes_are_refused_with_the_shapes_named(tmp_path):
    ids, masks, aux, final = _sequences([5, 9])
    with pytest.raises(ValueError, match="aux"):
        write_shard(tmp_path / "s.safetensors", ids, masks, aux[:, :H], final, layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="loss_mask"):
        write_shard(tmp_path / "s.safetensors", ids, [masks[0], masks[1][:3]], aux, final, layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="storage dtype"):
        write_shard(tmp_path / "s.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS, storage_dtype="fp16")


# --- reproducible bytes (issue 11) ---------------------------------------------------------------------

def test_the_same_shard_written_by_two_processes_has_the_same_sha256(tmp_path):
    """safetensors orders `__metadata__` by a per-process random hash; write_shard sorts the header."""
    script = textwrap.dedent("""
        import sys, torch
        from steps.lib.data.shards import write_shard
        g = torch.Generator().manual_seed(0)
        aux, final = torch.randn(5, 12, generator=g), torch.randn(5, 4, generator=g)
        write_shard(sys.argv[1], [[1, 2, 3, 4, 5]], [[0, 1, 1, 1, 1]], aux, final, layer_ids=[1, 2, 3])
    """)
    paths = [tmp_path / f"{k}.safetensors" for k in range(4)]
    for p in paths:
        subprocess.run([sys.executable, "-c", script, str(p)], cwd=REPO, check=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert len({sha256_file(p) for p in paths}) == 1
    assert read_shard(paths[0])["layer_ids"] == [1, 2, 3]


# --- the fast writer (issue 14) -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_shard_writer_writes_what_safetensors_writes_with_a_sorted_header(tmp_path, dtype):
    """`save_sorted` writes from the tensors' memory: its files hold safetensors' tensor bytes at its offsets,
    behind the same header sorted, and safetensors reads them back."""
    import json

    from safetensors.torch import save_file

    from steps.lib.data.shards import encode_states, save_sorted

    ids, masks, aux, final = _sequences([30, 50, 7])
    tensors = {"input_ids": torch.tensor([t for s in ids for t in s]), "loss_mask": torch.ones(87, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 30, 80, 87]), **encode_states(aux, final, dtype)}
    meta = {"z": "1", "layer_ids": "[1, 2, 3]", "dtype": dtype}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=meta)
    save_sorted(tensors, tmp_path / "ours.safetensors", meta)
    ref, ours = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "ours.safetensors").read_bytes()
    n = int.from_bytes(ours[:8], "little")
    assert len(ref) == len(ours) and ref[:8] == ours[:8] and ref[8 + n:] == ours[8 + n:]
    header = ours[8:8 + n].decode()
    assert json.loads(header) == json.loads(ref[8:8 + n])
    assert header.rstrip() == json.dumps(json.loads(header), sort_keys=True, separators=(",", ":"))
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as f:
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k).view(torch.uint8), v.contiguous().view(torch.uint8))


def test_bf16_states_are_stored_as_they_are():
    """A GPU replica's bf16 states are not rounded through fp32 on their way to the file."""
    from steps.lib.data.shards import encode

    x = torch.randn(5, 8).to(torch.bfloat16)
    stored, scale = encode(x, "bfloat16")
    assert scale is None and stored.dtype == torch.bfloat16 and torch.equal(stored, x)


def test_training_batches_decode_fp8_shards(tmp_path):
    """The trainer's batches come from `read_shard`: fp8 shards arrive as float32 within fp8's bound."""
    from steps.lib.training.plan import make_batch

    ids, masks, aux, final = _sequences([40, 24])
    write_shard(tmp_path / "s.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS, storage_dtype="float8_e4m3fn")
    batch = make_batch(read_shard(tmp_path / "s.safetensors"), [[(0, 40), (1, 24)]], max_length=64)
    assert batch.aux.dtype == torch.float32 and batch.aux.shape == (1, 64, A * H)
    rel = (batch.aux[0] - aux).norm(dim=-1) / aux.norm(dim=-1)
    assert 0 < rel.max() <= 2**-4
    assert torch.allclose(batch.final[0], final, rtol=2**-4, atol=1e-6)


def test_a_batch_gathers_each_sequence_in_place_and_pads_with_zeros(tmp_path):
    """make_batch's one concatenation per tensor: rows packed in plan order, doc/pos per sequence, padding zero."""
    from steps.lib.training.plan import make_batch

    ids, masks, aux, final = _sequences([7, 5, 9])
    aux, final = aux.bfloat16().float(), final.bfloat16().float()        # what a bf16 shard holds, exactly
    write_shard(tmp_path / "s.safetensors", ids, masks, aux, final, layer_ids=LAYER_IDS)
    batch = make_batch(read_shard(tmp_path / "s.safetensors"), [[(2, 9), (0, 3)], [(1, 5)]], max_length=16)
    assert batch.input_ids.shape == (2, 12)                            # as long as the fullest row
    starts = {0: 0, 1: 7, 2: 12}
    for r, row in enumerate([[(2, 9), (0, 3)], [(1, 5)]]):
        at = 0
        for d, (seq, n) in enumerate(row):
            src = slice(starts[seq], starts[seq] + n)
            assert batch.input_ids[r, at:at + n].tolist() == ids[seq][:n]
            assert batch.loss_mask[r, at:at + n].tolist() == [bool(m) for m in masks[seq][:n]]
            assert torch.equal(batch.aux[r, at:at + n], aux[src]) and torch.equal(batch.final[r, at:at + n], final[src])
            assert batch.doc[r, at:at + n].tolist() == [d] * n and batch.pos[r, at:at + n].tolist() == list(range(n))
            at += n
        pad = slice(at, None)
        assert (batch.doc[r, pad] == -1).all() and not batch.loss_mask[r, pad].any()
        assert not batch.input_ids[r, pad].any() and not batch.aux[r, pad].any() and not batch.final[r, pad].any()
    assert batch.tokens == 17
