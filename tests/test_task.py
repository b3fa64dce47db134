"""The guess-the-number task and the project tokenizer: rules, reward, parsing, token bookkeeping."""

import pytest

from areal_bus.tasks import (
    EVAL_SEED_BASE,
    GuessTask,
    eval_seeds,
    make_task,
    render_assistant_turn,
    render_env_turn,
    render_prefix,
)
from areal_bus.tasks.guess import bisect_guess, parse_guess, secret_for
from areal_bus.model.tokenizer import IM_END, build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """Loaded the way every node loads it: AutoTokenizer on a folder that also holds a qwen2 config
    (transformers then picks the tokenizer class from the model type, not from tokenizer.json)."""
    from transformers import AutoTokenizer, Qwen2Config

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def seed_with_secret(secret: int, n: int = 16) -> int:
    return next(s for s in range(10_000) if secret_for(s, n) == secret)


def test_tokenizer_loads_with_autotokenizer_and_is_small(tok):
    assert len(tok) < 128
    assert tok.eos_token == IM_END
    text = "Guess 12!\nhigher, lower."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_is_chatml_with_generation_prompt(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "8"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n")
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")


def test_same_seed_same_secret_and_secret_in_range():
    task = GuessTask()
    assert task.reset(7).secret == task.reset(7).secret
    assert {task.reset(s).secret for s in range(500)} == set(range(1, 17))


def test_feedback_says_higher_lower_and_correct_ends_with_reward_one():
    task = GuessTask()
    ep = task.reset(seed_with_secret(11))
    assert ep.messages[0]["role"] == "user" and "16" in ep.messages[0]["content"]
    assert ep.step("4") == ("higher (5-16)", False)
    assert ep.step("13") == ("lower (5-12)", False)
    assert ep.reward == 0.0
    assert ep.step("11") == (None, True)
    assert ep.done and ep.turns == 3 and ep.reward == 1.0
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_out_of_turns_ends_with_reward_zero():
    ep = GuessTask(max_turns=5).reset(seed_with_secret(16))
    for guess in "1234":
        assert ep.step(guess) == (f"higher ({int(guess) + 1}-16)", False)
    assert ep.step("5") == (None, True)
    assert ep.reward == 0.0 and ep.turns == 5
    with pytest.raises(RuntimeError):
        ep.step("16")


def test_unparseable_guess_is_a_wasted_turn():
    ep = GuessTask().reset(seed_with_secret(3))
    assert ep.step("no idea") == ("invalid (1-16)", False)
    assert ep.turns == 1 and not ep.done
    assert ep.step("3") == (None, True) and ep.reward == 1.0


@pytest.mark.parametrize("text,guess", [("8", 8), (" 12 ", 12), ("My guess: 5.", 5), ("from 1 to 9", 9),
                                        ("", None), ("eight", None)])
def test_parse_guess_takes_the_last_number(text, guess):
    assert parse_guess(text) == guess


def test_binary_search_always_wins():
    task = GuessTask()
    for seed in eval_seeds(64):
        ep = task.reset(seed)
        while not ep.done:
            ep.step(bisect_guess(ep))
        assert ep.reward == 1.0 and ep.turns <= 5


def test_eval_seeds_are_held_out_fixed_and_cover_secrets_evenly():
    seeds = eval_seeds(64)
    assert seeds == eval_seeds(64) and len(set(seeds)) == 64
    assert min(seeds) >= EVAL_SEED_BASE
    secrets = [secret_for(s, 16) for s in seeds]
    assert all(secrets.count(k) == 4 for k in range(1, 17))


def test_make_task_by_name():
    assert isinstance(make_task("guess", n=8, max_turns=4), GuessTask)
    with pytest.raises(ValueError):
        make_task("chess")


def play_tokens(tok, task, seed, player=bisect_guess):
    """Play a game the way the agent does: prefix, then sampled ids (here: a player's text + eos),
    then env ids; returns the episode, the ids, and the generated-token count."""
    ep = task.reset(seed)
    ids = render_prefix(tok, ep)
    generated = 0
    while True:
        text = player(ep)
        sampled = render_assistant_turn(tok, text)
        ids += sampled
        generated += len(sampled)
        reply, done = ep.step(text)
        if done:
            return ep, ids, generated
        ids += render_env_turn(tok, reply)
        # The no-re-tokenisation guarantee: the appended ids are exactly the template's tokenisation.
        expected = tok.apply_chat_template(ep.messages, tokenize=False, add_generation_prompt=True)
        assert ids == tok.encode(expected, add_special_tokens=False)


def test_prefix_plus_sampled_plus_env_ids_equal_the_chat_template(tok):
    task = GuessTask()
    for seed in eval_seeds(16):
        ep, ids, _ = play_tokens(tok, task, seed)
        full = tok.apply_chat_template(ep.messages, tokenize=False)
        # The full conversation ends "<|im_end|>\n"; the sampler stops at the eos before that newline.
        assert ids == tok.encode(full, add_special_tokens=False)[:-1]
        assert ids[-1] == tok.eos_token_id


def test_env_turn_ids_close_the_turn_and_open_the_next_assistant_turn(tok):
    ids = render_env_turn(tok, "higher (9-16)")
    assert tok.decode(ids) == "\n<|im_start|>user\nhigher (9-16)<|im_end|>\n<|im_start|>assistant\n"


def test_longest_episode_generates_at_least_5x_the_shortest(tok):
    task = GuessTask()
    _, _, shortest = play_tokens(tok, task, seed_with_secret(8))   # midpoint first guess is right
    _, _, longest = play_tokens(tok, task, seed_with_secret(16))   # binary search needs all 5 turns
    blind, _, scanned = play_tokens(tok, task, seed_with_secret(16), player=lambda ep: str(ep.turns + 1))
    assert blind.turns == 5 and blind.reward == 0.0
    assert longest >= 5 * shortest and scanned >= 5 * shortest
