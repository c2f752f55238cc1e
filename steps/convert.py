"""Convert: an EAGLE-3 draft directory between the SGLang/official layout and the speculators (vLLM) layout.

Reads: a draft directory in any layout `steps.lib.layouts.detect_layout` knows (`sglang`: eaglenest's or
SpecForge's `LlamaForCausalLMEagle3` export; `eagle-official`: EAGLE's own `LlamaForCausalLM` +
`midlayer.*` release; `speculators`: `Eagle3Speculator`). Writes: DST, `config.json` +
`model.safetensors` only, in the target engine's exact key set and config (the builders of
`steps/lib/formats/`), then runs the strict checker on it. Prevents F2 (key renames `midlayer.*` ↔
`layers.0.*` done by a table, never left to the loader), F4 (aux layer ids converted through
`steps/lib/layer_ids.py`: SGLang `eagle_config` ids = internal − 1, vLLM top-level ids = internal) and F7
(`LlamaForCausalLMEagle3` / `draft_vocab_size` written explicitly; a yuhuili `LlamaForCausalLM`
release becomes servable by SGLang).

What cannot be converted faithfully is refused with the field and the reason, never dropped:
`norm_before_residual: true` (SGLang's layer 0 keeps the pre-norm residual), `norm_before_fc`,
`fc_norm`, `norm_output`, `bias` (the layouts eaglenest writes have no place for them), multi-layer
or tied-head drafts, unknown weight keys. DST is written into a temporary sibling and renamed at the
end, so a refused or crashed conversion leaves nothing behind.

A missing or null `draft_vocab_size` (F7) is repaired from the weights (the head's rows); keys a loader would
drop (F2) are renamed with `--rename OLD=NEW` (a key prefix; `draft_model.=` strips one), as doctor's fix says.

    eaglenest convert SRC DST --to sglang|vllm [--num-target-layers N] [--verifier NAME] [--rename OLD=NEW ...]
"""

from __future__ import annotations

import argparse
import json
import sys

from steps.lib import formats
from steps.lib.checks.strict import FormatError
from steps.lib.errors import InputError
from steps.lib.home import local_path
from steps.lib.layouts import ConvertError, convert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eaglenest convert", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a draft directory (SGLang, EAGLE official or speculators layout)")
    ap.add_argument("dst", help="the directory to write (must not exist)")
    ap.add_argument("--to", required=True, choices=formats.ENGINES)
    ap.add_argument("--num-target-layers", type=int, default=None,
                    help="the target's num_hidden_layers, when the source records no aux layer ids")
    ap.add_argument("--verifier", default=None, help="target name or path for speculators_config (--to vllm)")
    ap.add_argument("--speculative-tokens", type=int, default=3)
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="rename weight keys starting with OLD (repeatable; `decoder.=midlayer.`, `draft_model.=`)")
    args = ap.parse_args(argv)
    if any("=" not in r for r in args.rename):
        print(f"eaglenest convert: --rename {args.rename}: each is OLD=NEW (a key prefix and its new spelling)",
              file=sys.stderr)
        return 2
    try:
        out = convert(local_path(args.src), local_path(args.dst), args.to, num_target_layers=args.num_target_layers,
                      verifier=args.verifier, speculative_tokens=args.speculative_tokens,
                      renames=[tuple(r.split("=", 1)) for r in args.rename])
    except (ConvertError, FormatError, InputError, OSError) as err:     # bad input: one line, exit 2
        print(f"eaglenest convert: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    before = json.loads((local_path(args.src) / formats.CONFIG_FILE).read_text()).get("draft_vocab_size")
    if before is None:
        after = json.loads((out / formats.CONFIG_FILE).read_text())["draft_vocab_size"]
        print(f"draft_vocab_size: {before} in {args.src} → {after} (the rows of lm_head.weight)", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
