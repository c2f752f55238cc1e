"""A step process started before its step is known: `python -m steps.warm_start`.

Starting Python and importing torch and transformers costs 2–4 s on a small machine, more than many tiny
steps' own work. An orchestrator that runs steps one after another as processes (flows/step_process.py)
starts the next one of these while the current step runs; it imports what every step needs, then waits
for one line on stdin, `{"step": name, "argv": [...], "env": {...}}`, and runs exactly what
`python -m steps.<name> ARGV` would (`step_main`). End of input before any line: exit 0 (the orchestrator
ended and needs no more steps).
"""

from __future__ import annotations

import json
import os
import sys


def preload() -> None:
    """What nearly every step imports: torch, transformers' auto classes, the library's config and store."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import steps.lib.artifacts  # noqa: F401
    import steps.registry  # noqa: F401


def main() -> int:
    preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    os.environ.update(request.get("env") or {})
    from steps.registry import step_main

    return step_main(request["step"], request["argv"])


if __name__ == "__main__":
    raise SystemExit(main())
