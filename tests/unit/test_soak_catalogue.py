"""The soak's fitting prompts come under their limit whatever the seed draws (seeds
8675309 and 4242 stopped the soak before it sent anything, "the quiet cluster refused fitting
prompts {992: 400}"). The server here is a rule: SGLang's answer to a prompt over its limit is
a 400, and a word's cost in tokens differs from word to word, as the sandbox tokenizer's does."""

from __future__ import annotations

from sglang_hardened.operations.filler import WORDS, filler
from sglang_hardened.operations.oracle import Reply
from sglang_hardened.sandbox.soak.catalogue import FIT_TRIES, Prompt, _fitted

LIMIT = 1000


def cost(text: str) -> int:
    return sum(1 + len(word) // 5 for word in text.split())  # "water", "light", "house", "river": 2


def server(asked: list[str]):
    def send(text: str, max_new_tokens: int) -> Reply:
        asked.append(text)
        if cost(text) + max_new_tokens > LIMIT:
            return Reply(400, None, '{"error": "too long"}', 0.0)
        return Reply(200, (1,) * max_new_tokens, "{}", 0.0)
    return send


def test_a_draw_of_dear_words_is_trimmed_from_its_end_until_it_fits():
    per_word = sum(map(cost, WORDS)) / len(WORDS)  # what calibration measures: the average
    dear = next(seed for seed in map(str, range(1000))
                if cost(filler(per_word, LIMIT - 32, seed)) + 16 > LIMIT)  # a seed like 8675309
    drawn = Prompt(filler(per_word, LIMIT - 32, dear), LIMIT - 32, 16)
    asked: list[str] = []
    fitted, reply = _fitted(drawn, server(asked), per_word)
    assert reply.status == 200 and cost(fitted.text) + 16 <= LIMIT
    assert drawn.text.startswith(fitted.text) and len(asked) <= FIT_TRIES  # the same draw, cut short
    assert cost(fitted.text) + 16 > LIMIT - 3 * 16  # still near the limit it was drawn for


def test_a_prompt_that_fits_is_asked_once_and_kept():
    asked: list[str] = []
    drawn = Prompt(" the key", 2, 4)
    assert _fitted(drawn, server(asked), 1.0) == (drawn, Reply(200, (1,) * 4, "{}", 0.0)) and asked == [" the key"]
