"""Warm start (SFT) of the project's embedded default model: a tiny Qwen2 that plays guess-the-number.

No model or data set is downloaded: this module builds the tokenizer (``areal_bus.model.tokenizer``),
generates demonstration games with ``areal_bus.tasks.guess``, trains ``transformers``'
``Qwen2ForCausalLM`` from scratch on the assistant tokens only, and saves model + tokenizer in HF format
(safetensors), loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

The warm start is deliberately imperfect so that RL has room to show. The demonstrations come from a
"sloppy player" who at every turn picks one of four moves:
  - scan   (most often): the lowest number still possible, i.e. linear search up from the bottom;
  - bisect (often):      the midpoint of the numbers still possible, the optimal move;
  - random (sometimes):  any number still possible;
  - blind  (rarely):     any number 1..n, ignoring the feedback.
Scan is the most frequent move in every position, so the greedy policy the model learns is roughly
linear search, which wins only when the secret is among the first ``max_turns`` numbers (5/16 on the
default game). Bisect is in the model's distribution at every turn, so sampled rollouts already win
often (about 0.6); RL has to move each position's mode from scan to bisect, which lifts the greedy solve
rate towards 1.0.

Idempotent: the output folder carries ``recipe.json`` with a hash of the recipe; a folder whose hash
matches is left as it is. About 1-2 minutes on 2 CPU cores (300 steps of 32 games, then a 64-game
greedy eval); deterministic for a given recipe and thread count.

    python scripts/warmstart.py --out models/tiny-guess
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from areal_bus.tasks.guess import (
    Episode,
    GuessTask,
    eval_seeds,
    render_assistant_turn,
    render_env_turn,
    render_prefix,
)
from areal_bus.model.tokenizer import build_tokenizer

RECIPE_FILE = "recipe.json"
RECIPE_VERSION = 1
"""Bump when the code changes what a recipe produces, so folders built by older code are rebuilt."""


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the warm-started model; its hash names the build."""

    n: int = 16
    """Secrets are drawn from 1..n."""
    max_turns: int = 5
    """Guesses per game."""
    p_scan: float = 0.50
    """Per-turn probability of the sloppy move (lowest still-possible number); the greedy policy's mode."""
    p_bisect: float = 0.35
    """Per-turn probability of the optimal move (midpoint of the still-possible numbers)."""
    p_random: float = 0.10
    """Per-turn probability of a uniform guess among the still-possible numbers."""
    p_blind: float = 0.05
    """Per-turn probability of a uniform guess in 1..n ignoring the feedback (a wasted turn, mostly)."""
    hidden_size: int = 128
    """Model width. With 2 layers the model has ~0.3M parameters: about 0.2 s per SFT step of 32 games
    on 2 cores, and fast enough to sample on CPU during RL."""
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    steps: int = 300
    """Optimizer steps; every step sees fresh demonstration games (no epoch, no overfitting)."""
    batch_size: int = 32
    """Games per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    """Seeds torch (weights) and, offset per game, the demonstration player."""
    threads: int = 2
    """torch CPU threads: the project's machines have 2 shared cores."""

    def hash(self) -> str:
        # The task's own wording goes in too, so editing the prompt rebuilds the model that learned it.
        prompt = GuessTask(n=self.n, max_turns=self.max_turns).prompt()
        blob = json.dumps({"version": RECIPE_VERSION, "prompt": prompt, **dataclasses.asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sloppy_guess(ep: Episode, recipe: Recipe, rng: random.Random) -> str:
    """One move of the demonstration player (see the module docstring)."""
    u = rng.random() * (recipe.p_scan + recipe.p_bisect + recipe.p_random + recipe.p_blind)
    if u < recipe.p_scan:
        return str(ep.lo)
    u -= recipe.p_scan
    if u < recipe.p_bisect:
        return str((ep.lo + ep.hi) // 2)
    u -= recipe.p_bisect
    if u < recipe.p_random:
        return str(rng.randint(ep.lo, ep.hi))
    return str(rng.randint(1, ep.n))


def demo_tokens(tokenizer, task: GuessTask, seed: int, recipe: Recipe) -> tuple[list[int], list[int]]:
    """One demonstration game as (ids, loss mask): mask 1 on the assistant's tokens (incl. its eos),
    0 on prompt and environment tokens. Built with the agent's own token helpers, so SFT sees the very
    layout that rollouts produce."""
    rng = random.Random(seed * 7919 + recipe.seed)
    ep = task.reset(seed)
    ids = render_prefix(tokenizer, ep)
    mask = [0] * len(ids)
    while True:
        text = sloppy_guess(ep, recipe, rng)
        turn = render_assistant_turn(tokenizer, text)
        ids += turn
        mask += [1] * len(turn)
        reply, done = ep.step(text)
        if done:
            return ids, mask
        env = render_env_turn(tokenizer, reply)
        ids += env
        mask += [0] * len(env)


def _batch(tokenizer, task, recipe: Recipe, step: int):
    import torch

    # Game seeds step * batch + i: far below EVAL_SEED_BASE, so no held-out game is ever demonstrated.
    rows = [demo_tokens(tokenizer, task, step * recipe.batch_size + i, recipe) for i in range(recipe.batch_size)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, mask) in enumerate(rows):
        # Right padding keeps positions starting at 0, as in single-sequence generation.
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        labels[r, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    return input_ids, attention, labels


def make_model(recipe: Recipe, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def train(recipe: Recipe, out: Path, log=print) -> dict:
    """SFT from scratch into ``out`` (model + tokenizer + recipe.json). Returns the stats it recorded."""
    import torch

    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    t0 = time.monotonic()
    tokenizer = build_tokenizer(out)
    task = GuessTask(n=recipe.n, max_turns=recipe.max_turns)
    model = make_model(recipe, tokenizer)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                            weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        frac = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    loss_val = float("nan")
    for step in range(recipe.steps):
        input_ids, attention, labels = _batch(tokenizer, task, recipe, step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = loss.item()
        if step % 50 == 0 or step == recipe.steps - 1:
            log(f"[warmstart] step={step} loss={loss_val:.4f} elapsed={time.monotonic() - t0:.1f}s")

    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(out), safe_serialization=True)
    return {"final_loss": round(loss_val, 4), "train_seconds": round(time.monotonic() - t0, 1),
            "params": sum(p.numel() for p in model.parameters())}


def is_built(out: str | Path, recipe: Recipe = Recipe()) -> bool:
    """Whether ``out`` holds a complete model built from ``recipe``."""
    out = Path(out)
    try:
        meta = json.loads((out / RECIPE_FILE).read_text())
    except (OSError, ValueError):  # missing or half-written: not built
        return False
    return (meta.get("hash") == recipe.hash() and (out / "model.safetensors").exists()
            and (out / "tokenizer.json").exists())


def warmstart(out: str | Path, recipe: Recipe = Recipe(), eval_games: int = 64, log=print) -> Path:
    """Build the warm-started model into ``out`` unless it is already there for this recipe.

    Builds into a sibling temp folder and renames it into place, so a crash or a concurrent reader
    never sees half a model. An existing ``out`` is replaced only if it is one of ours (has
    recipe.json) or empty, never an unrelated folder."""
    out = Path(out)
    if is_built(out, recipe):
        log(f"[warmstart] {out} already built for recipe {recipe.hash()}; nothing to do")
        return out
    if out.exists() and any(out.iterdir()) and not (out / RECIPE_FILE).exists():
        raise FileExistsError(f"{out} exists and is not a warm-start folder (no {RECIPE_FILE}); "
                              "pick another --out or remove it")
    tmp = out.with_name(out.name + f".tmp-{recipe.hash()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    stats = train(recipe, tmp, log=log)
    if eval_games:
        task = GuessTask(n=recipe.n, max_turns=recipe.max_turns)
        stats["eval_games"] = eval_games
        stats["eval_greedy_reward"] = round(evaluate(tmp, eval_seeds(eval_games, recipe.n), task=task), 4)
        log(f"[warmstart] greedy eval reward on {eval_games} held-out games: {stats['eval_greedy_reward']:.3f}")
    stats["total_seconds"] = round(time.monotonic() - t0, 1)
    meta = {"hash": recipe.hash(), "version": RECIPE_VERSION, "recipe": dataclasses.asdict(recipe),
            "stats": stats}
    (tmp / RECIPE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"[warmstart] wrote {out} in {stats['total_seconds']:.1f}s")
    return out


def play(model, tokenizer, task: GuessTask, seed: int, greedy: bool = True, max_new_tokens: int = 8) -> Episode:
    """Play one game with plain HF ``generate``, keeping the sampled ids as they are between turns."""
    import torch

    ep = task.reset(seed)
    ids = render_prefix(tokenizer, ep)
    eos = tokenizer.eos_token_id
    # The saved generation config sets no top-k/top-p, so sampling is from the full distribution.
    sample_kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0}
    while True:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **sample_kw)
        sampled = out[0, len(ids):].tolist()
        if eos in sampled:
            sampled = sampled[: sampled.index(eos) + 1]
        else:  # ran out of tokens: close the turn as the chat template would
            sampled.append(eos)
        reply, done = ep.step(tokenizer.decode(sampled, skip_special_tokens=True))
        if done:
            return ep
        ids += sampled + render_env_turn(tokenizer, reply)


def evaluate(model_path: str | Path, seeds: list[int], greedy: bool = True, task: GuessTask | None = None,
             sample_seed: int = 0) -> float:
    """Mean reward of the model at ``model_path`` over the games ``seeds`` (greedy by default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    model.eval()
    task = task or GuessTask()
    torch.manual_seed(sample_seed)
    return sum(play(model, tokenizer, task, s, greedy).reward for s in seeds) / len(seeds)

