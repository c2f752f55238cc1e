"""`DraftConfig`: the numbers that define a one-layer EAGLE-3 draft, every tensor shape among them. One record
for the model (`model/draft.py`), the engine formats (shapes of an engine directory, `formats.draft_config`),
the strict checker and doctor. A torch-free leaf, so a format or a check can name it without the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DraftConfig:
    hidden_size: int                 # H, the target's hidden size (the draft layer works at H)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int     # the target's serving context (F5)
    vocab_size: int                  # target vocab: rows of the frozen embedding, length of t2d
    draft_vocab_size: int            # rows of lm_head, length of d2t
    target_hidden_size: int          # Ht: width of each captured aux state
    num_aux: int                     # A = len(layer_ids); fc maps A*Ht -> H

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})
