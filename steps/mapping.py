"""The draft vocabulary: `d2t` / `t2d`, built and validated here and nowhere else (F3).

Reads: a `dataset` artifact (tokenized conversations with loss masks, `steps/datagen.py`).
Writes: a `vocab` artifact, `vocab.safetensors` with
    d2t  int64 [draft_vocab]   offsets: target_id = draft_id + d2t[draft_id]
    t2d  bool  [target_vocab]  True where the target id is in the draft vocab
and metrics `coverage` (fraction of loss-masked tokens inside the draft vocab) and `distinct_tokens`.

The rule (EAGLE `scandata`, SpecForge, speculators agree): count target ids over the tokens the draft
is trained to predict (loss mask 1), keep the `draft_vocab_size` most frequent (ties: lower id
first), pad with the lowest unused ids when there are too few distinct tokens, sort ascending.
F3 is a map stored as absolute ids instead of offsets, a float map, or a missing one: the server
then maps draft ids to the wrong target tokens and acceptance is ≈1 with no error.
`validate_vocab` refuses each of those with a message naming the fault.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import Tensor

from steps.lib.artifacts import VOCAB_FILE, read_conversations, target_config
from steps.lib.checks.vocab import validate_vocab
from steps.lib.config import resolve_draft_vocab_size
from steps.lib.data.shards import save_sorted
from steps.lib.store import Manifest, Store, artifact_id
from steps.registry import step_main

# --- build -----------------------------------------------------------------------------

def _counts_tensor(token_counts: Counter | Tensor, target_vocab: int) -> Tensor:
    """Counts as a dense int64 tensor [target_vocab]; ids outside the vocab are an error."""
    if isinstance(token_counts, Tensor):
        counts = token_counts.to(torch.int64).flatten()
        if counts.numel() != target_vocab:
            raise ValueError(f"token counts have {counts.numel()} entries, expected target_vocab={target_vocab}")
        return counts
    bad = [t for t in token_counts if not 0 <= int(t) < target_vocab]
    if bad:
        raise ValueError(f"token ids {sorted(bad)[:5]} are outside the target vocab [0, {target_vocab}); "
                         "the dataset was tokenized with a different tokenizer than the target's")
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    if token_counts:
        ids = torch.tensor(list(token_counts.keys()), dtype=torch.int64)
        counts[ids] = torch.tensor(list(token_counts.values()), dtype=torch.int64)
    return counts


def build_vocab(token_counts: Counter | Tensor, target_vocab: int, draft_vocab: int) -> tuple[Tensor, Tensor]:
    """Top-`draft_vocab` target ids by count (ties: lower id), padded with the lowest unused ids,
    sorted ascending -> (d2t int64 [draft_vocab] offsets, t2d bool [target_vocab])."""
    if not 0 < draft_vocab <= target_vocab:
        raise ValueError(f"draft_vocab={draft_vocab} must be in [1, target_vocab={target_vocab}]")
    counts = _counts_tensor(token_counts, target_vocab)
    # stable sort of -count keeps ascending id order among equal counts: ties go to the lower id
    order = torch.sort(-counts, stable=True).indices
    seen = order[counts[order] > 0][:draft_vocab]
    if len(seen) < draft_vocab:                     # too few distinct tokens: the lowest unused ids
        unused = torch.ones(target_vocab, dtype=torch.bool)
        unused[seen] = False
        seen = torch.cat([seen, unused.nonzero().flatten()[: draft_vocab - len(seen)]])
    used = torch.sort(seen).values
    d2t = used - torch.arange(draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


# --- counting over a dataset ------------------------------------------------------------------------

def count_assistant_tokens(rows: Iterable[dict]) -> Counter:
    """Counts of the target ids the draft learns to predict (loss_mask == 1)."""
    counts: Counter = Counter()
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        if len(ids) != len(mask):
            raise ValueError(f"conversation {row.get('id')!r}: {len(ids)} input_ids but {len(mask)} loss_mask")
        counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    return counts


def coverage(counts: Counter, t2d: Tensor) -> float:
    """Fraction of counted tokens that are inside the draft vocab."""
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t2d[t]) / total if total else 0.0


# --- the step ---------------------------------------------------------------------------------------

def run(cfg, store: Store, dataset_id: str, target_id: str) -> Manifest:
    """Count assistant tokens of the dataset, build and validate the map, write the vocab artifact."""
    inputs = {"dataset": dataset_id, "target": target_id}
    art_id = artifact_id("vocab", cfg.mapping.model_dump(mode="json"), inputs)
    if store.exists("vocab", art_id):
        return store.manifest("vocab", art_id)
    target_vocab = int(target_config(store, target_id)["vocab_size"])
    draft_vocab = resolve_draft_vocab_size(cfg, target_vocab, f"target {target_id} config.json")
    counts = count_assistant_tokens(read_conversations(store, dataset_id))
    d2t, t2d = build_vocab(counts, target_vocab, draft_vocab)
    validate_vocab(d2t, t2d, target_vocab)
    writer = store.begin("vocab", art_id, step="mapping", inputs=inputs, config=cfg.mapping)
    save_sorted({"d2t": d2t, "t2d": t2d}, writer.path(VOCAB_FILE))
    metrics = {"coverage": coverage(counts, t2d), "distinct_tokens": len(counts),
               "assistant_tokens": sum(counts.values())}
    return writer.commit(metrics=metrics, meta={"target_vocab": target_vocab,
                                                "draft_vocab": cfg.mapping.draft_vocab_size})


def main(argv: list[str] | None = None) -> int:
    return step_main("mapping", argv)


if __name__ == "__main__":
    raise SystemExit(main())
