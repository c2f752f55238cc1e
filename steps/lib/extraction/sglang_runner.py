"""`extract.backend: sglang_runner`: the target held once by SGLang's own model runner, in this process.

What SpecForge does, written against SGLang 0.5.23's code: every torchrun rank builds one
`ModelRunner` for its tensor-parallel part of the target, with SGLang's capture-only aux mode
(`--enable-return-aux-hidden-states`, no draft). One prefill forward with full hidden capture gives,
in SGLang's `LogitsProcessorOutput`, both
- `hidden_states` `[T, A*H]`: the aux states, packed in ascending layer order (SGLang's model class
  captures the input of each layer `set_eagle3_layers_to_capture` named: internal ids, F4), and
- `last_hidden_states` `[T, H]`: the post-norm final state, which SGLang's logits processor keeps beside
  the aux states under full capture for in-process callers (never sent to a client),
rows in request order, on the GPU. Nothing goes through JSON or another process: the states are encoded on
the device and copied to pinned host memory (`capture.HostCopies`) for the shard writer of
`steps/extract.py`, like `LocalBackend`'s. Under TP every rank runs the same forward (it is collective);
rank 0 broadcasts each batch and keeps the rows (the residual stream and the final norm's output are
replicated over TP ranks), the others `follow()`.

The parts that need no GPU are apart and tested on a CPU inside SGLang's venv
(tests/integration/test_sglang_runner.py): `runner_server_args` (SGLang resolves them, its model class
captures the recorded layers) and `output_rows` (rows from a `LogitsProcessorOutput` into shards).
`SGLangEngine`, which builds the runner and runs a batch, needs CUDA and is untested here (docs/CLUSTER.md).

SGLang is imported only inside `SGLangEngine` and `check_available`: the base install never needs it.
"""

from __future__ import annotations

import importlib.util
import logging
from array import array
from pathlib import Path
from typing import Any

import torch

from steps.lib import layer_ids as layers
from steps.lib.config import ConfigError
from steps.lib.data.shards import encode_states
from steps.lib.extraction.capture import HostCopies, Pending
from steps.lib.runtime import distributed
from steps.lib.serving.launch import available_port

log = logging.getLogger("eaglenest.extract")

#: the SGLang release this backend is written against.
SGLANG_VERSION = "0.5.23"


def check_available() -> None:
    """One line naming the fix when this process cannot run SGLang's model runner (no SGLang, no GPU)."""
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError("extract.backend=sglang_runner needs SGLang in this interpreter, which has none: run "
                          "`torchrun ... -m steps.extract` in the serve image (its /opt/eaglenest/venv sees the base's "
                          f"SGLang {SGLANG_VERSION}) or `pip install sglang=={SGLANG_VERSION}`; or set "
                          "extract.backend=sharded")
    if not torch.cuda.is_available():
        raise ConfigError("extract.backend=sglang_runner needs CUDA GPUs (SGLang's model runner does not run on "
                          "this machine's CPU); run it on the GPU node, or set extract.backend=local / sharded")


def runner_server_args(model_path: str | Path, layer_ids: list[int], *, arch: str | None, tp_size: int,
                       mem_fraction: float | None = None, context_length: int | None = None,
                       trust_remote_code: bool = False) -> dict[str, Any]:
    """The `ServerArgs` fields of a capture-only runner: aux capture of `layer_ids` (internal ids, converted by
    the target family's rule, F4), no draft, no radix cache (a cached prefix has no rows), no chunked prefill
    (its middle chunks return no rows), no CUDA graphs (prefill only; decode graphs would cost memory)."""
    args: dict[str, Any] = {
        "model_path": str(model_path), "tp_size": tp_size, "trust_remote_code": trust_remote_code,
        "enable_return_aux_hidden_states": True, "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": layers.to_engine(list(layer_ids), "sglang", arch),
        "disable_radix_cache": True, "chunked_prefill_size": -1, "disable_cuda_graph": True,
        "skip_tokenizer_init": True,
    }
    if mem_fraction is not None:
        args["mem_fraction_static"] = mem_fraction
    if context_length is not None:
        args["context_length"] = context_length
    return args


def output_rows(out: Any, lengths: list[int], *, num_aux: int, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux `[T, A*H]`, final `[T, H]`) from one prefill's `LogitsProcessorOutput`; T = sum(lengths).

    Refuses, in one line, what would make shards that silently lie: rows missing (a radix-cache hit, a
    chunked prefill, a subset capture), aux rows of the wrong width (fewer layers captured than recorded),
    or no final state (SGLang keeps `last_hidden_states` only with aux capture on and full capture)."""
    tokens = sum(lengths)
    aux, final = out.hidden_states, out.last_hidden_states
    if getattr(out, "hidden_states_token_indices", None) is not None:
        raise ValueError("SGLang captured a subset of the rows (hidden_states_token_indices is set): the runner "
                         "must run with full hidden capture (every request return_hidden_states=True)")
    if aux is None or final is None:
        raise ValueError(f"SGLang's logits output has no {'aux hidden_states' if aux is None else 'last_hidden_states'}"
                         ": the runner needs enable_return_aux_hidden_states and full hidden capture")
    if tuple(final.shape) != (tokens, hidden_size):
        raise ValueError(f"SGLang returned final rows of shape {tuple(final.shape)}, expected [{tokens}, {hidden_size}]"
                         " (one per input token): run with disable_radix_cache and chunked_prefill_size=-1")
    if tuple(aux.shape) != (tokens, num_aux * hidden_size):
        raise ValueError(f"SGLang returned aux rows of shape {tuple(aux.shape)}, expected [{tokens}, "
                         f"{num_aux} × {hidden_size}]: its model class captured other layers than extract records")
    return aux, final


def spans_of(lengths: list[int]) -> list[tuple[int, int]]:
    """Flat rows, sequence k at (start, length): the order SGLang concatenates an extend batch's requests."""
    spans, at = [], 0
    for n in lengths:
        spans.append((at, n))
        at += n
    return spans


class SGLangRunnerBackend:
    """A `CaptureBackend` over an engine whose `forward(batch_input_ids)` returns SGLang's
    `LogitsProcessorOutput` for one prefill of those sequences (`SGLangEngine` on GPUs).

    With a distributed `world` the forward is collective: rank 0 broadcasts each batch, ranks > 0 `follow()`
    until rank 0 `release()`s them (the same protocol as `ShardedBackend`)."""

    def __init__(self, engine: Any, layer_ids: list[int], *, hidden_size: int,
                 world: distributed.World | None = None):
        self.engine, self.layer_ids, self.hidden_size, self.world = engine, list(layer_ids), hidden_size, world
        self.device = torch.device(getattr(engine, "device", "cpu"))
        self._to_host = HostCopies(self.device)

    def _forward(self, batch_input_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        if self.world is not None and self.world.distributed:
            distributed.broadcast_object(self.world, batch_input_ids)
        lengths = [len(s) for s in batch_input_ids]
        out = self.engine.forward(batch_input_ids)
        aux, final = output_rows(out, lengths, num_aux=len(self.layer_ids), hidden_size=self.hidden_size)
        return aux, final, lengths

    @torch.inference_mode()
    def capture(self, batch_input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        aux, final, lengths = self._forward(batch_input_ids)
        aux, final = aux.cpu(), final.cpu()
        return [(aux[a:a + n], final[a:a + n]) for a, n in spans_of(lengths)]

    @torch.inference_mode()
    def capture_async(self, batch_input_ids: list[list[int]], storage_dtype: str) -> Pending:
        aux, final, lengths = self._forward(batch_input_ids)
        return self._to_host.send(encode_states(aux, final, storage_dtype), spans_of(lengths))

    @torch.inference_mode()
    def follow(self) -> int:
        """Ranks > 0: run rank 0's forwards until it releases us; the number of batches run."""
        return distributed.follow_batches(self.world, self.engine.forward)

    def release(self) -> None:
        """Rank 0: no more batches (also after a failure)."""
        if self.world is not None:
            distributed.release_followers(self.world)


class SGLangEngine:
    """SGLang 0.5.23's `ModelRunner` for this rank's part of the target, built as SGLang's own
    `sglang.benchmark.one_batch` builds it (publish → global configs → `load_model`), and one prefill
    (`ScheduleBatch.prepare_for_extend` → `ForwardBatch.init_new` → `ModelRunner.forward`) per batch, its
    KV slots freed after each. Needs CUDA: untested on these machines (docs/CLUSTER.md)."""

    def __init__(self, server_args: dict[str, Any], world: distributed.World):
        from sglang.benchmark import one_batch
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
        from sglang.srt.server_args import ServerArgs

        self._one_batch = one_batch
        args = ServerArgs(**server_args)
        args.resolve_once()
        _set_envs_and_config(args)
        # eaglenest's process group exists already (torchrun): SGLang's init_distributed_environment reuses it,
        # so the port is only a formality; rank 0's is everyone's.
        port = distributed.broadcast_object(world, available_port("127.0.0.1", 0) if world.is_main else None)
        gpu = world.device.index or 0
        publish(args, role="scheduler",
                ranks=SpawnRanks(world_rank=spawn_world_rank(args, tp_rank=world.rank, pp_rank=0), gpu_id=gpu))
        one_batch._init_process_global_configs()
        runner, _ = one_batch.load_model(args, _Ports(port), gpu, world.rank)
        self.bench_runner, self.runner = runner, runner.torch_runner
        self.device = self.runner.device

    @torch.inference_mode()
    def forward(self, batch_input_ids: list[list[int]]) -> Any:
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        ob, runner = self._one_batch, self.runner
        params = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for i, ids in enumerate(batch_input_ids):
            req = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params,
                      return_hidden_states=True)           # full capture: every row, aux and post-norm final
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(ids)
            reqs.append(req)
        cache = ob.TreeCacheNamespace(page_size=get_schedule().page_size, device=runner.device,
                                      token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
        batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                       token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                       tree_cache=cache, model_config=runner.model_config, enable_overlap=False,
                                       spec_algorithm=SpeculativeAlgorithm.NONE)
        try:
            batch.prepare_for_extend()
            ob._maybe_prepare_mlp_sync_batch(batch, runner)
            if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            fb = ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)
            return runner.forward(fb).logits_output
        finally:
            self.bench_runner.clear()                      # the KV slots of this batch: nothing is decoded


class _Ports:
    """The one field of SGLang's PortArgs that `load_model` reads."""

    def __init__(self, nccl_port: int):
        self.nccl_port = nccl_port


def load_runner(target_dir: str | Path, layer_ids: list[int], tcfg: dict[str, Any], world: distributed.World, *,
                mem_fraction: float | None, context_length: int | None,
                trust_remote_code: bool = False) -> SGLangRunnerBackend:
    """Every rank together: SGLang's runner over the world's GPUs (TP = world size), as a backend.
    The caller has run `check_available()` first (steps/extract.py, before any work)."""
    args = runner_server_args(target_dir, layer_ids, arch=layers.target_architecture(tcfg), tp_size=world.size,
                              mem_fraction=mem_fraction, context_length=context_length,
                              trust_remote_code=trust_remote_code)
    engine = SGLangEngine(args, world)
    log.info("extract: SGLang's model runner holds the target over %d GPU(s) (TP=%d), aux layers %s (internal), "
             "one forward for aux and final states", world.size, world.size, layer_ids)
    return SGLangRunnerBackend(engine, layer_ids, hidden_size=int(tcfg["hidden_size"]), world=world)
