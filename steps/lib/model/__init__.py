"""The draft model, batched decoding, the reference engine."""
