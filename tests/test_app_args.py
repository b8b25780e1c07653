"""The application's args (deployments/launch/app_args.py) and where they place the actors
(deployments/app.py): GPU shares for the engine and the proposer on one GPU, on two, and on none; drafting
ahead; bad args."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tileinfer.deployments.app import gpu_shares, proposer_actor_options
from tileinfer.deployments.launch.app_args import AppArgs, parse_app_args
from tileinfer.deployments.replicas.proposer_actor import SEE_ALL_GPUS, assigned_gpu_index


@pytest.mark.parametrize(
    ("args", "cluster_gpus", "shares"),
    [
        ({}, 0, (0.0, 0.0)),  # the CPU: no GPU reserved
        ({"proposer": "ngram"}, 0, (0.0, 0.0)),
        ({}, 1, (1.0, 0.0)),  # no proposer actor: the engine takes its GPU
        ({"proposer": "draft", "proposer_in_process": True}, 2, (1.0, 0.0)),
        ({"proposer": "draft"}, 1, (0.5, 0.5)),  # one GPU: shared
        ({"proposer": "draft"}, 2, (1.0, 1.0)),  # two: the proposer gets its own
        ({"proposer": "draft"}, 8, (1.0, 1.0)),
        ({"proposer": "draft", "proposer_num_gpus": 0.5}, 2, (0.5, 0.5)),  # asked for: shared anyway
        ({"proposer": "ngram", "proposer_num_gpus": 0, "engine_num_gpus": 1}, 1, (1.0, 0.0)),
    ],
)
def test_gpu_shares(args: dict, cluster_gpus: float, shares: tuple[float, float]) -> None:
    assert gpu_shares(parse_app_args(args), cluster_gpus) == shares


def test_a_proposer_with_a_gpu_of_its_own_sees_every_gpu_and_picks_its_own() -> None:
    args = parse_app_args({"proposer": "ngram"})
    assert proposer_actor_options(args, 1.0)["runtime_env"] == {"env_vars": {SEE_ALL_GPUS: "1"}}
    assert "runtime_env" not in proposer_actor_options(args, 0.5)  # shared: Ray narrows it to that GPU
    assert proposer_actor_options(args, 0.5)["num_gpus"] == 0.5
    assert assigned_gpu_index([1], None) == 1  # Ray's ids are CUDA indices...
    assert assigned_gpu_index(["3"], "2,3") == 1  # ...or entries of the node's CUDA_VISIBLE_DEVICES
    with pytest.raises(RuntimeError, match="assigned it none"):
        assigned_gpu_index([], None)


def test_drafting_ahead_defaults_to_a_proposer_with_a_gpu_of_its_own() -> None:
    default = parse_app_args({"proposer": "draft"})
    assert default.proposer_draft_ahead("cuda", num_gpus=1.0)
    assert not default.proposer_draft_ahead("cuda", num_gpus=0.5)
    assert not default.proposer_draft_ahead("cpu", num_gpus=0.0)
    forced = parse_app_args({"proposer": "draft", "draft_ahead": True})
    assert forced.proposer_draft_ahead("cpu", num_gpus=0.0)
    assert not parse_app_args({"draft_ahead": False}).proposer_draft_ahead("cuda", num_gpus=1.0)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"proposer": "medusa"}, "proposer"),
        ({"proposer_num_gpus": 2}, "proposer_num_gpus"),
        ({"num_draft": 0}, "num_draft"),
        ({"draft_ahaed": True}, "draft_ahaed"),  # a misspelt arg is refused, not ignored
        ({"quantization": "int4"}, "quantization"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ],
)
def test_bad_args_are_named(args: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"invalid TileInfer application args: {named}"):
        parse_app_args(args)


def test_every_arg_in_serve_config_is_an_app_arg() -> None:
    """serve_config.yaml's args, and the ones it shows commented out, are all AppArgs fields."""
    text = (Path(__file__).parents[1] / "serve_config.yaml").read_text()
    config = yaml.safe_load(text)
    (application,) = config["applications"]
    names = set(application.get("args", {}))
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# ") and ":" in stripped and " " not in stripped[2:].split(":")[0]:
            key = stripped[2:].split(":")[0]
            if key.isidentifier() and line.startswith("      #"):
                names.add(key)
    assert {"proposer", "draft_ahead", "proposer_num_gpus"} <= names
    assert names <= set(AppArgs.model_fields)


def test_null_args_take_the_devices_defaults() -> None:
    args = parse_app_args({})
    gpu, cpu = args.engine_config("cuda", "bfloat16"), args.engine_config("cpu", "float32")
    assert (gpu.max_num_seqs, gpu.kv_cache_tokens, gpu.gpu_memory_utilization) == (256, None, 0.9)
    assert (cpu.max_num_seqs, cpu.kv_cache_tokens) == (64, 16384)
    assert args.for_device("cuda").max_num_seqs == 256  # what build_app hands every deployment
    given = parse_app_args({"max_num_seqs": 8, "kv_cache_tokens": 4096, "gpu_memory_utilization": 0.5})
    on_gpu = given.engine_config("cuda", "bfloat16")
    assert (on_gpu.max_num_seqs, on_gpu.kv_cache_tokens, on_gpu.gpu_memory_utilization) == (8, 4096, 0.5)


@pytest.mark.parametrize(("cluster_cpus", "replicas"), [(2, 1), (7, 1), (8, 2), (16, 4), (128, 4)])
def test_ingress_replicas_auto_follow_the_clusters_cpus(cluster_cpus: float, replicas: int) -> None:
    assert parse_app_args({}).for_device("cpu", cluster_cpus).num_ingress_replicas == replicas
    assert (
        parse_app_args({"num_ingress_replicas": 3}).for_device("cpu", cluster_cpus).num_ingress_replicas == 3
    )
    with pytest.raises(ValueError, match="num_ingress_replicas"):
        parse_app_args({"num_ingress_replicas": 0})


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1])
def test_gpu_memory_utilization_must_be_a_share(fraction: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        parse_app_args({"gpu_memory_utilization": fraction})


def test_quantization_reaches_the_engine() -> None:
    assert parse_app_args({"quantization": "int8"}).engine_config("cpu", "float32").quantization == "int8"
    assert parse_app_args({}).engine_config("cpu", "float32").quantization is None
    config = parse_app_args({"kv_cache_dtype": "int8"}).engine_config("cpu", "float32")
    assert config.kv_cache_dtype == "int8"
    assert parse_app_args({}).engine_config("cpu", "float32").kv_cache_dtype == "auto"


def _engine_deployment(app: object) -> object:
    """The engine deployment an application builds (the ingress's bound argument)."""
    from tileinfer.deployments.replicas.engine_replica import EngineDeployment

    bound_args = app._bound_deployment.init_args  # type: ignore[attr-defined]
    found = [arg for arg in bound_args if hasattr(arg, "_bound_deployment")]
    (engine,) = [bound._bound_deployment for bound in found]
    assert engine.name == EngineDeployment.name
    return engine


def test_engine_replicas_and_autoscaling_reach_serve() -> None:
    from tileinfer.deployments.app import build_app

    engine = _engine_deployment(build_app({"num_engine_replicas": 3, "engine_max_replicas_per_node": 2}))
    assert engine.num_replicas == 3
    assert engine._replica_config.max_replicas_per_node == 2
    assert engine._deployment_config.request_router_config.request_router_class.endswith("EngineRouter")
    one = _engine_deployment(build_app({}))  # one replica: Serve's own router
    assert one._deployment_config.request_router_config.is_default_request_router()
    app = build_app({"engine_autoscaling_config": {"min_replicas": 1, "max_replicas": 4}, "max_num_seqs": 32})
    autoscaling = _engine_deployment(app)._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.target_ongoing_requests == 16  # sequences per replica: half of max_num_seqs
    assert autoscaling.policy.policy_function == "tileinfer.deployments.replicas.autoscaling:sequences_policy"
    with pytest.raises(ValueError, match="not both"):
        parse_app_args({"num_engine_replicas": 2, "engine_autoscaling_config": {"max_replicas": 2}})


def test_each_engine_replica_reserves_its_proposer_beside_it() -> None:
    """With a proposer actor that takes resources, Serve reserves each engine replica and its proposer as
    one placement group on one node (the replica starts the proposer in the second bundle)."""
    from tileinfer.deployments.app import build_app, engine_bundles

    paired = _engine_deployment(
        build_app({"num_engine_replicas": 2, "proposer": "ngram", "proposer_num_cpus": 2})
    )
    assert paired._replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 2.0}]
    assert paired._replica_config.placement_group_strategy == "STRICT_PACK"
    assert paired.init_args[3] == {"num_cpus": 2.0, "num_gpus": 0.0}  # the proposer's Ray options
    assert engine_bundles({"num_cpus": 1, "num_gpus": 0.5}, {"num_cpus": 1, "num_gpus": 0.5}) == [
        {"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5},
    ]  # fmt: skip
    # nothing to reserve for one of them (Ray takes no empty bundle): the proposer is pinned to the node
    unreserved = _engine_deployment(build_app({"proposer": "ngram", "proposer_num_cpus": 0}))
    assert unreserved._replica_config.placement_group_bundles is None
    assert (
        _engine_deployment(build_app({"proposer": "ngram", "proposer_in_process": True})).init_args[3] is None
    )
    with pytest.raises(ValueError, match="engine_max_replicas_per_node"):
        build_app({"num_engine_replicas": 2, "engine_max_replicas_per_node": 1, "proposer": "ngram"})


def test_the_autoscaling_policy_scales_on_the_engines_sequences() -> None:
    from types import SimpleNamespace

    from tileinfer.deployments.replicas.autoscaling import sequences_policy

    config = SimpleNamespace(get_target_ongoing_requests=lambda: 64)

    def context(sequences: dict[str, float], running: int = 2) -> SimpleNamespace:
        return SimpleNamespace(
            aggregated_metrics=lambda: {"sequences": sequences}, current_num_replicas=running,
            target_num_replicas=running, config=config,
        )  # fmt: skip

    assert sequences_policy(context({"a": 100, "b": 156}))[0] == 4  # 256 sequences at 64 a replica
    assert sequences_policy(context({"a": 10, "b": 0}))[0] == 10 / 64  # Serve rounds and bounds it
    assert sequences_policy(context({}, running=2))[0] == 2  # nothing reported yet: as it is
