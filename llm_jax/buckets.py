"""The bucket policy: which static lengths jitted functions are compiled for.

Prompt blocks and cache lengths are rounded up to powers of two (never below ``MIN_BUCKET`` and never
above the model's context), so a new prompt length reuses an existing compilation.
"""

from __future__ import annotations

MIN_BUCKET = 16


def bucket(length: int, *, limit: int) -> int:
    """Smallest power of two ≥ ``length`` (and ≥ MIN_BUCKET), capped at ``limit``."""
    if length > limit:
        raise ValueError(f"length {length} exceeds the limit of {limit}")
    size = MIN_BUCKET
    while size < length:
        size *= 2
    return min(size, limit)


def prompt_bucket(longest_prompt: int, *, context: int) -> int:
    """Padded length of a batch of prompts whose longest has ``longest_prompt`` tokens."""
    return bucket(max(longest_prompt, 1), limit=context)


def cache_bucket(longest_prompt: int, max_new_tokens: int, *, context: int) -> int:
    """Cache slots for a generation: room for the prompt block and every new token, within the context."""
    needed = prompt_bucket(longest_prompt, context=context) + max_new_tokens
    return bucket(min(needed, context), limit=context)
