"""A verify step's drafts: where the packed input ids take the draft ring's drafts, what the step read
there, and the check of every row's drafts against the target's logits (greedy rows all at once, sampled
ones by rejection sampling in engine/sampling/sampler.py; the rules are engine/spec_decode/verification.py's).
"""

from __future__ import annotations

import torch
from tileinfer.engine.sampling.sampler import Sampler
from tileinfer.engine.spec_decode.proposer_interface import DeviceDrafts, DraftsRead
from tileinfer.engine.spec_decode.verification import verify_greedy
from tileinfer.engine.step import ScheduledRow


def read_ring(rows: list[ScheduledRow], ring: DeviceDrafts, device: torch.device) -> DraftsRead | None:
    """The step's read of the ring: each ring row's drafts go to its last num_drafts packed tokens."""
    token_rows: list[int] = []
    slots: list[tuple[int, int]] = []
    end = 0
    for row in rows:
        end += row.num_tokens
        if row.ring_row is not None:
            token_rows += range(end - row.num_drafts, end)
            slots += [(row.ring_row, j) for j in range(row.num_drafts)]
    if not token_rows:
        return None
    return ring.read(token_rows, slots, device)


def ring_drafts_read(rows: list[ScheduledRow], ring_read: DraftsRead | None) -> list[list[int]]:
    """After the forward pass: the drafts each ring row's step used, as many as the proposer wrote (the
    rest were padding)."""
    used, lengths = ring_read.finish() if ring_read is not None else ([], {})
    read: list[list[int]] = []
    offset = 0
    for row in rows:
        if row.ring_row is not None:
            read.append(used[offset : offset + row.num_drafts][: lengths[row.ring_row]])
            offset += row.num_drafts
    return read


def verify_rows(
    sampler: Sampler, logits: torch.Tensor, rows: list[tuple[ScheduledRow, int, list[int]]]
) -> list[tuple[list[int], int]]:
    """Each (row, its first logits row, its drafts)'s verification: (accepted drafts + the target's own
    next token, number accepted). A row's logits are its 1 + row.num_drafts rows from the first; a ring row
    may hold fewer drafts than that (the proposer wrote fewer)."""
    results: list[tuple[list[int], int] | None] = [None] * len(rows)
    greedy: list[int] = []
    for index, (row, first, drafts) in enumerate(rows):
        if row.seq.params.is_greedy:
            greedy.append(index)
        else:
            results[index] = sampler.verify(row.seq, logits[first : first + 1 + row.num_drafts], drafts)
    if greedy:
        verified = _verify_greedy([(rows[index][1], rows[index][2]) for index in greedy], logits)
        for index, result in zip(greedy, verified, strict=True):
            results[index] = result
    return results


def _verify_greedy(rows: list[tuple[int, list[int]]], logits: torch.Tensor) -> list[tuple[list[int], int]]:
    """All greedy rows (first logits row, drafts) at once, drafts padded to the longest. One argmax on the
    device and one read back; the drafts are on the host, so the comparison runs there (a few ops on
    [rows] ints, where on a GPU it cost three copies up and a dozen tiny kernels)."""
    k_max = max(len(drafts) for _, drafts in rows)
    logit_rows = [[first + min(j, len(drafts)) for j in range(k_max + 1)] for first, drafts in rows]
    targets = logits.argmax(dim=-1).cpu()[torch.tensor(logit_rows, dtype=torch.int64)]
    padded = [drafts + [-1] * (k_max - len(drafts)) for _, drafts in rows]
    verified = verify_greedy(
        targets,
        torch.tensor(padded, dtype=torch.int64),
        torch.tensor([len(drafts) for _, drafts in rows]),
    )
    emitted, accepted = verified.output_token_ids.tolist(), verified.num_accepted.tolist()
    return [(tokens[: count + 1], count) for tokens, count in zip(emitted, accepted, strict=True)]
