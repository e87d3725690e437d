"""A real byte-level BPE tokenizer trained on text shipped with the package, plus a chat template."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>", "<|video|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(vocab_size: int, out_dir: Path, model_max_length: int):
    """Train on ``assets/tokenizer_corpus.txt``; write tokenizer files into ``out_dir``; return the tokenizer.

    ``model_max_length`` must be set like a released tokenizer's: transformers' default (1e30) does not
    fit in 64 bits, and SGLang's ``/v1/tokenize`` returns it (as ``max_model_len``), failing with HTTP 500.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = resources.files("sglang_m3").joinpath("assets/tokenizer_corpus.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    fast.save_pretrained(out_dir)
    return fast
