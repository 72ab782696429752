"""Training corpus of the tiny pair: the Python sources the running interpreter ships.

The GPU machine has no internet, so the only text it is sure to have is the Python of its
own standard library and site-packages. This module lists those files, holds out 5% of
them by a hash of their path, trains a byte-level BPE tokenizer with a reserved mask token
and tokenises both splits into flat token arrays (documents separated by the eos token).
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
# Ids 0, 1, 2 in this order: BpeTrainer adds special tokens first.
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)

# Generated tables and vendored bundles are not code worth learning from.
MAX_FILE_BYTES = 256 * 1024
HELDOUT_MODULUS = 20  # 1 file in 20 (5%) is held out


@dataclass
class CorpusConfig:
    """How much of the interpreter's Python to use, and the tokenizer to train on it."""

    vocab_size: int = 8192
    train_bytes: int = 160 * 1024 * 1024
    heldout_bytes: int = 5 * 1024 * 1024
    tokenizer_train_bytes: int = 24 * 1024 * 1024


@dataclass
class SourceFile:
    relpath: str  # relative to its root: the split key, stable across machines
    path: str


def source_roots() -> list[Path]:
    """The stdlib and site-packages folders of the running interpreter, deduplicated."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    roots: list[Path] = []
    for candidate in candidates:
        root = Path(candidate).resolve()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def list_source_files() -> list[SourceFile]:
    """Every ``*.py`` file under the source roots, each real file once."""
    seen: set[str] = set()
    files: list[SourceFile] = []
    for root in source_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                real = os.path.realpath(path)
                if real in seen:
                    continue
                seen.add(real)
                files.append(SourceFile(os.path.relpath(path, root), path))
    return files


def path_hash(relpath: str) -> int:
    return int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "big")


def is_heldout(relpath: str) -> bool:
    return path_hash(relpath) % HELDOUT_MODULUS == 0


def read_split_texts(
    files: list[SourceFile], train_bytes: int, heldout_bytes: int
) -> tuple[list[str], list[str]]:
    """Read files in hash order (a spread over all packages) until both caps are met.

    Identical contents (vendored copies) are kept once, so a held-out file never also
    appears in training.
    """
    train: list[str] = []
    heldout: list[str] = []
    sizes = {"train": 0, "heldout": 0}
    seen_contents: set[bytes] = set()
    for source in sorted(files, key=lambda f: (path_hash(f.relpath), f.relpath)):
        split = "heldout" if is_heldout(source.relpath) else "train"
        cap = heldout_bytes if split == "heldout" else train_bytes
        if sizes[split] >= cap:
            if sizes["train"] >= train_bytes and sizes["heldout"] >= heldout_bytes:
                break
            continue
        try:
            raw = Path(source.path).read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        digest = hashlib.sha1(raw).digest()
        if digest in seen_contents:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        seen_contents.add(digest)
        (heldout if split == "heldout" else train).append(text)
        sizes[split] += len(raw)
    return train, heldout


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) with eos, pad and mask specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, token
    return tokenizer


def tokenize_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one flat uint16 array, each followed by the eos token."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    pieces: list[np.ndarray] = []
    for encoding in encode(texts, add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=np.uint16))
        pieces.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


@dataclass
class CorpusPaths:
    root: Path

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer.json"

    @property
    def train_tokens(self) -> Path:
        return self.root / "train_tokens.npy"

    @property
    def heldout_tokens(self) -> Path:
        return self.root / "heldout_tokens.npy"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


def build_corpus(config: CorpusConfig, out_dir: Path) -> dict:
    """Phase 1: list, split, train the tokenizer, tokenise. Writes the manifest last."""
    assert config.vocab_size < 2**16, "tokens are stored as uint16"
    paths = CorpusPaths(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    files = list_source_files()
    train_texts, heldout_texts = read_split_texts(files, config.train_bytes, config.heldout_bytes)
    read_s = time.monotonic() - start

    sample, sample_bytes = [], 0
    for text in train_texts:
        if sample_bytes >= config.tokenizer_train_bytes:
            break
        sample.append(text)
        sample_bytes += len(text)
    tokenizer = train_tokenizer(sample, config.vocab_size)
    tokenizer.save(str(paths.tokenizer))
    tokenizer_s = time.monotonic() - start - read_s

    train_tokens = tokenize_documents(tokenizer, train_texts)
    heldout_tokens = tokenize_documents(tokenizer, heldout_texts)
    np.save(paths.train_tokens, train_tokens)
    np.save(paths.heldout_tokens, heldout_tokens)
    manifest = {
        "config": asdict(config),
        "roots": [str(r) for r in source_roots()],
        "files_listed": len(files),
        "train_files": len(train_texts),
        "heldout_files": len(heldout_texts),
        "train_chars": sum(map(len, train_texts)),
        "heldout_chars": sum(map(len, heldout_texts)),
        "train_tokens": int(train_tokens.size),
        "heldout_tokens": int(heldout_tokens.size),
        "vocab_size": tokenizer.get_vocab_size(),
        "special_token_ids": {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS},
        "seconds": {
            "read": round(read_s, 1),
            "tokenizer": round(tokenizer_s, 1),
            "tokenize": round(time.monotonic() - start - read_s - tokenizer_s, 1),
        },
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2))
    return manifest
