"""Capture backends and the shard writer."""
