"""Entropy coding of quantizer symbols: range ANS (``constriction``) with the message's own histogram.

Stream layout (after the quantizer's per-block parameters)::

    2^bits x u16   symbol frequencies, scaled to at most 65,535 (0: the symbol does not occur)
    u32            number of 32-bit ANS words
    words x u32    the ANS stream (constriction's AnsCoder, symbols coded in reverse)

The model is a categorical distribution over the 2^bits codes with probabilities proportional to
the sent frequencies, rebuilt identically by the decoder. From payload format 4 on, kbit and qsgd
put a byte before their codes (formats 1-3: always this stream): 1, this stream follows; 0, the
codes follow packed, as with ``coding='packed'``, where this stream would not be smaller (its
fixed ~40 bytes outweigh what it saves on a few hundred values: 147 against 116 bytes for the
top 1% of a 4,810-parameter MLP). On the top-k values of a dense update coded by 4-bit QSGD
(symbol entropy about 2.2 bits), the stream costs within 1% of the entropy at 25,000 kept values
(table included), against 4 bits packed. ``constriction`` is imported on first use only (cold
start)."""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.errors import DecodeError
from fedcomp.wire import Reader, Writer

_MAX_FREQ = 65535


def _model(freqs: np.ndarray):
    import constriction  # lazy: only codecs with coding='ans' need it

    return constriction.stream.model.Categorical(freqs / freqs.sum(), perfect=False)


def ans_stream(symbols: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(frequencies, ANS words) of ``symbols`` (integers < 2**bits): the stream :func:`put_stream`
    writes, ``stream_bytes`` long."""
    import constriction

    sym = symbols.reshape(-1).cpu().numpy().astype(np.int32)
    counts = np.bincount(sym, minlength=1 << bits).astype(np.float64)
    freqs = np.where(counts > 0, np.maximum(1, np.round(counts * _MAX_FREQ / max(1, sym.size))), 0)
    words = np.empty(0, np.uint32)
    if sym.size:
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(sym, _model(freqs))
        words = coder.get_compressed().astype(np.uint32)
    return freqs, words


def table_bytes(bits: int) -> int:
    """The stream's bytes before its words (frequencies and word count)."""
    return 2 * (1 << bits) + 4


def stream_bytes(freqs: np.ndarray, words: np.ndarray) -> int:
    """The bytes :func:`put_stream` writes."""
    return 2 * freqs.size + 4 + 4 * words.size


def put_stream(freqs: np.ndarray, words: np.ndarray, out: Writer) -> None:
    """Write an :func:`ans_stream` (module docstring's layout)."""
    out.tensor(torch.from_numpy(freqs.astype("<u2")))
    out.u32(words.size)
    out.tensor(torch.from_numpy(words.astype("<u4")))


def ans_read(src: Reader, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`put_stream`: ``count`` symbols as uint8 (bits <= 8); DecodeError if malformed."""
    freqs = src.take(2 * (1 << bits)).numpy().view("<u2").astype(np.float64)
    nwords = src.u32()
    if 4 * nwords > src.remaining:
        raise DecodeError(f"entropy-coded stream claims {nwords} words, {src.remaining} bytes remain")
    words = src.take(4 * nwords).numpy().view("<u4").astype(np.uint32)
    if count == 0:
        if nwords:
            raise DecodeError("entropy-coded stream holds words for zero values")
        return torch.empty(0, dtype=torch.uint8)
    if freqs.sum() == 0:
        raise DecodeError("entropy-coded stream has an empty symbol table")
    import constriction

    try:
        coder = constriction.stream.stack.AnsCoder(words)
        sym = coder.decode(_model(freqs), count)
        leftover = not coder.is_empty()
    except Exception as exc:  # constriction raises its own errors on malformed streams
        raise DecodeError(f"malformed entropy-coded stream: {exc}") from None
    if leftover:
        raise DecodeError("entropy-coded stream has trailing data")
    return torch.from_numpy(np.asarray(sym, dtype=np.uint8))
