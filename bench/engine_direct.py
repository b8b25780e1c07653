"""Engine-direct: the served app's engine built in this process, and a closed loop of clients that drives
it through Engine.add_request / Engine.step (no HTTP, no Ray): the reference the serving benches set the
served app against."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.load_client import request_record


def build_engine(app_args: Any, device: str) -> Any:
    """An Engine in this process with the app's engine settings (AppArgs) on `device` ("auto": a GPU where
    there is one), warmed up as the engine deployment does before it serves."""
    import torch
    from tileinfer.engine.engine import Engine
    from tileinfer.engine.models.loader import load_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = app_args.dtype if app_args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    config = app_args.engine_config(device, dtype)
    engine = Engine(
        load_model(app_args.model, dtype=config.torch_dtype(), device=config.torch_device()), config
    )
    engine.warm_up()
    return engine


def engine_records(
    engine: Any, prompts: list[list[int]], concurrency: int, params_for: Callable[[int], Any]
) -> tuple[list[dict[str, Any]], float]:
    """The prompts through the engine by `concurrency` closed-loop clients (a client adds its next prompt
    when its request ends, with params_for(client)): each request's record (load_client.request_record's,
    with its client, text and finish_reason; TTFT from add_request to the step that returned the first
    token) and the wall time."""
    pending = iter(prompts)
    state: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []

    def add_next(client: int) -> None:
        prompt = next(pending, None)
        if prompt is not None:
            state[engine.add_request(prompt, params_for(client))] = {
                "client": client, "start": time.perf_counter(), "first": None, "last": None, "tokens": 0,
                "text": [],
            }  # fmt: skip

    start = time.perf_counter()
    for client in range(concurrency):
        add_next(client)
    while state:
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            entry = state[output.request_id]
            entry["first"] = entry["first"] if entry["first"] is not None else now
            entry["last"] = now
            entry["tokens"] += len(output.new_token_ids)
            entry["text"].append(output.new_text)
            if output.finished:
                del state[output.request_id]
                record = request_record(entry["start"], entry["first"], entry["last"], entry["tokens"], None)
                records.append({**record, "client": entry["client"], "text": "".join(entry["text"]),
                                "finish_reason": output.finish_reason})  # fmt: skip
                add_next(entry["client"])
    return records, time.perf_counter() - start
