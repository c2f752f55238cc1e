"""Prompt sources and hidden-state shards."""
