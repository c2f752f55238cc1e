"""HEALTHCHECK of the eaglenest images: GET $EAGLENEST_HEALTH_URL, healthy on HTTP 200.

A container that runs a batch step (mapping, export, a Prefect flow run) serves nothing: with the
variable unset or empty it reports healthy. The serve image sets it to SGLang's /health; the
reference server and the MinIO adapter set it in their compose services. Standard library only,
so it runs with whatever Python the base image has.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 5


def main() -> int:
    url = os.environ.get("EAGLENEST_HEALTH_URL", "")
    if not url:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as err:
        print(f"healthcheck: GET {url}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
