"""``agent.dataset``: a user's problems from a local jsonl or parquet file, through the ``datasets``
library, split into train and held-out rows, and the prompt template that turns a row into the user
message.

Only local files are read: ``load_dataset("json" | "parquet", data_files=...)`` uses the builders
that ship inside ``datasets``, so nothing is fetched from a hub (the nodes never reach one).

    agent:
      dataset:
        path: data/math/train.jsonl          # .jsonl / .json / .parquet
        eval_path: data/math/eval.jsonl      # or eval_fraction: 0.1 of path, split with shuffle_seed
        prompt_template: "{question}"        # str.format over the row's fields ({{ }} for a brace)
        answer_field: answer
        shuffle_seed: 0

Seeds name rows (tasks.driver): seed i < EVAL_SEED_BASE is row i of the shuffled train split,
EVAL_SEED_BASE + i row i of the eval split, so a trajectory's seed is all the reward node needs to
find its row again.
"""

from __future__ import annotations

import string
from pathlib import Path

from areal_bus.tasks.driver import EVAL_SEED_BASE

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the agent.dataset field and the file."""


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template reads ("{question} ({unit})" -> ["question", "unit"])."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise DatasetError(f"agent.dataset.prompt_template: not a valid template ({err}); write a row's "
                           f"field as {{name}} and a literal brace as {{{{ or }}}}") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name or not name.isidentifier():
            raise DatasetError(f"agent.dataset.prompt_template: {{{name}}} is not a field name; write a row's "
                               f"field as {{name}} and a literal brace as {{{{ or }}}}")
        fields.append(name)
    return fields


def _load(field: str, path: Path):
    if not path.is_file():
        raise DatasetError(f"{field}: no such file {path} (relative paths are relative to the "
                           f"supervisord.conf's folder)")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DatasetError(f"{field}: {path} is neither jsonl nor parquet (name it *.jsonl, *.json or *.parquet)")
    import datasets

    datasets.disable_progress_bars()  # node logs are read by people: no progress bars in them
    try:
        return datasets.load_dataset(fmt, data_files={"train": str(path)}, split="train")
    except Exception as err:  # the builders raise many types for a malformed file; name the file
        raise DatasetError(f"{field}: cannot read {path} as {fmt}: {' '.join(str(err).split())[:300]}") from None


class DatasetSplits:
    """The train and eval rows of one ``agent.dataset`` (a DatasetConfig), loaded and checked."""

    def __init__(self, cfg, base: Path | None = None, answer_required: bool = True):
        def resolve(p: str) -> Path:
            p = Path(p)
            return p if p.is_absolute() else (base or Path.cwd()) / p

        self.cfg = cfg
        full = _load("agent.dataset.path", resolve(cfg.path))
        if cfg.eval_path:
            train, held_out = full, _load("agent.dataset.eval_path", resolve(cfg.eval_path))
        else:
            if len(full) < 2:
                raise DatasetError(f"agent.dataset.path: {resolve(cfg.path)} has {len(full)} row(s): too few "
                                   f"to split off an eval set (give agent.dataset.eval_path)")
            parts = full.train_test_split(test_size=cfg.eval_fraction, seed=cfg.shuffle_seed)
            train, held_out = parts["train"], parts["test"]
        self.train = train.shuffle(seed=cfg.shuffle_seed).flatten_indices()
        self.eval = held_out
        if len(self.train) == 0 or len(self.eval) == 0:
            raise DatasetError(f"agent.dataset: the train split has {len(self.train)} rows and the eval split "
                               f"{len(self.eval)}: both need at least one")
        for split, name in ((self.train, "path"), (self.eval, "eval_path" if cfg.eval_path else "path")):
            columns = set(split.column_names)
            where = resolve(getattr(cfg, name))
            for f in template_fields(cfg.prompt_template):
                if f not in columns:
                    raise DatasetError(f"agent.dataset.prompt_template: field {f!r} is not a column of {where} "
                                       f"(columns: {', '.join(sorted(columns))})")
            if answer_required and cfg.answer_field not in columns:
                raise DatasetError(f"agent.dataset.answer_field: {cfg.answer_field!r} is not a column of {where} "
                                   f"(columns: {', '.join(sorted(columns))})")

    @property
    def train_size(self) -> int:
        return len(self.train)

    @property
    def eval_size(self) -> int:
        return len(self.eval)

    def row(self, seed: int) -> dict:
        """The row a seed names (train row ``seed``, or eval row ``seed - EVAL_SEED_BASE``)."""
        split, i = (self.eval, seed - EVAL_SEED_BASE) if seed >= EVAL_SEED_BASE else (self.train, seed)
        if not 0 <= i < len(split):
            raise ValueError(f"seed {seed} names no row (train rows: {len(self.train)}, eval rows: {len(self.eval)})")
        return split[int(i)]

    def prompt(self, row: dict) -> str:
        """The user message of a row: the prompt template filled with the row's fields."""
        return self.cfg.prompt_template.format_map(row)

    def answer(self, row: dict):
        return row[self.cfg.answer_field]
