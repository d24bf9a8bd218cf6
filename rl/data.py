"""Prompts for the RL loop: built-in tasks or local Hugging Face `datasets`, batched per step.

    src = PromptSource.from_config(cfg.data, seed=cfg.run.seed)
    batch = src.batch(step=3, size=8)   # Batch(prompts=[...], columns={"answer": [...], ...})

Local data: a .json / .jsonl / .parquet file (read with `datasets.load_dataset`; a file that does
not load is refused naming it and, for JSON, the first line that is not JSON) or a folder
written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read with `datasets.load_from_disk`,
the split chosen by `data.split`). `data.columns` maps the roles prompt / answer / data_source to
the dataset's column names; every other column travels with the sample to the reward functions.

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


@dataclass
class Batch:
    prompts: list[str]                 # formatted with data.prompt_template
    columns: dict[str, list[Any]]      # answer, data_source and the dataset's other columns


def _load_hf(path: str, split: str):
    import datasets

    p = Path(path)
    if not p.exists():
        raise DataError(f"data.path: no such file or folder {path!r}")
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise DataError(f"data.path: {path!r} is a folder but not one written by save_to_disk: {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"data.split: expected one of {list(ds)} (the splits in {path!r}), got {split!r}")
            ds = ds[split]
        return ds
    builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
    builder = builders.get(p.suffix.lower())
    if builder is None:
        raise DataError(f"data.path: expected a .json, .jsonl or .parquet file or a save_to_disk folder, "
                        f"got {path!r}")
    try:
        with _quiet("datasets"):  # its own error log line would come before ours, saying less
            return datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - whatever datasets raises, the user gets the file and the line
        where = _first_bad_json_line(p) if builder == "json" else None
        if where is not None:
            raise DataError(f"data.path: {path!r} is not valid JSON at {where}") from None
        cause = e.__cause__ or e  # datasets wraps the reader's error (ArrowInvalid, ...) in a generic one
        raise DataError(f"data.path: {path!r} does not load as a {builder} dataset "
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
                 shuffle: bool = True, origin: str = "data"):
        self.rows = rows
        self.n = len(rows)
        if self.n == 0:
            raise DataError(f"{origin}: the dataset is empty")
        names = list(rows.column_names) if hasattr(rows, "column_names") else list(rows[0])
        for role, col in columns.items():
            if col not in names:
                hint = difflib.get_close_matches(col, names, n=3)
                raise DataError(f"data.columns.{role}: the dataset ({origin}) has no column {col!r}; its columns "
                                f"are {names}" + (f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""))
        self.columns = dict(columns)
        # The dataset's own columns, renamed to their roles; the rest keep their names.
        self._rename = {col: role for role, col in columns.items()}
        clash = [c for c in names if c not in self._rename and c in self._rename.values()]
        if clash:
            raise DataError(f"data.columns: the dataset ({origin}) has column(s) {clash} besides the column(s) "
                            f"mapped to that role; rename or drop them so the role is unambiguous")
        self.template = template
        self.seed = seed
        self.shuffle = shuffle
        self.origin = origin
        self._rows_used = list(range(self.n))  # row index of each position (all rows unless `keep`)
        self.dropped = 0
        self._perm_cache: dict[int, list[int]] = {}

    def prompt_texts(self) -> list[str]:
        """Every row's prompt, formatted with the template (for the length check)."""
        col = self.columns["prompt"]
        values = self.rows[col] if hasattr(self.rows, "column_names") else [r[col] for r in self.rows]
        return [self.template.format(prompt=p) for p in values]

    def keep(self, rows: list[int]) -> None:
        """Use only these rows (ascending row indices) from now on; the per-step batches stay a pure
        function of (seed, step) over the kept rows."""
        if not rows:
            raise DataError(f"data: no prompt of the dataset ({self.origin}) is left to train on")
        self.dropped = self.n - len(rows)
        self._rows_used = list(rows)
        self.n = len(rows)
        self._perm_cache = {}

    @classmethod
    def from_config(cls, data_cfg, seed: int) -> "PromptSource":
        if data_cfg.task is not None:
            from rl.tasks import make_task
            try:
                rows = make_task(data_cfg.task, data_cfg.task_size, seed, **data_cfg.task_kwargs)
            except TypeError as e:
                raise DataError(f"data.task_kwargs: {data_cfg.task_kwargs!r} do not fit task "
                                f"{data_cfg.task!r}: {e}") from e
            origin = f"task {data_cfg.task!r}"
        else:
            rows = _load_hf(data_cfg.path, data_cfg.split)
            origin = repr(data_cfg.path)
        return cls(rows, data_cfg.columns, template=data_cfg.prompt_template, seed=seed,
                   shuffle=data_cfg.shuffle, origin=origin)

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
        prompts = [self.template.format(prompt=p) for p in cols.pop("prompt")]
        return Batch(prompts=prompts, columns=cols)


def apply_chat_template(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt as one user turn, followed by the assistant header (the tokenizer's template)."""
    if tokenizer.chat_template is None:
        raise DataError("data.chat_template: true, but the model's tokenizer has no chat template")
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def check_prompt_lengths(source: PromptSource, tokenizer, limit: int, policy: str, *, chat: bool = False,
                         why: str = "") -> list[int]:
    """Token lengths of every prompt (as vLLM will tokenize it: the tokenizer's special tokens
    included, after the chat template when `chat`); prompts longer than `limit` are dropped
    (policy "drop": `source.keep` the rest) or refused (policy "refuse": DataError naming the first
    such row). Returns the row indices dropped."""
    texts = source.prompt_texts()
    if chat:
        texts = apply_chat_template(tokenizer, texts)
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    long = [i for i, n in enumerate(lengths) if n > limit]
    if long and policy == "refuse":
        i = long[0]
        raise DataError(f"data.long_prompts=refuse: row {i} of the dataset ({source.origin}) is a prompt of "
                        f"{lengths[i]} tokens, more than the {limit} allowed{why}; {len(long)} row(s) are "
                        f"that long (data.long_prompts=drop skips them)")
    if long and len(long) == len(lengths):
        raise DataError(f"data.long_prompts=drop: no prompt of the dataset ({source.origin}) is left to train on: "
                        f"every one is longer than the {limit} tokens allowed{why} (the shortest has {min(lengths)}); "
                        f"raise those limits or shorten the prompts")
    if long:
        source.keep([i for i in range(len(lengths)) if lengths[i] <= limit])
    return long
