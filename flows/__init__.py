"""Prefect flows around the steps. Nothing here touches tensors.

Defaults for running without a configured Prefect API: the temporary server Prefect starts needs
more than its default 20 s on a busy 2-core machine, and it should not phone home.
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
