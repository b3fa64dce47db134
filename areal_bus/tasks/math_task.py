"""The built-in dataset task (``agent.framework: math``): one problem per row of ``agent.dataset``, the
prompt template's text as the user message, the policy's final answer checked exactly against the
row's answer field.

Single-turn (``agent.max_turns: 1``): one answer, reward 1.0 if it is right, else 0.0. Multi-turn
(``max_turns`` > 1): a wrong answer gets the reply "Wrong, try again." and another turn, until the
answer is right or the turns are used up; the reward is 1.0 if the answer was right within
``max_turns`` (binary on purpose, as in guess: it is exactly the held-out accuracy the evaluation
reports, ``eval_accuracy``).

The final answer of a turn (``parse_answer``): the last ``\\boxed{...}``, else what follows the last
"Answer:" / "the answer is" (or "####", GSM8K's marker), else the whole text; of that, the first
number after a marker (the last one of an unmarked text) when the expected answer is a number ("12", "-3", "1,250", "2.50", "7/2"), compared as an exact fraction
(12 == 12.0, 7/2 == 3.5), else the text, compared case- and space-insensitively.

The project generates its own problems (``tasks.arith``: arithmetic word problems with their answers,
written as jsonl): data/math/train.jsonl and eval.jsonl, so the same task is also the dataset path's
demonstration (topology/smollm2-math.yaml).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction

WRONG = "Wrong, try again."

_BOXED = re.compile(r"\\boxed\s*\{")
_MARKER = re.compile(r"(?:answer\s*(?::|=|is\b:?)|####)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces inside it balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]  # unclosed: what there is


def final_span(text: str) -> tuple[str, bool]:
    """(where the final answer is, whether it was marked): the last \\boxed{}, else what follows the
    last 'Answer:' / 'answer is' / '####', else the whole text (unmarked)."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed, True
    marks = list(_MARKER.finditer(text))
    return (text[marks[-1].end():], True) if marks else (text, False)


def to_number(text: str, first: bool = False) -> Fraction | None:
    """The last (or ``first``) number in ``text`` as an exact fraction ("1,250" -> 1250, "7/2" ->
    7/2), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    s = found[0 if first else -1].replace(",", "").replace(" ", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _norm(text: str) -> str:
    return " ".join(str(text).strip().strip(".").lower().split())


def parse_answer(text: str, numeric: bool = True):
    """The final answer in ``text``: a Fraction (``numeric``: the first number after a marker, else
    the last number of the text) or normalised text (the marked span, else the whole text); None if
    there is none."""
    span, marked = final_span(text)
    if numeric:
        return to_number(span, first=marked)
    span = _norm(span.splitlines()[0] if marked and span.strip() else span)
    return span or None


def _as_fraction(answer) -> Fraction | None:
    """An expected answer as an exact number (12, "12", "1,250", 2.5, "7/2"), or None if it is text."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float, str)):
        return None
    try:
        return Fraction(str(answer).strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def check(text: str, expected) -> bool:
    """Whether ``text``'s final answer is exactly ``expected`` (a number or a string)."""
    want = _as_fraction(expected)
    if want is not None:
        return parse_answer(text, numeric=True) == want
    got = parse_answer(text, numeric=False)
    return got is not None and got == _norm(expected)


@dataclass
class MathEpisode:
    """One problem. ``messages`` is the conversation so far; ``step`` plays one answer."""

    expected: object
    max_turns: int
    row: dict | None = None
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    correct: bool = False
    done: bool = False

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        if self.done:
            raise RuntimeError("step() on a finished episode")
        self.messages.append({"role": "assistant", "content": assistant_text})
        self.turns += 1
        if check(assistant_text, self.expected):
            self.correct = self.done = True
            return None, True
        if self.turns >= self.max_turns:
            self.done = True
            return None, True
        self.messages.append({"role": "user", "content": WRONG})
        return WRONG, False

    @property
    def final_text(self) -> str:
        """The policy's last answer (the text of the last assistant turn; "" before the first)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    @property
    def reward(self) -> float:
        """1.0 if answered right within max_turns, else 0.0."""
        return 1.0 if self.correct else 0.0


class MathTask:
    """Problems from ``agent.dataset`` (its prompt template and answer field), answers checked exactly."""

    name = "math"
    max_tokens = 128
    """Tokens per answer unless agent.max_tokens says otherwise: a short worked answer fits."""

    def __init__(self, ctx):
        if ctx.dataset is None:
            raise ValueError("agent.framework 'math' needs agent.dataset (its problems and answers)")
        self.dataset = ctx.dataset
        self.max_turns = ctx.max_turns
        self.system = ctx.options.get("system_prompt")

    def reset(self, seed: int, row: dict | None) -> MathEpisode:
        row = row if row is not None else self.dataset.row(seed)
        ep = MathEpisode(expected=self.dataset.answer(row), max_turns=self.max_turns, row=row)
        if self.system:
            ep.messages.append({"role": "system", "content": str(self.system)})
        ep.messages.append({"role": "user", "content": self.dataset.prompt(row)})
        return ep
