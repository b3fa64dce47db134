"""Arithmetic word problems the project generates itself, with their exact answers: the data of the
built-in ``math`` task (no data hub). Each row is ``{"question", "answer", "kind"}``; ``kind`` is one
of add, sub, mul, div, two_step. Deterministic in the seed; train and eval rows never share a question.

Write the jsonl files the topologies read (data/math/ ships with the repo; this rebuilds it exactly):

    .venv/bin/python -m areal_bus.tasks.arith --out data/math --train 2000 --eval 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Ana", "Sam", "Lena", "Ravi", "Mia", "Omar", "Yuki", "Ben", "Zoe"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps"]


def problem(rng: random.Random) -> dict:
    """One word problem and its answer (small whole numbers: a 135M model can learn these)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "div", "two_step"])
    if kind == "add":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        q, ans = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    elif kind == "sub":
        a = rng.randint(5, 40)
        b = rng.randint(1, a - 1)
        q, ans = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q, ans = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that in total?", a * b
    elif kind == "div":
        b, ans = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} shares {ans * b} {item} equally among {b} friends. How many {item} does each friend get?"
    else:
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        q = f"{name} has {a} {item}, finds {b} more and then loses {c}. How many {item} does {name} have?"
        ans = a + b - c
    return {"question": q, "answer": ans, "kind": kind}


def generate(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows): ``n_train + n_eval`` distinct questions, the eval ones held out."""
    rng = random.Random(seed)
    seen, rows = set(), []
    tries = 0
    while len(rows) < n_train + n_eval:
        tries += 1
        if tries > 100 * (n_train + n_eval):
            raise ValueError(f"cannot make {n_train + n_eval} distinct problems (got {len(rows)})")
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write(out: str | Path, n_train: int = 2000, n_eval: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out``/train.jsonl and ``out``/eval.jsonl; returns their paths."""
    train, held_out = generate(n_train, n_eval, seed)
    return write_jsonl(train, Path(out) / "train.jsonl"), write_jsonl(held_out, Path(out) / "eval.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/math", help="folder for train.jsonl and eval.jsonl")
    ap.add_argument("--train", type=int, default=2000, help="training problems")
    ap.add_argument("--eval", type=int, default=200, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for p in write(args.out, args.train, args.eval, args.seed):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
