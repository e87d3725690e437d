"""A tokenizer's vocabulary read from its ``tokenizer.json``, for random token-id prompts.

The serving benchmark sends prompts as token ids so that the prompt length a user asks for is the
one the server sees (as SGLang's ``bench_serving`` does with random ids). Drawing them needs only
the set of ids: the ``tokenizer.json`` model vocabulary less its added tokens (special and control
tokens such as image placeholders or end-of-turn, which would change what the server does). Plain
JSON: no ``transformers``, no ``torch``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .client import BenchError


def local_tokenizer_file(spec: str | None) -> Path | None:
    """``spec`` itself when it is a file, ``spec/tokenizer.json`` when that exists, else None."""
    if not spec:
        return None
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    return None


def hub_tokenizer_file(repo_id: str) -> Path | None:
    """``tokenizer.json`` of a Hugging Face model id (cached or downloaded), or None when unavailable."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    try:
        return Path(hf_hub_download(repo_id, "tokenizer.json"))
    except Exception:  # offline, unknown repo, no tokenizer.json: the caller names what it tried
        return None


def vocab_ids(path: Path) -> list[int]:
    """Sorted ids of the model vocabulary of ``tokenizer.json`` at ``path``, without its added tokens."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        # BPE / WordPiece / WordLevel: {token: id}; Unigram: [[piece, score], ...] with id = index.
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids -= {int(t["id"]) for t in data.get("added_tokens") or []}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BenchError(f"{path}: not a tokenizer.json with a model vocabulary ({type(exc).__name__}: {exc})") from exc
    if not ids:
        raise BenchError(f"{path}: the vocabulary holds no token outside the added (special) tokens")
    return sorted(ids)
