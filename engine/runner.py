"""Runs one step of the model: owns the KV cache, builds the step's inputs, returns logits.

This is the reference (eager) runner; the GPU runner with static buffers and CUDA graphs
keeps the same interface.
"""

from __future__ import annotations

import torch

from engine.block_manager import BlockCopy
from engine.model import Decoder
from engine.scheduler import ScheduledSequence
from kernels.attention import AttentionMetadata


class ModelRunner:
    def __init__(self, decoder: Decoder, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        spec = decoder.spec
        self.decoder = decoder
        self.block_size = block_size
        self.device = decoder.model.embed_tokens.weight.device
        # [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
            dtype=dtype, device=self.device,
        )  # fmt: skip

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        for copy in copies:
            self.kv_cache[:, :, copy.dst_block, : copy.num_slots] = self.kv_cache[
                :, :, copy.src_block, : copy.num_slots
            ]

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Compute the scheduled tokens; return float32 logits [num_rows, vocab_size], one row for
        each sequence whose tokens are all computed after this step (in scheduled order)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slot_mapping += [
                table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)
            ]
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if end == seq.num_tokens:
                logit_rows.append(query_start_loc[-1] - 1)
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        block_tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
        for row, item in enumerate(scheduled):
            block_tables[row, : len(item.seq.block_table)] = torch.tensor(item.seq.block_table)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables.to(device),
        )
        hidden = self.decoder(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_cache,
            metadata,
        )
        return self.decoder.compute_logits(hidden[torch.tensor(logit_rows, device=device)])
