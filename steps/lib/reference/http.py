"""The reference server's HTTP surface: the subset of SGLang 0.5.23's API the pipeline uses.

Request parsing and response shapes follow SGLang's (shared/reference/sglang.md §4): `/health`,
`/health_generate`, `/server_info`, `/model_info`, `/v1/models`, `POST /generate` with SGLang's
`spec_*` meta_info, `POST /v1/completions` with SSE streaming. What is served comes from the
loaded model (`steps.lib.reference.model.ServedModel`); a request it cannot serve is a 400 naming why.
"""

from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from steps.lib.reference.api import HEALTH_INPUT_IDS, RequestError, finish_reason, sampling
from steps.lib.reference.model import ServedModel


def prompts_of(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    """/generate's `text` or `input_ids`, single or batched -> (token id lists, batched?)."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        return ([list(map(int, x)) for x in ids] if batched else [list(map(int, ids))]), batched
    if body.get("text") is not None:
        texts = body["text"]
        batched = isinstance(texts, list)
        return [tokenizer(t)["input_ids"] for t in (texts if batched else [texts])], batched
    raise RequestError("/generate needs 'text' (str or list) or 'input_ids' (list of ints or of lists)")


class Handler(BaseHTTPRequestHandler):
    backend: ServedModel      # set on the class by `serve`
    hang: bool = False
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        b = self.backend
        path = self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            if not b.ready or self.hang:
                return self.send_json({"error": "starting"}, HTTPStatus.SERVICE_UNAVAILABLE)
            b.generate(HEALTH_INPUT_IDS, {"max_new_tokens": 1, "ignore_eos": True})
            return self.send_json({})
        if not b.ready:
            return self.send_json({"error": "starting"}, HTTPStatus.SERVICE_UNAVAILABLE)
        if path in ("/server_info", "/get_server_info"):
            return self.send_json(b.server_info())
        if path in ("/model_info", "/get_model_info"):
            return self.send_json({"model_path": b.args.model_path, "is_generation": True})
        if path == "/v1/models":
            return self.send_json({"object": "list", "data": [{"id": b.args.model_path, "object": "model"}]})
        self.send_json({"error": f"no route {path}"}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        b = self.backend
        if not b.ready:
            return self.send_json({"error": "starting"}, HTTPStatus.SERVICE_UNAVAILABLE)
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/generate":
                prompts, batched = prompts_of(body, b.tokenizer)
                logprob_ids = body.get("token_ids_logprob") if body.get("return_logprob") else None
                outs = [b.generate(ids, body.get("sampling_params") or {},
                                   logprob_ids=None if logprob_ids is None else list(map(int, logprob_ids)))
                        for ids in prompts]
                return self.send_json(outs if batched else outs[0])
            if self.path == "/v1/completions":
                return self.completions(body)
            self.send_json({"error": f"no route {self.path}"}, HTTPStatus.NOT_FOUND)
        except (RequestError, ValueError, KeyError, TypeError) as err:
            self.send_json({"error": {"message": str(err), "type": "BadRequestError"}}, HTTPStatus.BAD_REQUEST)

    def completions(self, body: dict[str, Any]) -> None:
        """OpenAI /v1/completions: one string prompt (or token ids), optional SSE streaming."""
        b = self.backend
        prompt = body.get("prompt", "")
        ids = list(map(int, prompt)) if isinstance(prompt, list) else b.tokenizer(prompt)["input_ids"]
        params = {"max_new_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 0.0),
                  "ignore_eos": body.get("ignore_eos", False)}
        cid, model = f"cmpl-{uuid.uuid4().hex}", b.args.model_path
        if not body.get("stream"):
            r = b.generate(ids, params)
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(r["output_ids"]),
                     "total_tokens": len(ids) + len(r["output_ids"])}
            return self.send_json({"id": cid, "object": "text_completion", "created": int(time.time()),
                                   "model": model, "usage": usage,
                                   "choices": [{"index": 0, "text": r["text"], "logprobs": None,
                                                "finish_reason": r["meta_info"]["finish_reason"]["type"]}]})
        sampling(params, b.eos)                       # refuse before the 200 goes out
        b.check_ids(ids)
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        out: list[int] = []
        text = ""
        for new in b.stream(ids, params):
            out += new
            full = b.tokenizer.decode(out, skip_special_tokens=True)
            self.sse({"id": cid, "object": "text_completion", "model": model,
                      "choices": [{"index": 0, "text": full[len(text):], "finish_reason": None}]})
            text = full
        self.sse({"id": cid, "object": "text_completion", "model": model,
                  "choices": [{"index": 0, "text": "", "finish_reason": finish_reason(out, b.eos)["type"]}],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                            "total_tokens": len(ids) + len(out)}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def sse(self, obj: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def send_json(self, obj: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args: Any) -> None:
        if self.path.startswith("/health"):      # polled twice a second while starting: not worth a line
            return
        print(f"[reference_server] {self.address_string()} {fmt % args}", flush=True)
