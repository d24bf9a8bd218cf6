"""Prompts for the RL loop: built-in tasks or local Hugging Face `datasets`, batched per step.

    src = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
    batch = src.batch(step=3, size=8)   # Batch(prompts=[...], columns={"answer": [...], ...})

Local data: a .json / .jsonl / .parquet file (read with `datasets.load_dataset`; a file that does
not load is refused naming it and, for JSON, the first line that is not JSON) or a folder
written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read with `datasets.load_from_disk`,
the split chosen by `data.split`). `data.columns` maps the roles prompt / answer / data_source to
the dataset's column names, a dotted name reaching into a nested column (verl's
`reward_model.ground_truth`); every other column travels with the sample to the reward functions.

Prompts come in TRL's two forms, decided once for the whole dataset when it loads:
- standard: every `prompt` is a string (data.prompt_template and data.chat_template apply);
- conversational: every `prompt` is a list of chat messages `{"role", "content"}` (TRL's and
  verl's layout); the tokenizer's chat template renders them (`add_generation_prompt=True`), and
  reward functions get the message lists and their completions as `[{"role": "assistant",
  "content": text}]`, as TRL passes them.
Anything else (a dict, a number, a list of non-messages, a message without a known role, an empty
list, or strings mixed with message lists) is refused before anything starts, naming the dataset,
the row and what was expected: a prompt is never turned into its Python repr.

The batch of a step is a pure function of (seed, step): the order is one seeded permutation per
epoch, and step s takes positions [s*P, (s+1)*P) of their concatenation. A resumed run therefore
sees exactly the prompts it would have seen without the interruption, with no sampler state saved.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A dataset that cannot be used as configured; the message names the config key."""


ROLES = ("system", "user", "assistant", "tool", "developer")
"""Message roles a conversational prompt may hold (chat templates know these)."""


@dataclass
class Batch:
    prompts: list                      # str (formatted with data.prompt_template) or a list of messages
    columns: dict[str, list[Any]]      # answer, data_source and the dataset's other columns


def _load_hf(path: str, split: str, prompt_col: str = "prompt", key: str = "data"):
    import datasets

    p = Path(path)
    if not p.exists():
        raise DataError(f"{key}.path: no such file or folder {path!r}")
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise DataError(f"{key}.path: {path!r} is a folder but not one written by save_to_disk: {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{key}.split: expected one of {list(ds)} (the splits in {path!r}), got {split!r}")
            ds = ds[split]
        return ds
    builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
    builder = builders.get(p.suffix.lower())
    if builder is None:
        raise DataError(f"{key}.path: expected a .json, .jsonl or .parquet file or a save_to_disk folder, "
                        f"got {path!r}")
    try:
        with _quiet("datasets"):  # its own error log line would come before ours, saying less
            return datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - whatever datasets raises, the user gets the file and the line
        where = _first_bad_json_line(p) if builder == "json" else None
        if where is not None:
            raise DataError(f"{key}.path: {path!r} is not valid JSON at {where}") from None
        if builder == "json":  # valid JSON that Arrow cannot type: a prompt of another kind in some row
            check_prompts(_json_column(p, prompt_col), repr(path), prompt_col, key=key)
        cause = e.__cause__ or e  # datasets wraps the reader's error (ArrowInvalid, ...) in a generic one
        raise DataError(f"{key}.path: {path!r} does not load as a {builder} dataset "
                        f"({type(cause).__name__}: {cause})") from None


def _first_bad_json_line(path: Path) -> str | None:
    """Where `path` stops being JSON: "line N (...)" of a JSON-lines file, or of a whole-file JSON
    document (a file that starts with '['); None when Python's json reads all of it."""
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                json.load(f)
            except json.JSONDecodeError as e:
                return f"line {e.lineno} column {e.colno} ({e.msg})"
            return None
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n} column {e.colno} ({e.msg}): {line.strip()[:80]!r}"
            if not isinstance(row, dict):
                return f"line {n} (expected a JSON object per line, got {type(row).__name__}): {line.strip()[:80]!r}"
    return None


def _json_column(path: Path, col: str) -> list:
    """Column `col` of a JSON / JSON-lines file read with Python's json (rows without it: None)."""
    import json

    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        rows = json.load(f) if head.startswith("[") else [json.loads(line) for line in f if line.strip()]
    return [r.get(col) if isinstance(r, dict) else None for r in rows]


@contextlib.contextmanager
def _quiet(name: str):
    """The library logger `name` at CRITICAL for the duration of the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class PromptSource:
    """Rows (a list of dicts or a `datasets.Dataset`) + column mapping -> per-step batches."""

    def __init__(self, rows, columns: dict[str, str], *, template: str = "{prompt}", seed: int = 0,
                 shuffle: bool = True, origin: str = "data", key: str = "data"):
        self.rows = rows
        self.n = len(rows)
        if self.n == 0:
            raise DataError(f"{origin}: the dataset is empty")
        names = list(rows.column_names) if hasattr(rows, "column_names") else list(rows[0])
        for role, col in columns.items():
            if "." in col and col not in names and role == "prompt":
                raise DataError(f"{key}.columns.prompt: expected a column of the dataset ({origin}), not a nested "
                                f"field; got {col!r} (its columns are {names})")
            if "." in col and col not in names:  # a nested field (verl's reward_model.ground_truth)
                _nested(rows, col, names, role, origin, key)
                continue
            if col not in names:
                hint = difflib.get_close_matches(col, names, n=3)
                raise DataError(f"{key}.columns.{role}: the dataset ({origin}) has no column {col!r}; its columns "
                                f"are {names}" + (f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""))
        self.columns = dict(columns)
        # The dataset's own columns, renamed to their roles; the rest keep their names. Nested
        # fields are copied out to their role and the column holding them travels as it is.
        self._nested = {role: col for role, col in columns.items() if "." in col and col not in names}
        self._rename = {col: role for role, col in columns.items() if role not in self._nested}
        roles = set(self._rename.values()) | set(self._nested)
        clash = [c for c in names if c not in self._rename and c in roles]
        if clash:
            raise DataError(f"{key}.columns: the dataset ({origin}) has column(s) {clash} besides the column(s) "
                            f"mapped to that role; rename or drop them so the role is unambiguous")
        self.template = template
        self.conversational = check_prompts(self._column(columns["prompt"]), origin, columns["prompt"], key=key)
        if self.conversational and template != "{prompt}":
            raise DataError(f"{key}.prompt_template: the prompts of the dataset ({origin}) are chat messages, "
                            f"which a format string cannot hold; expected '{{prompt}}' (the default), got {template!r}")
        self.seed = seed
        self.shuffle = shuffle
        self.origin = origin
        self.key = key
        self._use = "train on" if key == "data" else "evaluate"  # what the refusals say
        self._rows_used = list(range(self.n))  # row index of each position (all rows unless `keep`)
        self.dropped = 0
        self._perm_cache: dict[int, list[int]] = {}

    def _column(self, col: str) -> list:
        return self.rows[col] if hasattr(self.rows, "column_names") else [r[col] for r in self.rows]

    def prompt_texts(self) -> list:
        """Every row's prompt: a string formatted with the template, or its message list (for the length check)."""
        return [self._prompt(p) for p in self._column(self.columns["prompt"])]

    def _prompt(self, p):
        return _messages(p) if self.conversational else self.template.format(prompt=p)

    def keep(self, rows: list[int]) -> None:
        """Use only these rows (ascending row indices) from now on; the per-step batches stay a pure
        function of (seed, step) over the kept rows."""
        if not rows:
            raise DataError(f"{self.key}: no prompt of the dataset ({self.origin}) is left to {self._use}")
        self.dropped = self.n - len(rows)
        self._rows_used = list(rows)
        self.n = len(rows)
        self._perm_cache = {}

    @classmethod
    def from_config(cls, data_cfg, seed: int, key: str = "data") -> "PromptSource":
        if data_cfg.task is not None:
            from rl.tasks import make_task
            try:
                rows = make_task(data_cfg.task, data_cfg.task_size, seed, **data_cfg.task_kwargs)
            except TypeError as e:
                raise DataError(f"{key}.task_kwargs: {data_cfg.task_kwargs!r} do not fit task "
                                f"{data_cfg.task!r}: {e}") from e
            origin = f"task {data_cfg.task!r}"
        else:
            rows = _load_hf(data_cfg.path, data_cfg.split, data_cfg.columns.get("prompt", "prompt"), key)
            origin = repr(data_cfg.path)
        return cls(rows, data_cfg.columns, template=data_cfg.prompt_template, seed=seed,
                   shuffle=data_cfg.shuffle, origin=origin, key=key)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perm_cache:
            order = list(range(self.n))
            if self.shuffle:
                random.Random(f"data:{self.seed}:{epoch}").shuffle(order)
            self._perm_cache = {epoch: order}
        return self._perm_cache[epoch]

    def indices(self, step: int, size: int) -> list[int]:
        out = []
        for pos in range(step * size, (step + 1) * size):
            out.append(self._perm(pos // self.n)[pos % self.n])
        return out

    def batch(self, step: int, size: int) -> Batch:
        idx = [self._rows_used[i] for i in self.indices(step, size)]
        if hasattr(self.rows, "column_names"):
            raw = self.rows[idx]                       # datasets: a dict of lists
        else:
            raw = {k: [self.rows[i][k] for i in idx] for k in self.rows[0]}
        cols = {self._rename.get(k, k): v for k, v in raw.items()}
        for role, dotted in self._nested.items():
            head, *path = dotted.split(".")
            cols[role] = [_dig(v, path) for v in raw[head]]
        prompts = [self._prompt(p) for p in cols.pop("prompt")]
        return Batch(prompts=prompts, columns=cols)


def _dig(value, path: list[str]):
    for key in path:
        value = value[key]
    return value


def _nested(rows, dotted: str, names: list[str], role: str, origin: str, key: str = "data") -> None:
    """Refuse a dotted column mapping whose field is missing from any row, naming the first such row."""
    head, *path = dotted.split(".")
    if head not in names:
        hint = difflib.get_close_matches(head, names, n=3)
        raise DataError(f"{key}.columns.{role}: the dataset ({origin}) has no column {head!r} (of {dotted!r}); its "
                        f"columns are {names}" + (f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""))
    values = rows[head] if hasattr(rows, "column_names") else [r[head] for r in rows]
    for i, v in enumerate(values):
        try:
            _dig(v, path)
        except (KeyError, TypeError, IndexError):
            raise DataError(f"{key}.columns.{role}: row {i} of the dataset ({origin}) has no field {dotted!r} "
                            f"(its {head!r} is {v!r}); expected every row's {head!r} to hold "
                            f"{'.'.join(path)!r}") from None


def _messages(p: list) -> list[dict]:
    # An Arrow struct column is the union of every row's message keys, the missing ones filled with
    # None; dropping those keys gives back each message as it was written.
    return [{k: v for k, v in m.items() if v is not None} for m in p]


def check_prompts(values: list, origin: str, col: str = "prompt", *, key: str = "data") -> bool:
    """Whether the prompt column is conversational (True) or standard (False); DataError naming the
    dataset, the row and what was expected for anything else (module docstring)."""
    where = f"column {col!r} of the dataset ({origin})"
    kinds = set()
    for i, p in enumerate(values):
        if isinstance(p, str):
            kinds.add("str")
        elif isinstance(p, list):
            _check_conversation(p, i, where, key)
            kinds.add("messages")
        else:
            raise DataError(f"{key}: row {i} of {where} holds a value of type {type(p).__name__} ({str(p)[:80]!r}); expected a "
                            f"prompt string or a list of chat messages {{'role': ..., 'content': ...}}")
        if len(kinds) > 1:
            raise DataError(f"{key}: row {i} of {where} is a {'string' if isinstance(p, str) else 'list of messages'}, "
                            f"but earlier rows are {'lists of messages' if isinstance(p, str) else 'strings'}; "
                            f"expected one form for the whole dataset")
    return kinds == {"messages"}


def _check_conversation(p: list, i: int, where: str, key: str = "data") -> None:
    expected = ("expected a non-empty list of messages, each a mapping with 'role' (one of "
                f"{', '.join(ROLES)}) and 'content' (a string)")
    if not p:
        raise DataError(f"{key}: row {i} of {where} is an empty list; {expected}")
    for j, m in enumerate(p):
        if not isinstance(m, dict):
            raise DataError(f"{key}: row {i} of {where}: message {j} is of type {type(m).__name__} ({str(m)[:60]!r}); "
                            f"{expected}")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise DataError(f"{key}: row {i} of {where}: message {j} has no 'role' ({str(m)[:80]!r}); {expected}")
        if role not in ROLES:
            raise DataError(f"{key}: row {i} of {where}: message {j} has the unknown role {role!r}; {expected}")
        if not isinstance(content, str):
            raise DataError(f"{key}: row {i} of {where}: message {j} ({role}) has content {content!r}; {expected}")


def apply_chat_template(tokenizer, prompts: list, *, strings: bool = True) -> list[str]:
    """What the sampler gets for each prompt: a message list rendered with the tokenizer's chat
    template followed by the assistant header; a string as one user turn the same way when
    `strings` (data.chat_template), else unchanged. The sampler tokenizes the text with the
    tokenizer's special tokens, so a rendered text that opens with the BOS token the tokenizer adds
    by itself (Mixtral's, Llama's templates) loses it here: the token ids are the template's, with
    one BOS, not two."""
    if not any(isinstance(p, list) for p in prompts) and not strings:
        return list(prompts)
    if tokenizer.chat_template is None:
        what = "the prompts are chat messages" if not strings else "data.chat_template: true"
        raise DataError(f"{what}, but the model's tokenizer has no chat template")
    bos = tokenizer.bos_token
    adds_bos = bool(bos) and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]
    out = []
    for p in prompts:
        if isinstance(p, str) and not strings:
            out.append(p)
            continue
        text = tokenizer.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(text[len(bos):] if adds_bos and text.startswith(bos) else text)
    return out


def check_prompt_lengths(source: PromptSource, tokenizer, limit: int, policy: str, *, chat: bool = False,
                         why: str = "") -> list[int]:
    """Token lengths of every prompt (as vLLM will tokenize it: the tokenizer's special tokens
    included, after the chat template for message lists and, when `chat`, for strings); prompts longer than `limit` are dropped
    (policy "drop": `source.keep` the rest) or refused (policy "refuse": DataError naming the first
    such row). Returns the row indices dropped."""
    texts = apply_chat_template(tokenizer, source.prompt_texts(), strings=chat)
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    long = [i for i, n in enumerate(lengths) if n > limit]
    if long and policy == "refuse":
        i = long[0]
        raise DataError(f"{source.key}.long_prompts=refuse: row {i} of the dataset ({source.origin}) is a prompt of "
                        f"{lengths[i]} tokens, more than the {limit} allowed{why}; {len(long)} row(s) are "
                        f"that long (data.long_prompts=drop skips them)")
    if long and len(long) == len(lengths):
        raise DataError(f"{source.key}.long_prompts=drop: no prompt of the dataset ({source.origin}) is left to {source._use}: "
                        f"every one is longer than the {limit} tokens allowed{why} (the shortest has {min(lengths)}); "
                        f"raise those limits or shorten the prompts")
    if long:
        source.keep([i for i in range(len(lengths)) if lengths[i] <= limit])
    return long
