"""Synthetic, learnable token data for the examples and the benchmark."""

from __future__ import annotations

import torch

__all__ = ["SyntheticTokens"]


class SyntheticTokens:
    """Seeded, learnable token streams: the same rule on every rank, a batch per (step, rank).

    ``used`` token ids (a random subset of the vocabulary) are in play; each sequence starts
    at a random one and follows a fixed random successor permutation ("token a is followed by
    token b"), except that a ``noise`` fraction of positions is drawn at random. A model first
    learns which ids occur, then the permutation, so the loss falls quickly and comparably.
    """

    def __init__(self, vocab_size: int, seed: int, used: int = 128, noise: float = 0.1) -> None:
        gen = torch.Generator().manual_seed(seed)
        n_used = max(1, min(vocab_size, used))
        self.token_ids = torch.randperm(vocab_size, generator=gen)[:n_used]
        self.successor = torch.randperm(n_used, generator=gen)
        self.noise = noise
        self.seed = seed

    def batch(self, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Token ids of shape (batch_size, seq_len) on the CPU, fixed by (seed, step, rank)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + rank)
        n_used = len(self.token_ids)
        random_index = torch.randint(0, n_used, (batch_size, seq_len), generator=gen)
        is_noise = torch.rand(batch_size, seq_len, generator=gen) < self.noise
        index = random_index.clone()
        for t in range(1, seq_len):
            follow = self.successor[index[:, t - 1]]
            index[:, t] = torch.where(is_noise[:, t], random_index[:, t], follow)
        return self.token_ids[index]
