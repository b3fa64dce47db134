"""The built-in dataset task (agent.framework: math): the exact answer checker, single- and multi-turn
episodes, the generated problems, and token bookkeeping through a real chat template (the project's
character tokenizer; SmolLM2's BPE one in the smollm2 test below)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from areal_bus.wire.messages import Completion
from areal_bus.tasks import arith
from areal_bus.tasks.driver import EVAL_SEED_BASE, TaskDriver, render_assistant_turn, render_prefix
from areal_bus.tasks.math_task import WRONG, MathTask, check, parse_answer
from areal_bus.config.topology import DatasetConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny-guess"


@pytest.mark.parametrize("text, expected", [
    ("12 + 7 = 19. Answer: 19", 19),
    ("The answer is 42.", 42),
    ("so \\boxed{19} and then 3 more words 4", 19),
    ("Answer: 19\n\nHope that helps! 2 more questions?", 19),
    ("#### 1,250", 1250),
    ("I think 5, no wait, 6", 6),
    ("7/2", 3.5),
    ("Answer: 2.50", "2.5"),
    ("It is -3", -3),
    ("Answer: Paris.\nThe capital.", "paris"),
])
def test_the_final_answer_is_found_and_checked_exactly(text, expected):
    assert check(text, expected)


@pytest.mark.parametrize("text, expected", [
    ("Answer: 18", 19),
    ("no number here", 3),
    ("Answer: 19 but \\boxed{20}", 19),  # the boxed answer is the final one
    ("19.5", 19),
    ("Answer: Lyon", "Paris"),
])
def test_a_wrong_or_missing_answer_is_not_accepted(text, expected):
    assert not check(text, expected)


def test_parse_answer_returns_an_exact_fraction():
    assert parse_answer("so 0.1 + 0.2 = 0.3") == parse_answer("Answer: 3/10")


class _Rows:
    """Stands in for DatasetSplits where the tests need only rows (its own tests: tests/test_dataset.py)."""

    def __init__(self, rows, template="{question}"):
        self.rows, self.template = rows, template
        self.train_size, self.eval_size = len(rows), len(rows)

    def row(self, seed):
        return self.rows[seed % len(self.rows)]

    def prompt(self, row):
        return self.template.format_map(row)

    def answer(self, row):
        return row["answer"]


def _task(max_turns=1, rows=None, **options):
    from areal_bus.tasks.driver import TaskContext

    rows = rows or [{"question": "What is 12 + 7?", "answer": 19}]
    return MathTask(TaskContext(tokenizer=None, max_turns=max_turns, dataset=_Rows(rows), options=options))


def test_single_turn_right_answer_rewards_one_and_ends():
    ep = _task().reset(0, None)
    assert ep.messages == [{"role": "user", "content": "What is 12 + 7?"}]
    assert ep.step("12 + 7 = 19") == (None, True)
    assert ep.correct and ep.reward == 1.0


def test_single_turn_wrong_answer_rewards_zero_and_ends():
    ep = _task().reset(0, None)
    assert ep.step("18") == (None, True)
    assert not ep.correct and ep.reward == 0.0


def test_multi_turn_says_wrong_try_again_and_a_later_right_answer_counts():
    ep = _task(max_turns=3, system_prompt="Be brief.").reset(0, None)
    assert ep.messages[0] == {"role": "system", "content": "Be brief."}
    assert ep.step("18") == (WRONG, False)
    assert ep.messages[-1] == {"role": "user", "content": WRONG}
    assert ep.step("Answer: 19") == (None, True)
    assert ep.reward == 1.0 and ep.turns == 2 and ep.final_text == "Answer: 19"


def test_multi_turn_out_of_turns_rewards_zero():
    ep = _task(max_turns=2).reset(0, None)
    assert ep.step("1") == (WRONG, False)
    assert ep.step("2") == (None, True)
    assert ep.reward == 0.0


def test_math_needs_a_dataset():
    from areal_bus.tasks.driver import TaskContext

    with pytest.raises(ValueError, match="agent.dataset"):
        MathTask(TaskContext(tokenizer=None))


def test_generated_problems_are_deterministic_distinct_and_their_answers_right():
    train, held_out = arith.generate(300, 50, seed=3)
    assert (train, held_out) == arith.generate(300, 50, seed=3)
    questions = [r["question"] for r in train + held_out]
    assert len(set(questions)) == len(questions)  # no held-out question is a training one
    assert {r["kind"] for r in train} == {"add", "sub", "mul", "div", "two_step"}
    for r in train + held_out:
        nums = [int(x) for x in __import__("re").findall(r"\d+", r["question"])]
        a, b = nums[0], nums[1]
        want = {"add": a + b, "sub": a - b, "mul": a * b, "div": a // b}.get(r["kind"])
        if r["kind"] == "two_step":
            want = a + b - nums[2]
        assert r["answer"] == want and r["answer"] >= 0, r


def test_the_shipped_data_is_what_the_generator_writes(tmp_path):
    train, held_out = arith.write(tmp_path)
    assert train.read_text() == (ROOT / "data" / "math" / "train.jsonl").read_text()
    assert held_out.read_text() == (ROOT / "data" / "math" / "eval.jsonl").read_text()
    assert json.loads(held_out.read_text().splitlines()[0]).keys() == {"question", "answer", "kind"}


def _play_tokens(tok, task, seed, turns):
    """Play ``turns`` through the driver as the agent does (ids appended, never re-tokenised); return
    the ids and the episode."""
    driver = TaskDriver(task, tok, name="math")
    ep, ids, _ = driver.start(np.random.default_rng(0), 0, seed=seed)
    ids = list(ids)
    for text in turns:
        sampled = render_assistant_turn(tok, text)
        comp = Completion(request_id="r", episode_id="e", ticket=0, worker="w", output_ids=np.asarray(sampled, np.int32),
                          logprobs=np.zeros(len(sampled), np.float32), versions=np.zeros(len(sampled), np.int32))
        env, done, _ = driver.advance(ep, None, comp)
        ids += sampled + ([] if done else list(env))
    return ids, ep


def _assert_token_exact(tok):
    task = _task(max_turns=3, rows=[{"question": "Mia has 7 coins and gets 5 more. How many coins?", "answer": 12}])
    ids, ep = _play_tokens(tok, task, 0, ["It is 11.", "Answer: 12"])
    assert ep.correct and ep.turns == 2 and [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant"]
    whole = tok.apply_chat_template(ep.messages, tokenize=False)
    assert ids == tok.encode(whole, add_special_tokens=False)[:len(ids)]
    # ...and the ids end exactly where the conversation's last assistant turn ends (its eos).
    assert tok.decode(ids).endswith("Answer: 12" + tok.eos_token)
    assert render_prefix(tok, ep.messages[:1]) == ids[:len(render_prefix(tok, ep.messages[:1]))]


def test_multi_turn_ids_are_the_chat_template_of_the_conversation_with_the_project_tokenizer():
    from areal_bus.tasks.runner import load_tokenizer

    _assert_token_exact(load_tokenizer(TINY))


def test_multi_turn_ids_are_the_chat_template_of_the_conversation_with_smollm2(smollm2_dir):
    from areal_bus.tasks.runner import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    assert "im_start" in tok.chat_template  # the model's own template, not the project's fallback
    _assert_token_exact(tok)
    # The prompt is rendered through SmolLM2's template (its default system prompt included).
    task = _task(rows=[{"question": "What is 12 + 7?", "answer": 19}])
    text = tok.decode(render_prefix(tok, task.reset(0, None)))
    assert text == tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                           add_generation_prompt=True)


def test_a_tokenizer_without_a_chat_template_gets_the_project_chatml(tmp_path):
    from transformers import AutoTokenizer

    from areal_bus.tasks.runner import load_tokenizer
    from areal_bus.model.tokenizer import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(TINY))
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path))
    for f in ("chat_template.jinja",):
        (tmp_path / f).unlink(missing_ok=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text((TINY / "config.json").read_text())
    assert load_tokenizer(tmp_path).chat_template == CHAT_TEMPLATE


def test_eval_seeds_are_the_eval_split_rows_and_training_seeds_walk_the_train_split():
    rows = [{"question": f"q{i}", "answer": i} for i in range(5)]

    class Splits(_Rows):
        def row(self, seed):
            return self.rows[seed - EVAL_SEED_BASE] if seed >= EVAL_SEED_BASE else self.rows[seed]

    from areal_bus.tasks.driver import TaskContext

    splits = Splits(rows)
    splits.eval_size = 3

    task = MathTask(TaskContext(tokenizer=None, dataset=splits))

    class Tok:
        eos_token_id = 0

    driver = TaskDriver(task, Tok(), name="math", dataset=splits)
    assert driver.eval_seeds(64) == [EVAL_SEED_BASE, EVAL_SEED_BASE + 1, EVAL_SEED_BASE + 2]
    rng = np.random.default_rng(1)
    seeds = [driver.new_seed(rng) for _ in range(10)]
    assert sorted(seeds[:5]) == [0, 1, 2, 3, 4] and seeds[5:] == seeds[:5]  # every row once per epoch
    assert driver.max_tokens == MathTask.max_tokens
    assert DatasetConfig(path="x.jsonl").answer_field == "answer"
