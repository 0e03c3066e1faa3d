"""A swarm client driven by JSON lines, for running inside an emulated host (netem tests and benchmarks).

    ip netns exec NS python -m tests.netem_client --model PATH --initial-peers MADDR...

Prints `{"ready": true}` once connected, then answers each request line with one JSON line:
- `{"op": "generate", "input_ids": [[...]], "max_new_tokens": N, "server_push": bool (optional)}` ->
  `{"tokens": [[...]], "step_ms": [...], "prefill_ms": float, "route": [peer ids]}`: greedy tokens, the time of
  every decode step (between consecutive tokens, from a streamer's timestamps) and the chain of servers; the session
  is opened before the clock starts. `server_push` picks a client with that `ClientConfig.server_push` (default:
  the config's default).
- `{"op": "quit"}` -> exits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import torch

from client import ClientConfig, DistributedModelForCausalLM
from client.timing import StepClock


def generate(model: DistributedModelForCausalLM, request: dict[str, Any]) -> dict[str, Any]:
    input_ids = torch.tensor(request["input_ids"], dtype=torch.long)
    new_tokens = int(request["max_new_tokens"])
    with model.inference_session(max_length=input_ids.shape[1] + new_tokens) as session:
        clock = StepClock()
        started_s = time.perf_counter()
        output = model.generate(input_ids, session=session, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, streamer=clock)
        route = [span.peer_id for span in session.route]
    stamps = clock.stamps_s
    return {
        "tokens": output.tolist(),
        "prefill_ms": (stamps[1] - started_s) * 1000,
        "step_ms": [(later - earlier) * 1000 for earlier, later in itertools.pairwise(stamps[1:])],
        "route": route,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    args = parser.parse_args(argv)
    models: dict[bool, DistributedModelForCausalLM] = {}

    def model_for(push: bool) -> DistributedModelForCausalLM:
        if push not in models:
            config = ClientConfig(server_push=push)
            models[push] = DistributedModelForCausalLM.from_pretrained(
                args.model, initial_peers=args.initial_peers, client_config=config
            )
        return models[push]

    default_push = ClientConfig().server_push
    try:
        model_for(default_push)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            try:
                reply = generate(model_for(bool(request.get("server_push", default_push))), request)
            except Exception as error:  # reported to the driver, which decides
                reply = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps(reply), flush=True)
    finally:
        for model in models.values():
            model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
