"""Build the proposer an EngineConfig names: in the engine's process (the CLI, an app with
proposer_in_process, build_engine) or in the proposer actor (deployments/replicas/proposer_actor.py).
"""

from __future__ import annotations

from tileinfer.engine.config import PROPOSERS, EngineConfig, check_one_of
from tileinfer.engine.engine import Engine
from tileinfer.engine.errors import InvalidRequestError
from tileinfer.engine.models.loader import LoadedModel, load_model
from tileinfer.engine.spec_decode.proposer_interface import Proposer
from tileinfer.engine.spec_decode.speculator import DEFAULT_DRAFT_COST

# One more draft in a verify step that runs anyway: a token more in a graph bucket that holds it already.
# Also the cost of a proposer that drafts ahead on a GPU of its own.
VERIFY_COST_PER_DRAFT = 0.02


def self_draft_layers(config: EngineConfig, target_num_layers: int) -> int:
    """The target's first layers a self-draft runs: draft_layers, by default a quarter of them."""
    return config.draft_layers or max(1, target_num_layers // 4)


def draft_cost(config: EngineConfig, target_num_layers: int) -> float:
    """What one more draft costs, as a share of a plain decode step (DraftLengthController.draft_cost):
    n-gram and DFlash propose a block for about nothing, a self-draft runs its layers once a draft."""
    if config.proposer in ("ngram", "dflash"):
        return VERIFY_COST_PER_DRAFT
    if config.proposer == "draft" and config.draft_model is None:
        return self_draft_layers(config, target_num_layers) / target_num_layers + VERIFY_COST_PER_DRAFT
    return DEFAULT_DRAFT_COST


def build_proposer(config: EngineConfig, target: LoadedModel) -> Proposer:
    """ngram: prompt lookup. draft: config.draft_model, or without one the target's first
    config.draft_layers layers (self-draft). dflash: the DFlash checkpoint folder config.draft_model,
    using the target's embedding and LM head."""
    name = config.proposer
    check_one_of("proposer", name, PROPOSERS)
    if name == "ngram":
        from tileinfer.proposers.ngram import NgramProposer

        return NgramProposer()
    draft_config = EngineConfig(
        device=config.device, dtype=config.dtype, block_size=config.block_size,
        max_model_len=config.max_model_len or target.spec.max_position_embeddings,
        kv_cache_tokens=config.kv_cache_tokens, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, cuda_graphs=config.cuda_graphs,
    )  # fmt: skip
    if name == "draft":
        from tileinfer.proposers.draft_model import DraftModelProposer

        if config.draft_model is None:
            layers = self_draft_layers(config, target.spec.num_layers)
            return DraftModelProposer.self_draft(target, layers, draft_config)
        draft = load_model(config.draft_model, dtype=config.torch_dtype(), device=config.torch_device())
        return DraftModelProposer(draft, target.logit_vocab_size, draft_config)
    from tileinfer.proposers.dflash import DFlashProposer

    if config.draft_model is None:
        raise InvalidRequestError("the dflash proposer needs --draft-model: a DFlash checkpoint folder")
    head = target.weights.get("lm_head.weight", target.weights["model.embed_tokens.weight"])
    head = head[: target.logit_vocab_size]  # the rows the target's own logits have (Decoder)
    return DFlashProposer.from_checkpoint(
        config.draft_model, target.weights["model.embed_tokens.weight"], head,
        max_positions=draft_config.max_model_len, dtype=config.torch_dtype(),
    )  # fmt: skip


def build_engine(model: LoadedModel, config: EngineConfig) -> Engine:
    """An engine with the proposer config.proposer names (none without one), built in this process."""
    if config.proposer is None:
        return Engine(model, config)
    proposer = build_proposer(config, model)
    return Engine(model, config, proposer, draft_cost(config, model.spec.num_layers))
