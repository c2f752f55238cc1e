"""Fault injection against the store's commit protocol (issue 11): kill -9 and a faulty S3 peer.

    python tests/fault/fault_injection.py --kills 24 --proxy-runs 4 --seed 0 [--out results.jsonl]

Real step processes (`python -m steps.extract|train`) on a seeded 64-wide tiny Llama (hf_dir) and a
40-row token dataset, three kinds of trial:

- **kill**: a step started on a fresh store is killed with SIGKILL at a uniformly random moment of its
  work (between its lease appearing and the reference run's duration), then run again to the end.
  Round robin over `extract` on file://, `train` on file:// and `upload` (extract onto s3:// on moto,
  each shard uploaded as it is written).
- **proxy**: extract then train onto s3:// through a fault proxy in front of moto that spoils
  `--fault-rate` (10%) of requests: 503 before forwarding, 500 after forwarding (the write happened, the
  client is told it did not), a stall then a dropped connection, a truncated response body. A step that
  exits non-zero is run again (up to 6 attempts).

After each trial: `Store.verify` (every sha256), the shards against a clean reference run's (byte-equal:
no corruption; same set: none lost or doubled), shards uploaded before the kill that were computed again
(`committed shards recomputed`), train_log holding each step once in order, and nothing left in staging.
Figures go to docs/RELIABILITY.md. It lives with the tests (not collected: no `test_` prefix) because it
reads the store's backend to observe staging and leases, which only tests may do (test_architecture).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from steps import mapping, target  # noqa: E402
from steps.lib.artifacts import DRAFT_LOG_FILE, DRAFT_MODEL_FILE  # noqa: E402
from steps.lib.config import load_config  # noqa: E402
from steps.lib.store import ArtifactError, Store, open_store  # noqa: E402
from tests.builders import put_token_dataset, tiny_hf_config  # noqa: E402

VOCAB, DATASET_ID, BUCKET = 320, "da7a5e7000000001", "faults"
FAULTS = ("503-before", "500-after", "stall-drop", "truncated-body")
#: headers of one hop, not forwarded (the proxy has read the whole body: upstream need not say 100 Continue)
HOP_HEADERS = ("transfer-encoding", "connection", "expect")


# --- the fault proxy ---------------------------------------------------------------------------------

class FaultProxy(ThreadingHTTPServer):
    """HTTP proxy to `upstream` (host, port) spoiling `rate` of requests with one of FAULTS (seeded)."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], rate: float, seed: int, stall_s: float = 2.0):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream, self.rate, self.stall_s = upstream, rate, stall_s
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.requests, self.faults = 0, Counter()

    def pick(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.rng.random() >= self.rate:
                return None
            fault = self.rng.choice(FAULTS)
            self.faults[fault] += 1
            return fault


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding",
                                                                                       "connection")], data

    def _handle(self) -> None:
        body = self._body()
        fault = self.server.pick()
        if fault == "503-before":
            return self._reply(503, [("Content-Type", "application/xml")],
                               b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>")
        if fault == "stall-drop":
            time.sleep(self.server.stall_s)
            self.close_connection = True
            return
        status, headers, data = self._forward(body)
        if fault == "500-after":
            return self._reply(500, [("Content-Type", "application/xml")],
                               b"<Error><Code>InternalError</Code><Message>injected after</Message></Error>")
        if fault == "truncated-body" and len(data) > 1:
            self.send_response(status)
            for k, v in headers:
                if k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self._reply(status, headers, data)

    def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response(status)
        head = self.command == "HEAD"          # a HEAD answer keeps upstream's Content-Length: the object's size
        for k, v in headers:
            if head or k.lower() != "content-length":
                self.send_header(k, v)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


# --- the world ---------------------------------------------------------------------------------------

def write_config(root: Path) -> Path:
    # 7 shards of ~100 KB uploaded in rounds of one or two (the budget): kills land between uploads
    return tiny_hf_config(root, vocab_size=VOCAB, extract={"batch_size": 2, "disk_budget": "180KB"},
                          train={"epochs": 4, "checkpoint_every": 3})


def populate(store: Store, config: Path) -> str:
    target_id = target.run(load_config(config), store).id
    put_token_dataset(store, vocab_size=VOCAB, num_rows=40, dataset_id=DATASET_ID)
    return target_id


def step_cmd(step: str, config: Path, store: Store, *ids: str) -> list[str]:
    flags = {"extract": ["--dataset", DATASET_ID], "train": ["--hidden", ids[0], "--vocab", ids[1]] if ids else []}
    return [sys.executable, "-m", f"steps.{step}", "--config", str(config), "--store", store.uri, "--json",
            *flags[step]]


def run_step(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def wait_for(store: Store, key: str, proc: subprocess.Popen, timeout: float = 300) -> float | None:
    """Seconds until `key` exists (the writer's lease: its work began), or None if the process ended first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if store.backend.get_bytes(key) is not None:
            return time.monotonic() - t0
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def hidden_files(store: Store, hidden: str) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in store.verify("hidden", hidden).files}


def check_draft(store: Store, draft: str) -> dict[str, Any]:
    m = store.verify("draft", draft)
    log = [json.loads(x) for x in store.fetch_file("draft", draft, DRAFT_LOG_FILE).read_text().splitlines()]
    return {"steps": m.metrics["steps"], "log_in_order": [r["step"] for r in log] == list(range(m.metrics["steps"])),
            "model_sha256": m.file(DRAFT_MODEL_FILE)["sha256"]}


# --- trials ------------------------------------------------------------------------------------------

def marker(store: Store, kind: str, art: str) -> bool:
    """The work is under way: extract has uploaded a shard (an upload record), train has logged a step."""
    staged = store.backend.list(f"staging/{kind}/{art}/")
    return any("/.partial/" in k if kind == "hidden" else k.endswith(DRAFT_LOG_FILE) for k in staged)


def reference(root: Path, config: Path, env: dict[str, str]) -> dict[str, Any]:
    """A clean run of extract and train: their ids, shard hashes, draft hash, and how long after their
    lease (`<step>_work_s`) and after their first shard or logged step (`<step>_tail_s`) they committed."""
    store = open_store(f"file://{root}/reference", cache_dir=root / "cache-ref")
    target_id = populate(store, config)
    out: dict[str, Any] = {"store": store, "target": target_id}
    cfg = load_config(config)
    for step in ("extract", "train"):
        ids = (out["hidden"], out["vocab"]) if step == "train" else ()
        kind = "hidden" if step == "extract" else "draft"
        proc = subprocess.Popen(step_cmd(step, config, store, *ids), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        art = None
        began = first = done = None
        while proc.poll() is None:
            now = time.monotonic()
            staged = store.backend.list(f"staging/{kind}/")
            if began is None and staged:
                began, art = now, staged[0].split("/")[2]
            if art and first is None and marker(store, kind, art):
                first = now
            if art and done is None and store.backend.size(f"{store.key(kind, art)}/manifest.json") is not None:
                done = now
            time.sleep(0.02)
        stdout, stderr = proc.communicate()
        if proc.returncode != 0 or None in (began, first, done):
            raise SystemExit(f"reference {step} failed or was too quick to observe: {stderr[-2000:]}")
        out[f"{step}_work_s"], out[f"{step}_tail_s"] = done - began, done - first
        art = json.loads(stdout.splitlines()[-1])["id"]
        if step == "extract":
            out["hidden"], out["shards"] = art, hidden_files(store, art)
            out["vocab"] = mapping.run(cfg, store, DATASET_ID, target_id).id
        else:
            out["draft"], out["draft_check"] = art, check_draft(store, art)
    return out


def kill_trial(i: int, kind: str, root: Path, config: Path, env: dict[str, str], ref: dict[str, Any],
               s3: str, rng: random.Random) -> dict[str, Any]:
    if kind == "upload":
        store = open_store(f"s3://{BUCKET}/kill-{i}-{uuid.uuid4().hex[:6]}", cache_dir=root / f"cache-{i}",
                           endpoint_url=s3)
        env = {**env, "EAGLENEST_S3_ENDPOINT_URL": s3}
    else:
        store = open_store(f"file://{root}/kill-{i}", cache_dir=root / f"cache-{i}")
    env = {**env, "EAGLENEST_CACHE": str(root / f"cache-{i}")}
    if kind == "train":
        for k in ("target", "dataset", "hidden", "vocab"):      # the inputs, as the reference made them
            shutil.copytree(ref["store"].local_path(f"artifacts/{k}"), store.local_path(f"artifacts/{k}"))
        step, art_kind, art, ids = "train", "draft", ref["draft"], (ref["hidden"], ref["vocab"])
    else:
        populate(store, config)
        step, art_kind, art, ids = "extract", "hidden", ref["hidden"], ()
    work = ref[f"{step}_work_s"]
    cmd = step_cmd(step, config, store, *ids)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    began = wait_for(store, store.lease_key(art_kind, art), proc)
    # a third of the kills anywhere in the work (loading the model included), the rest once the first shard
    # is uploaded or the first step logged, up to the commit: where resumable state exists
    anchor = "lease" if i % 9 < 3 else "first"
    if anchor == "first":
        while proc.poll() is None and not marker(store, art_kind, art):
            time.sleep(0.02)
    delay = rng.uniform(0, work if anchor == "lease" else ref[f"{step}_tail_s"])
    time.sleep(delay)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rec: dict[str, Any] = {"trial": "kill", "i": i, "kind": kind, "step": step, "anchor": anchor,
                           "kill_after_s": round(delay, 2),
                           "work_began": began is not None, "killed": killed,
                           "committed_before_rerun": store.backend.size(f"{store.key(art_kind, art)}/manifest.json")
                           is not None}
    before = {r["path"]: r["sha256"] for r in store.partial_files(art_kind, art)}
    rec["uploaded_before_rerun"] = len(before)
    again = run_step(cmd, env)
    rec["rerun_exit"] = again.returncode
    if again.returncode != 0:
        rec["rerun_error"] = again.stderr.strip().splitlines()[-1:]
        return rec
    try:
        if step == "extract":
            files = hidden_files(store, art)
            m = store.manifest("hidden", art)
            rec |= {"corrupt": int(files != ref["shards"]),
                    "lost_shards": len(set(ref["shards"]) - set(files)),
                    "extra_shards": len(set(files) - set(ref["shards"])),
                    "resumed_shards": m.meta.get("resumed_shards"),
                    "committed_recomputed": (len(before) - m.meta["resumed_shards"]) if not rec[
                        "committed_before_rerun"] else 0,
                    "resumed_changed": sum(files.get(p) != h for p, h in before.items())}
        else:
            got = check_draft(store, art)
            rec |= {"corrupt": int(not got["log_in_order"] or got["steps"] != ref["draft_check"]["steps"]),
                    "log_in_order": got["log_in_order"],
                    "same_weights_as_reference": got["model_sha256"] == ref["draft_check"]["model_sha256"]}
    except ArtifactError as err:
        rec |= {"corrupt": 1, "error": str(err)}
    rec["staging_left"] = len(store.backend.list("staging/"))
    return rec


def proxy_trial(i: int, root: Path, config: Path, env: dict[str, str], ref: dict[str, Any], s3: str,
                proxy: FaultProxy) -> dict[str, Any]:
    prefix = f"proxy-{i}-{uuid.uuid4().hex[:6]}"
    direct = open_store(f"s3://{BUCKET}/{prefix}", cache_dir=root / f"pcache-{i}", endpoint_url=s3)
    populate(direct, config)
    faulty = f"http://127.0.0.1:{proxy.server_address[1]}"
    env = {**env, "EAGLENEST_S3_ENDPOINT_URL": faulty, "EAGLENEST_CACHE": str(root / f"pcache-{i}-steps")}
    rec: dict[str, Any] = {"trial": "proxy", "i": i, "attempts": {}, "errors": []}
    before = (proxy.requests, Counter(proxy.faults))
    for step, ids in (("extract", ()), ("train", (ref["hidden"], ref["vocab"]))):
        if step == "train":   # the vocab: made in-process through the faulty endpoint too
            for _ in range(6):
                try:
                    faulty_store = open_store(direct.uri, cache_dir=root / f"pcache-{i}-map", endpoint_url=faulty)
                    mapping.run(load_config(config), faulty_store, DATASET_ID, ref["target"])
                    break
                except Exception as err:  # noqa: BLE001 - any failure of the attempt is recorded, then retried
                    rec["errors"].append(f"mapping: {type(err).__name__}: {str(err)[:200]}")
        for attempt in range(1, 7):
            done = run_step(step_cmd(step, config, direct, *ids), env)
            rec["attempts"][step] = attempt
            if done.returncode == 0:
                break
            rec["errors"].append(f"{step}: " + " ".join(done.stderr.strip().splitlines()[-1:])[:300])
        else:
            rec["gave_up"] = step
            break
    rec["requests"] = proxy.requests - before[0]
    rec["faults"] = dict(Counter(proxy.faults) - before[1])
    try:
        files = hidden_files(direct, ref["hidden"])
        rec |= {"corrupt_hidden": int(files != ref["shards"]), "lost_shards": len(set(ref["shards"]) - set(files)),
                "extra_shards": len(set(files) - set(ref["shards"]))}
        if "gave_up" not in rec:
            got = check_draft(direct, ref["draft"])
            rec |= {"corrupt_draft": int(not got["log_in_order"]),
                    "same_weights_as_reference": got["model_sha256"] == ref["draft_check"]["model_sha256"]}
    except ArtifactError as err:
        rec |= {"corrupt": 1, "error": str(err)[:300]}
    left = direct.backend.list("staging/")
    rec["staging_left"], rec["staging_left_keys"] = len(left), left[:5]
    return rec


#: summary fields that must be 0 for a run to pass: anything corrupt, lost, doubled, recomputed after its
#: commit, left in staging, or a step that never finished.
MUST_BE_ZERO = ("corrupt", "lost_shards", "duplicated_shards", "committed_shards_recomputed", "staging_left",
                "rerun_failures", "proxy_gave_up")


def failures(summary: dict[str, Any]) -> dict[str, int]:
    """The summary's fields that broke a promise (empty: the run passed)."""
    return {k: summary[k] for k in MUST_BE_ZERO if summary.get(k)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--proxy-runs", type=int, default=4)
    ap.add_argument("--fault-rate", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON lines of every trial")
    args = ap.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)     # moto's request log

    root = Path(tempfile.mkdtemp(prefix="eaglenest-faults-"))
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
             "NO_PROXY": "127.0.0.1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "EAGLENEST_LEASE_TTL": "20"}
    os.environ.update(creds)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    s3 = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=BUCKET)
    proxy = FaultProxy((host, port), args.fault_rate, args.seed)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    rng, out = random.Random(args.seed), []
    sink = open(args.out, "w") if args.out else None  # noqa: SIM115 - one file for the whole run
    try:
        config = write_config(root)
        t0 = time.monotonic()
        ref = reference(root, config, env)
        print(f"reference: hidden {ref['hidden']} ({len(ref['shards'])} shards, work {ref['extract_work_s']:.1f} s), "
              f"draft {ref['draft']} ({ref['draft_check']['steps']} steps, work {ref['train_work_s']:.1f} s)",
              flush=True)
        trials = [("kill", ("extract", "train", "upload")[i % 3]) for i in range(args.kills)]
        trials += [("proxy", None)] * args.proxy_runs
        for i, (what, kind) in enumerate(trials):
            rec = (kill_trial(i, kind, root, config, env, ref, s3, rng) if what == "kill"
                   else proxy_trial(i, root, config, env, ref, s3, proxy))
            out.append(rec)
            print(json.dumps(rec), flush=True)
            if sink:
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
        result = summary(out, time.monotonic() - t0, args)
        print(json.dumps(result), flush=True)
        broken = failures(result)
        if broken:
            print(f"fault injection: FAILED {broken} (seed {args.seed}; the trials above say which)", flush=True)
            return 1
        print(f"fault injection: {len(out)} passed, 0 failed", flush=True)
        return 0
    finally:
        if sink:
            sink.close()
        proxy.shutdown()
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)


def summary(out: list[dict[str, Any]], seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    kills = [r for r in out if r["trial"] == "kill"]
    proxies = [r for r in out if r["trial"] == "proxy"]
    faults: Counter = Counter()
    for r in proxies:
        faults.update(r.get("faults", {}))
    return {"summary": True, "seconds": round(seconds), "seed": args.seed, "fault_rate": args.fault_rate,
            "kill_trials": len(kills), "killed_mid_work": sum(r["killed"] and r["work_began"] for r in kills),
            "by_kind": dict(Counter(r["kind"] for r in kills)),
            "rerun_failures": sum(r["rerun_exit"] != 0 for r in kills),
            "corrupt": sum(r.get("corrupt", 0) for r in kills) + sum(r.get("corrupt", 0) + r.get("corrupt_hidden", 0)
                                                                    + r.get("corrupt_draft", 0) for r in proxies),
            "lost_shards": sum(r.get("lost_shards", 0) for r in out),
            "duplicated_shards": sum(r.get("extra_shards", 0) for r in out),
            "committed_shards_recomputed": sum(r.get("committed_recomputed", 0) for r in kills),
            "shards_resumed": sum(r.get("resumed_shards") or 0 for r in kills),
            "staging_left": sum(r.get("staging_left", 0) for r in out),
            "proxy_runs": len(proxies), "proxy_requests": sum(r.get("requests", 0) for r in proxies),
            "proxy_faults": dict(faults), "proxy_gave_up": sum("gave_up" in r for r in proxies),
            "proxy_step_retries": sum(sum(a - 1 for a in r["attempts"].values()) for r in proxies),
            "train_same_weights_after_kill": sum(r.get("same_weights_as_reference", False) for r in kills),
            "train_kill_trials": sum(r["kind"] == "train" for r in kills)}


if __name__ == "__main__":
    raise SystemExit(main())
