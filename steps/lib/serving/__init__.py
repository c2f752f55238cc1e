"""Serving an export: launch command, preflight, start, health."""
