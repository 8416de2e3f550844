"""crc32c of a concatenation from the crc32c of its parts, without reading the bytes again.

A shard file's checksum covers every byte, and each tensor payload inside it has a
checksum of its own; computing both over the payload would read each byte twice.
``crc32c_combine(crc(A), crc(B), len(B)) == crc(A + B)`` instead costs a few hundred
integer operations. The arithmetic is the one zlib uses for ``crc32_combine``
(multiplication by x^(8n) modulo the polynomial, in reflected bit order), here with the
Castagnoli polynomial; pure Python, no I/O.
"""

from __future__ import annotations

_POLY = 0x82F63B78
"""The Castagnoli polynomial, reflected."""
_ONE = 1 << 31
"""x^0 in reflected bit order."""


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial (both reflected)."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..63."""
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X_POW_2K = _powers()


def _x_pow_8n(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial."""
    result = _ONE
    k = 3  # 8 = 2^3
    while nbytes:
        if nbytes & 1:
            result = _multiply(_X_POW_2K[k], result)
        nbytes >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of A followed by B, given crc32c(A), crc32c(B) and len(B)."""
    if len_b < 0:
        raise ValueError(f"crc32c_combine: negative length {len_b}")
    return _multiply(_x_pow_8n(len_b), crc_a) ^ crc_b
