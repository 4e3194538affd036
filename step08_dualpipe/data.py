"""Byte-level training data that is already on every machine.

Default corpus: the Python standard library's own source files, read from the
running interpreter in sorted order, so no download is ever needed. `--data PATH`
takes any text file instead. Tokens are raw bytes (vocabulary 256).

Batches are a pure function of (seed, step): every rank that needs the batch
(the first stage for inputs, the last stage for targets) draws the same one
without any communication.
"""
import sysconfig
from pathlib import Path

import torch

DEFAULT_CORPUS_BYTES = 4_000_000  # enough text for a course run, quick to read


def stdlib_text(limit: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """Concatenate the top-level .py files of the standard library, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunk = path.read_bytes()
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py source files in {stdlib}: pass --data PATH to train on a text file")
    return b"".join(chunks)[:limit]


def load_tokens(path=None) -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values."""
    raw = Path(path).read_bytes() if path else stdlib_text()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def get_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int):
    """The global batch of one optimizer step: inputs and next-token targets, [batch, seq_len].

    Rows start at random offsets drawn from a generator seeded by (seed, step).
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    rows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]
