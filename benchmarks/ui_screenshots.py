"""Headless Chromium screenshots of a pipeline run's page and its report artifact in the Prefect UI (issue 26).

Starts nothing: given a running Prefect server (its API URL; the UI is served beside it, `eaglenest stack up`
without `--no-ui`) and a flow-run id, it finds the run's report artifact (`eagle3-<config>-00-report`, the
key `flows.ui.artifact_key("report", ...)` gives), screenshots both pages with `chromium --headless
--screenshot`, and checks each PNG is not blank (the UI rendered: more than a few colours, and not one colour
over almost all of it) and each page's DOM shows what a user looks for (the run's state name; the report's
`eagle3-pipeline` title, flows/ui.py's run_report). Exit 0 when both pages rendered, 1 otherwise, 2 on bad input.

    python benchmarks/ui_screenshots.py --api http://127.0.0.1:4200/api --flow-run <id> --out /tmp/shots

Chromium is not a CI dependency: Debian's `apt-get install chromium` is enough, or pass `--chromium PATH`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from PIL import Image

#: a page counts as rendered when its most common colour covers less than this share of the pixels ...
MAX_BACKGROUND_SHARE = 0.98
#: ... and it has at least this many distinct colours (text, icons, the state badge)
MIN_COLOURS = 16


def api_post(api: str, path: str, body: dict) -> list | dict:
    """POST a JSON body to the Prefect API and return its JSON answer."""
    request = urllib.request.Request(f"{api.rstrip('/')}/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def report_artifact_id(api: str, flow_run_id: str) -> str | None:
    """The id of the run's report artifact (its key ends in `-00-report`), or None when it has none."""
    artifacts = api_post(api, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    reports = [a for a in artifacts if (a.get("key") or "").endswith("-00-report")]
    return reports[0]["id"] if reports else None


def screenshot(chromium: str, url: str, png: Path, *, width: int = 1400, height: int = 1000,
               budget_ms: int = 15000) -> None:
    """One headless screenshot of `url`; the virtual-time budget lets the UI's scripts fetch and draw first."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", url],
                       check=True, capture_output=True, timeout=180)


def blank_reason(png: Path) -> str | None:
    """Why the screenshot looks blank (None when it shows a rendered page)."""
    if not png.exists() or png.stat().st_size == 0:
        return "no PNG written"
    image = Image.open(png).convert("RGB")
    colours = image.getcolors(maxcolors=image.width * image.height)
    share = max(count for count, _ in colours) / (image.width * image.height)
    if share >= MAX_BACKGROUND_SHARE or len(colours) < MIN_COLOURS:
        return f"blank: {len(colours)} colours, the most common covers {share:.1%}"
    return None


def missing_text(chromium: str, url: str, text: str, budget_ms: int = 15000) -> str | None:
    """Why the rendered page lacks `text` (the run's state name, the report's title), None when it shows it."""
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                              f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                             check=True, capture_output=True, text=True, timeout=180).stdout
    return None if text in dom else f"the page does not show {text!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", required=True, help="the Prefect API URL, e.g. http://127.0.0.1:4200/api")
    parser.add_argument("--flow-run", required=True, help="the pipeline's flow-run id")
    parser.add_argument("--out", type=Path, default=Path("ui-screenshots"), help="folder for the PNGs")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"),
                        help="the Chromium binary (default: chromium on PATH)")
    args = parser.parse_args(argv)
    if not args.chromium:
        print("--chromium: no chromium on PATH; install it (apt-get install chromium) or pass its path",
              file=sys.stderr)
        return 2
    ui = args.api.rstrip("/").removesuffix("/api")
    run = json.load(urllib.request.urlopen(f"{args.api.rstrip('/')}/flow_runs/{args.flow_run}", timeout=30))
    pages = {"run": (f"{ui}/runs/flow-run/{args.flow_run}", run["state"]["name"])}
    artifact = report_artifact_id(args.api, args.flow_run)
    if artifact is None:
        print(f"--flow-run {args.flow_run}: no report artifact (key *-00-report); pass a pipeline run that ended",
              file=sys.stderr)
        return 2
    pages["report"] = (f"{ui}/artifacts/artifact/{artifact}", "eagle3-pipeline")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, (url, text) in pages.items():
        png = args.out / f"{name}.png"
        screenshot(args.chromium, url, png)
        reason = blank_reason(png) or missing_text(args.chromium, url, text)
        print(f"{name}: {png} {'OK' if reason is None else reason}  ({url})")
        failed += reason is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
