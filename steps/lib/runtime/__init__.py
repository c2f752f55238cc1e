"""Processes, distributed, progress, redaction."""
