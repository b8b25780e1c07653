"""The benchmark's gpt-fast-style peer computes what the reference decoder computes: same weights,
same logits (float32, CPU) for a prefill and for teacher-forced decode steps through its static cache."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileinfer.engine.kv.block_manager import BlockManager  # noqa: E402
from tileinfer.engine.models.decoder import Decoder  # noqa: E402
from tileinfer.engine.models.random_model import QWEN3_0_6B, QWEN3_4B, TINY, random_weights  # noqa: E402
from tileinfer.engine.runner import ModelRunner  # noqa: E402
from tileinfer.engine.sampling.params import SamplingParams  # noqa: E402
from tileinfer.engine.sequence import Sequence  # noqa: E402
from tileinfer.engine.step import ScheduledRow  # noqa: E402

from bench import limits  # noqa: E402
from bench.peer import PeerModel, compile_greedy_step, greedy_step  # noqa: E402

SPECS = {
    "qwen3-qk-norm-tied": TINY,
    "llama-untied": dataclasses.replace(TINY, family="llama", qk_norm=False, tie_word_embeddings=False),
}


def _reference_logits(spec, weights, token_ids: list[int], num_prompt: int) -> torch.Tensor:
    """Logits [len(token_ids) - num_prompt + 1, vocab] of the reference decoder: a prefill of the
    prompt, then one token at a time through the paged cache."""
    block_size = 4
    num_blocks = -(-len(token_ids) // block_size) + 1
    decoder = Decoder.from_weights(spec, weights, max_positions=64)  # the torch reference ops
    runner = ModelRunner(
        decoder,
        num_blocks,
        block_size,
        torch.float32,
        max_num_seqs=1,
        max_model_len=64,
        graphs=False,
    )
    manager = BlockManager(num_blocks, block_size)
    seq = Sequence("s", token_ids[:num_prompt], SamplingParams())
    manager.allocate(seq)
    logits = [runner.forward_eager([ScheduledRow(seq, num_prompt)])]
    seq.num_computed_tokens = num_prompt
    for token in token_ids[num_prompt:]:
        seq.token_ids.append(token)
        manager.append_slots(seq, 0)
        logits.append(runner.forward_eager([ScheduledRow(seq, 1)]))
        seq.num_computed_tokens += 1
    return torch.cat(logits)


@pytest.mark.parametrize("name", list(SPECS))
def test_peer_logits_equal_reference(name: str) -> None:
    spec = SPECS[name]
    weights = random_weights(spec, torch.float32, "cpu", seed=3)
    for tensor_name, tensor in weights.items():  # norms away from 1, so a missed norm weight shows
        if tensor_name.endswith("norm.weight"):
            tensor.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(tensor_name)))
    num_prompt, num_tokens = 11, 17
    token_ids = torch.randint(0, spec.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(4))
    expected = _reference_logits(spec, weights, token_ids.tolist(), num_prompt)

    peer = PeerModel(spec, weights)
    peer.setup_cache(batch=1, max_len=24)
    with torch.inference_mode():
        got = [peer.prefill(token_ids[None, :num_prompt])]
        for position in range(num_prompt, num_tokens):
            got.append(peer.decode(token_ids[None, position : position + 1], torch.tensor([position])))
    got_logits = torch.cat(got)
    assert got_logits.shape == expected.shape == (num_tokens - num_prompt + 1, spec.vocab_size)
    assert (got_logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert torch.equal(got_logits.argmax(-1), expected.argmax(-1))


def test_compiled_step_equals_eager_step() -> None:
    """The compiled decode step (one graph, no breaks) picks the same tokens as the eager one."""
    weights = random_weights(TINY, torch.float32, "cpu", seed=5)
    peer = PeerModel(TINY, weights)
    compiled = compile_greedy_step(backend="eager")  # dynamo's full-graph capture without codegen
    tokens = {}
    for label, step in (("eager", greedy_step), ("compiled", compiled)):
        peer.setup_cache(batch=1, max_len=32)
        with torch.inference_mode():
            token = peer.prefill(torch.arange(7)[None] * 13).argmax(-1, keepdim=True)
            picked = [token.item()]
            for position in range(7, 12):
                token = step(peer, token, torch.tensor([position]))
                picked.append(token.item())
        tokens[label] = picked
    assert tokens["compiled"] == tokens["eager"]


def test_decode_roofline_bytes_are_bench_md_figures() -> None:
    """BENCH.md: one Qwen3-0.6B token after 1,023 positions reads 1.309 GB, a Qwen3-4B one 8.196 GB;
    at 4.22 TB/s that is 3,222 and 515 tok/s."""
    bytes_06b = limits.decode_bytes_per_token(QWEN3_0_6B, 1023, torch.bfloat16)
    bytes_4b = limits.decode_bytes_per_token(QWEN3_4B, 1023, torch.bfloat16)
    assert round(bytes_06b / 1e9, 3) == 1.309 and round(bytes_4b / 1e9, 3) == 8.196
    assert round(limits.decode_roofline(QWEN3_0_6B, 4.22e12)) == 3223  # BENCH.md rounds 3,222.8 down
    assert round(limits.decode_roofline(QWEN3_4B, 4.22e12)) == 515
