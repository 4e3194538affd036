"""Byte-level training data that is already on every machine.

Default corpus: the Python standard library's own source files, read from the
running interpreter in sorted order, so no download is ever needed. `--data PATH`
takes any text file instead. Tokens are raw bytes (vocabulary 256).

Batches are a pure function of (seed, step): every rank that needs the batch
(the first stage for inputs, the last stage for targets) draws the same one
without any communication. That holds only if every rank reads the same text:
nodes with different Python releases have different standard libraries. So the
ranks compare a checksum of their tokens once, at start-up (check_same_corpus).
"""
import os
import socket
import sys
import sysconfig
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

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


def corpus_mismatch(tokens: torch.Tensor, data_flag):
    """None if every rank holds the same tokens, else the line that says which nodes differ and the cure.
    Each rank shares (checksum of its tokens, its host name): one small all-gather at start-up."""
    mine = (zlib.crc32(tokens.to(torch.uint8).numpy().tobytes()), socket.gethostname())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    hosts = {}  # checksum -> the hosts whose ranks hold it
    for checksum, host in everyone:
        hosts.setdefault(checksum, set()).add(host)
    if len(hosts) == 1:
        return None
    seen = "; ".join(f"{', '.join(sorted(h))}: checksum {c:08x}" for c, h in sorted(hosts.items()))
    cure = ("give every node the same file" if data_flag else
            "install one Python release on every node (the default corpus is its standard library), or pass --data")
    return f"the ranks read different corpora ({seen}): {cure}"


def check_same_corpus(tokens: torch.Tensor, data_flag):
    """End every rank with exit code 2 and one line from rank 0 if the ranks' corpora differ, before any
    step: the first stage would draw inputs, and the last stage targets, from two different texts."""
    line = corpus_mismatch(tokens, data_flag)
    if line is None:
        return
    if dist.get_rank() == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    dist.barrier()  # every rank found the same mismatch: all leave together, after rank 0 has spoken
    os._exit(2)  # as distributed.shutdown: no teardown


def get_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int):
    """The global batch of one optimizer step: inputs and next-token targets, [batch, seq_len].

    Rows start at random offsets drawn from a generator seeded by (seed, step).
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    rows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]
