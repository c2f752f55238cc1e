"""SGLang 0.5.23's own loader and capture set-up, on a CPU, as the judge of SGLang draft directories.

Runs inside `.venv-sglang` (scripts/setup-sglang-venv.sh), never in the main venv: it imports sglang.
tests/integration/test_sglang_loader.py calls it once for all its cases:

    .venv-sglang/bin/python tests/integration/sglang_judge.py < request.json > verdicts.json

stdin: `{"cases": [{"name", "draft", "target", "server_args"?}]}` (directories: an SGLang draft, the target's
HF dir; `server_args`: more `ServerArgs` fields, e.g. the `context_length` our launch command sets). A case
`{"name", "target", "argv"}` (after the draft cases) is a target server without a draft, started with those
flags (extraction's aux-capture server): SGLang's parser reads them, then only step 3 runs.
stdout, last line: `{"version", "cases": {name: verdict}}`; SGLang's own logging goes to stderr.

Per case, as one SGLang server start would (`Scheduler` → `TpModelWorker` → `ModelRunner`):
1. publish `ServerArgs(model_path=target, speculative_algorithm="EAGLE3",
   speculative_draft_model_path=draft, device="cpu", tp_size=1)` (resolution included);
2. weights: the draft's `ModelConfig.from_server_args(..., is_draft_model=True)`, the class SGLang's
   `ModelRegistry` resolves from `architectures`, built by `model_loader.loader._initialize_model` under
   the config's dtype; every parameter and buffer is filled with a sentinel (NaN; the integer minimum
   for integer tensors), then `DefaultModelLoader.load_weights_and_postprocess` feeds the model's real
   `load_weights` with SGLang's own safetensors iterator (`DefaultModelLoader._get_all_weights`);
3. layer ids: the target's `ModelConfig`, `resolve_spec_aux_hidden_state_config` (ModelRunner.
   init_spec_aux_hidden_state: reads the draft's `eagle_config`), the target model class built the
   same way, then `configure_aux_hidden_state_capture` (ModelRunner.init_attention_backends: calls
   `set_eagle3_layers_to_capture`); the verdict reads back `model.layers_to_capture`.

How ignored keys and partial loads are detected, without touching SGLang's loading code: the weight
iterator handed to `load_weights` is observed key by key. Just before it yields a key, every parameter
is snapshot and reset to the sentinel; when the loader asks for the next key (it has finished with this
one), the elements that are no longer sentinel are exactly what this key wrote, whatever their values
(a duplicate key that rewrites the same values is still seen), and the snapshot is merged back so the
model ends exactly as an uninstrumented load leaves it. A key that wrote nothing, raised nothing and
did not replace `hot_token_id` was dropped by the loader. Each write is compared with the checkpoint
tensor (cast to the parameter's dtype; rows SGLang pads with zeros are allowed). After the last key,
a parameter that is still all sentinel was never loaded, one that is partly sentinel was partly loaded
(e.g. q and v of a fused qkv_proj but no k). SGLang stops at a loader error (the server does not
start); the judge records the key and error and resumes with the next key so that one verdict lists
every problem.

Stand-ins (module stubs) only for what a CPU cannot import: `torchvision` (an InternVL helper on the
config import path) and `sgl_kernel` (SGLang's compiled kernels: CPU-engine ops are looked up at
import and called only in forward passes). Every use of a stand-in while weights load is reported
(`stub_uses_during_load`, expected empty). `SGLANG_USE_CPU_ENGINE=1` is SGLang's own CPU mode; without
it the rotary embedding looks up a CUDA kernel (`vllm._custom_ops`) at construction.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import traceback
import types
from typing import Any
from unittest import mock

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# --- stand-ins for what a CPU cannot import ----------------------------------------------------------

STUBBED = ("torchvision", "sgl_kernel")
STUB_ACCESSES: list[str] = []            # "module.attr" in order of first access
STUB_MOCKS: dict[str, mock.MagicMock] = {}

import transformers.utils.import_utils  # noqa: E402,F401  (records "torchvision: absent" before the stub exists)


class _StubModule(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        STUB_ACCESSES.append(full)
        value = STUB_MOCKS[full] = mock.MagicMock(name=full)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())


def stub_state() -> tuple[int, dict[str, int]]:
    return len(STUB_ACCESSES), {k: len(m.mock_calls) for k, m in STUB_MOCKS.items()}


def stub_uses_since(state: tuple[int, dict[str, int]]) -> list[str]:
    n, calls = state
    used = [f"accessed {a}" for a in STUB_ACCESSES[n:]]
    used += [f"called {k}" for k, m in STUB_MOCKS.items() if len(m.mock_calls) > calls.get(k, 0)]
    return used


# --- SGLang ------------------------------------------------------------------------------------------

import sglang  # noqa: E402
import torch  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig, LoadFormat  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed.parallel_state import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (  # noqa: E402
    configure_aux_hidden_state_capture,
)
from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (  # noqa: E402
    resolve_spec_aux_hidden_state_config,
)
from sglang.srt.model_loader.loader import (  # noqa: E402
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
    get_model_loader,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, get_model, get_spec, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

CPU = torch.device("cpu")


def error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def publish_case(target: str, draft: str, **server_args: Any) -> ServerArgs:
    """The process-wide config one `sglang.launch_server` for this draft would publish (last wins)."""
    args = ServerArgs(model_path=target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                      device="cpu", tp_size=1, **server_args)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return args


def init_distributed() -> None:
    """world=1 over gloo, then SGLang's model-parallel groups (its layers need them even at tp=1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")


def build(model_config: ModelConfig) -> tuple[torch.nn.Module, DefaultModelLoader]:
    """DefaultModelLoader.load_model up to (not including) the weights: class, dtype, device."""
    load_config = LoadConfig(load_format=LoadFormat.AUTO)
    loader = get_model_loader(load_config, model_config)
    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), CPU:
        model = _initialize_model(model_config, load_config, quant_config)
    return model, loader


# --- the sentinel ------------------------------------------------------------------------------------

def fill_sentinel(t: torch.Tensor) -> bool:
    """Fill in place; False for a tensor no sentinel fits (bool)."""
    if t.dtype.is_floating_point:
        t.data.fill_(float("nan"))
    elif t.dtype == torch.bool:
        return False
    else:
        t.data.fill_(torch.iinfo(t.dtype).min)
    return True


def is_sentinel(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.isnan(t)
    return t == torch.iinfo(t.dtype).min


class KeyByKey:
    """The weight iterator SGLang's loader consumes, observed one key at a time (module docstring)."""

    def __init__(self, model: torch.nn.Module, weights):
        self.model, self.weights = model, iter(weights)
        self.params = dict(model.named_parameters())
        self.keys: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.current: str | None = None

    def __iter__(self):
        for name, tensor in self.weights:
            before = {n: p.detach().clone() for n, p in self.params.items()}
            for p in self.params.values():
                fill_sentinel(p)
            hot_before = getattr(self.model, "hot_token_id", None)
            self.current = name
            self.order.append(name)
            self.keys[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
            try:
                yield name, tensor
            finally:
                self._observe(name, tensor, before, hot_before)
            self.current = None

    def _observe(self, name: str, tensor: torch.Tensor, before: dict[str, torch.Tensor], hot_before: Any) -> None:
        rec = self.keys[name]
        written: dict[str, int] = {}
        values_ok = True
        for pname, p in self.params.items():
            mask = ~is_sentinel(p.detach())
            n = int(mask.sum())
            if n:
                written[pname] = n
                got = p.detach()[mask]
                k = tensor.numel()
                want = tensor.detach().to(p.dtype).flatten()
                # the checkpoint's elements first, in row-major order; rows SGLang pads (vocab) are zero
                values_ok &= n >= k and torch.equal(got[:k], want) and bool((got[k:] == 0).all())
            with torch.no_grad():
                p.copy_(torch.where(mask, p, before[pname]))
        rec["params"] = written
        rec["values_match"] = bool(values_ok and written)
        rec["hot_token_id"] = getattr(self.model, "hot_token_id", None) is not hot_before


def load_with_sentinel(model: torch.nn.Module, loader: DefaultModelLoader, model_config: ModelConfig
                       ) -> dict[str, Any]:
    unfillable = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not fill_sentinel(t)]
    observed = KeyByKey(model, loader._get_all_weights(model_config, model))
    stream = iter(observed)
    errors = []
    stubs = stub_state()
    while True:
        try:
            DefaultModelLoader.load_weights_and_postprocess(model, stream, CPU)
            break
        except Exception as exc:           # SGLang's start would stop here; go on to report every key
            errors.append({"key": observed.current, "error": error(exc)})
            if observed.current is not None:
                observed.keys[observed.current]["error"] = error(exc)
            if observed.current is None:
                break
    stub_uses = stub_uses_since(stubs)

    unloaded, partial = [], {}
    for pname, p in model.named_parameters():
        left = int(is_sentinel(p.detach()).sum())
        if left == p.numel():
            unloaded.append(pname)
        elif left:
            rows = is_sentinel(p.detach()).reshape(p.shape[0], -1).all(-1).nonzero().flatten().tolist()
            partial[pname] = {"loaded": p.numel() - left, "total": p.numel(), "sentinel_rows": rows}
    buffers = [b for b, t in model.named_buffers() if t.dtype != torch.bool and bool(is_sentinel(t).all())]
    keys = observed.keys
    failed = {e["key"] for e in errors}
    hot = getattr(model, "hot_token_id", None)
    return {
        "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
        "keys": keys,
        "ignored_keys": [k for k in observed.order if not keys[k]["params"] and not keys[k]["hot_token_id"]
                         and k not in failed],
        "load_errors": errors,
        "shape_mismatches": sorted(failed | {k for k in observed.order
                                            if keys[k]["params"] and not keys[k]["values_match"]}),
        "unloaded": unloaded,
        "partial": partial,
        "unfillable": unfillable,
        "buffers_left_sentinel": buffers,
        "hot_token_id": None if hot is None else {"dtype": str(hot.dtype).removeprefix("torch."),
                                                  "shape": list(hot.shape), "values": hot.tolist()},
        "stub_uses_during_load": stub_uses,
    }


# --- one case ----------------------------------------------------------------------------------------

def capture(server_args: ServerArgs) -> dict[str, Any]:
    """The target's capture set-up as ModelRunner does it; which decoder layers capture their input."""
    target_config = ModelConfig.from_server_args(server_args, model_path=get_model().model_path,
                                                 model_revision=get_model().revision, is_draft_model=False)
    aux = resolve_spec_aux_hidden_state_config(
        server_args=server_args, model_config=target_config,
        spec_algorithm=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm),
        is_draft_worker=False)
    target, _ = build(target_config)
    configure_aux_hidden_state_capture(
        model=target, eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
        eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=aux.dflash_use_aux_hidden_state,
        dflash_target_layer_ids=aux.dflash_target_layer_ids, is_dspark=aux.is_dspark)
    inner = target.model
    to_capture = [int(i) for i in inner.layers_to_capture]
    return {
        "target_class": type(target).__name__,
        "eagle_aux_hidden_state_layer_ids": aux.eagle_aux_hidden_state_layer_ids,
        "eagle_use_aux_hidden_state": aux.eagle_use_aux_hidden_state,
        "capture_aux_hidden_states": bool(getattr(target, "capture_aux_hidden_states", False)),
        "layers_to_capture": to_capture,
        # LlamaModel.forward captures the input of layer i for i in layers_to_capture, over the
        # layers this rank runs: an index past the last layer is never captured.
        "captured": [i for i in to_capture if inner.start_layer <= i < inner.end_layer],
        "num_hidden_layers": int(target_config.hf_config.num_hidden_layers),
    }


def publish_argv(target: str, argv: list[str]) -> ServerArgs:
    """A server started as `sglang.launch_server --model-path TARGET ARGV`: SGLang's own parser, then publish."""
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", target, *argv]))
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return args


def judge_server(case: dict[str, Any]) -> dict[str, Any]:
    """A target server without a draft (extraction's aux-capture server): its capture set-up only."""
    verdict: dict[str, Any] = {"errors": {}}
    try:
        verdict["capture"] = capture(publish_argv(case["target"], case["argv"]))
    except Exception as exc:
        verdict["errors"]["capture"] = error(exc)
        verdict["errors"]["capture_traceback"] = traceback.format_exc()[-3000:]
    return verdict



def judge(case: dict[str, Any]) -> dict[str, Any]:
    verdict: dict[str, Any] = {"errors": {}}
    stage = "publish"
    try:
        server_args = publish_case(case["target"], case["draft"], **case.get("server_args", {}))
        stage = "draft_config"
        draft_config = ModelConfig.from_server_args(server_args, model_path=get_spec().speculative_draft_model_path,
                                                    model_revision=get_spec().speculative_draft_model_revision,
                                                    is_draft_model=True)
        verdict["eagle_config"] = getattr(draft_config.hf_config, "eagle_config", None)
        verdict["context_len"] = int(draft_config.context_len)
        stage = "draft_build"
        draft, loader = build(draft_config)
        verdict["model_class"] = type(draft).__name__
        # LlamaForCausalLMEagle3 without a draft_vocab_size: the target's lm_head is loaded in its place
        verdict["load_lm_head_from_target"] = getattr(draft, "load_lm_head_from_target", None)
        verdict["dtype"] = str(draft_config.dtype).removeprefix("torch.")
        stage = "load"
        verdict.update(load_with_sentinel(draft, loader, draft_config))
        del draft

        stage = "capture"
        verdict["capture"] = capture(server_args)
    except Exception as exc:
        verdict["errors"][stage] = error(exc)
        verdict["errors"][f"{stage}_traceback"] = traceback.format_exc()[-3000:]
    return verdict


def main() -> int:
    request = json.load(sys.stdin)
    out: dict[str, Any] = {"version": sglang.__version__, "cases": {}}
    with contextlib.redirect_stdout(sys.stderr):       # SGLang prints; stdout carries only the verdict
        distributed = False
        for case in request["cases"]:
            if not distributed:
                try:
                    publish_case(case["target"], case["draft"])
                    init_distributed()
                except Exception as exc:
                    out["setup_error"] = error(exc) + "\n" + traceback.format_exc()[-3000:]
                    break
                distributed = True
            out["cases"][case["name"]] = judge_server(case) if "argv" in case else judge(case)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
