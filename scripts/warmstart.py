"""Build the embedded default model: SFT a tiny Qwen2 on synthetic guess-the-number games.

Does nothing if the folder already holds a model built from the same recipe. About a minute on 2 idle
CPU cores (the recipe and its stats end up in <out>/recipe.json).

    python scripts/warmstart.py --out models/tiny-guess
"""

import argparse

from areal_bus.launch.warmstart import Recipe, warmstart


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/tiny-guess", help="output folder (HF format)")
    ap.add_argument("--eval-games", type=int, default=64, help="held-out games for the greedy eval; 0 skips it")
    ap.add_argument("--steps", type=int, default=Recipe.steps, help="SFT steps (changes the recipe hash)")
    args = ap.parse_args()
    warmstart(args.out, Recipe(steps=args.steps), eval_games=args.eval_games)


if __name__ == "__main__":
    main()
