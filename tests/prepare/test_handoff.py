"""The shared arena that carries a remote SRC's bytes from the parent to its forked workers."""

from __future__ import annotations

import os
import random

import pytest

from pipeline.prepare.handoff import ALIGN, Arena, Handoff


def test_bytes_put_in_the_arena_are_what_a_forked_child_takes() -> None:
    arena = Arena(1 << 20)
    try:
        pieces = [os.urandom(size) for size in (1, 63, 64, 65, 4096, 100_000)]
        handoffs = [arena.put(piece) for piece in pieces]
        assert all(isinstance(h, Handoff) for h in handoffs)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # what a pool worker does: it sees the parent's mapping, as it was at the fork and after
            ok = all(arena.take(h) == p for h, p in zip(handoffs, pieces) if h is not None)
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.waitpid(child, 0)
        os.close(read)
    finally:
        arena.close()


def test_a_full_arena_says_so_and_takes_bytes_again_once_ranges_are_freed() -> None:
    arena = Arena(16 * ALIGN)
    try:
        first = arena.put(b"a" * (8 * ALIGN))
        second = arena.put(b"b" * (8 * ALIGN))
        assert first is not None and second is not None
        assert arena.put(b"c") is None  # full: the caller sends these bytes through the pipe
        assert arena.put(b"d" * (17 * ALIGN)) is None  # larger than the whole arena
        arena.free(first)
        assert arena.put(b"e" * (9 * ALIGN)) is None  # 8 free, not 9
        again = arena.put(b"f" * (8 * ALIGN))
        assert again is not None and arena.take(again) == b"f" * (8 * ALIGN) and arena.take(second) == b"b" * (8 * ALIGN)
    finally:
        arena.close()


def test_freed_ranges_join_whatever_the_order_and_a_double_free_is_refused() -> None:
    arena = Arena(1 << 16)
    try:
        rng = random.Random(7)
        held = [arena.put(bytes(rng.randrange(1, 3000))) for _ in range(40)]
        assert all(h is not None for h in held)
        rng.shuffle(held)
        for handoff in held:
            assert handoff is not None
            arena.free(handoff)
        assert arena.free_bytes() == arena.size
        whole = arena.put(b"x" * arena.size)  # one range again: every free range joined its neighbours
        assert whole is not None and whole.offset == 0
        arena.free(whole)
        with pytest.raises(ValueError, match="free already"):
            arena.free(whole)
    finally:
        arena.close()
