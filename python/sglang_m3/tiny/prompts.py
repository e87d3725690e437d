"""The prompts the tiny draft is distilled on, memorises and is measured on (the tests' probe prompts).

Probe prompts: the prompts the tests and the acceptance benchmark speculate on. The draft is trained on the
target's greedy continuation of each (memorised: the tiny target is random, nothing else transfers). The
training prompts and the held-out prompts come from the GSM8K-style problems of the shipped tokenizer corpus.
"""

from __future__ import annotations

from importlib import resources

import torch

from ..bench.gsm8k import build_messages  # pure python: no sglang, no torch, no bench extra

TRAIN_PROMPT_LEN = 20  # tokens per training prompt
HELD_OUT = 8  # the last problems of the corpus are never trained on


def _corpus_text() -> str:
    return resources.files("sglang_m3").joinpath("assets/tokenizer_corpus.txt").read_text(encoding="utf-8")


def _problems() -> list[tuple[str, str]]:
    """(question, answer) pairs of the GSM8K problems in the tokenizer corpus."""
    body = "\n".join(line for line in _corpus_text().splitlines() if not line.startswith("#"))
    out = []
    for block in body.split("\n\n"):
        lines = [line for line in block.strip().splitlines() if line]
        if lines:
            out.append((lines[0], "\n".join(lines[1:])))
    return out


def chat_prompt(tokenizer, question: str | list[dict]) -> list[int]:
    """Token ids of a chat (one user turn, or a message list) with the generation prompt, as SGLang's
    ``/v1/tokenize`` renders it: the chat template to text, then encoded without extra special tokens."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


# The first GSM8K *test* questions (openai/grade-school-math test.jsonl, lines 1-8), verbatim: the acceptance
# bench's default prompts. Kept here so a build needs no dataset (test_tiny_draft checks them against the file).
GSM8K_TEST_HEAD = (
    "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
    "How much in dollars does she make every day at the farmers' market?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
    "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in repairs.  "
    "This increased the value of the house by 150%.  How much profit did he make?",
    "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters does "
    "he run a week?",
    "Every day, Wendi feeds each of her chickens three cups of mixed chicken feed, containing seeds, mealworms and "
    "vegetables to help keep them healthy.  She gives the chickens their feed in three separate meals. In the "
    "morning, she gives her flock of chickens 15 cups of feed.  In the afternoon, she gives her chickens another "
    "25 cups of feed.  How many cups of feed does she need to give her chickens in the final meal of the day if "
    "the size of Wendi's flock is 20 chickens?",
    "Kylar went to the store to buy glasses for his new apartment. One glass costs $5, but every second glass "
    "costs only 60% of the price. Kylar wants to buy 16 glasses. How much does he need to pay for them?",
    "Toulouse has twice as many sheep as Charleston. Charleston has 4 times as many sheep as Seattle. How many "
    "sheep do Toulouse, Charleston, and Seattle have together if Seattle has 20 sheep?",
    "Carla is downloading a 200 GB file. Normally she can download 2 GB/minute, but 40% of the way through the "
    "download, Windows forces a restart to install updates, which takes 20 minutes. Then Carla has to restart "
    "the download from the beginning. How load does it take to download the file?",
)


def corpus_ids(tokenizer) -> list[int]:
    """The shipped tokenizer corpus as one token stream (the e2e tests' ``corpus_ids`` fixture)."""
    return tokenizer(_corpus_text()).input_ids


def corpus_prompts(ids: list[int]) -> list[list[int]]:
    """The e2e tests' prompts cut from :func:`corpus_ids`. Mixed lengths: below the sparse threshold
    (block 16 x top-4 = 64) and well past it."""
    return [ids[:9], ids[100:150], ids[300:500], ids[700:1017]]


def gsm8k_prompts(tokenizer, count: int = len(GSM8K_TEST_HEAD)) -> list[list[int]]:
    """The acceptance bench's default prompts: GSM8K test questions, zero-shot (``build_messages(q, [])``), chat
    template with the generation prompt and no ``chat_template_kwargs`` (the bench sends none by default)."""
    return [chat_prompt(tokenizer, build_messages(q, [])) for q in GSM8K_TEST_HEAD[:count]]


def probe_prompts(tokenizer) -> list[list[int]]:
    """Every prompt the draft memorises the target's continuation of: the e2e corpus prompts, then GSM8K."""
    return corpus_prompts(corpus_ids(tokenizer)) + gsm8k_prompts(tokenizer)


def held_out_prompts(tokenizer, count: int = 4) -> list[list[int]]:
    """Chat prompts from corpus problems the draft never trained on."""
    return [chat_prompt(tokenizer, q) for q, _ in _problems()[-HELD_OUT:][:count]]


def training_prompts(tokenizer) -> torch.Tensor:
    """[S, TRAIN_PROMPT_LEN]: per training problem, the tail of its chat prompt and the head of its answer text."""
    rows = []
    for question, answer in _problems()[:-HELD_OUT]:
        chat = chat_prompt(tokenizer, question)
        plain = tokenizer(answer).input_ids
        if len(chat) >= TRAIN_PROMPT_LEN:
            rows.append(chat[-TRAIN_PROMPT_LEN:])
        if len(plain) >= TRAIN_PROMPT_LEN:
            rows.append(plain[:TRAIN_PROMPT_LEN])
    return torch.tensor(rows)
