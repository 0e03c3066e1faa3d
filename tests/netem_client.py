"""A swarm client driven by JSON lines, for running inside an emulated host (netem tests and benchmarks).

    ip netns exec NS python -m tests.netem_client --model PATH --initial-peers MADDR...

Prints `{"ready": true}` once connected, then answers each request line with one JSON line:
- `{"op": "generate", "input_ids": [[...]], "max_new_tokens": N, "server_push": bool (optional)}` ->
  `{"tokens": [[...]], "step_ms": [...], "prefill_ms": float, "route": [peer ids]}`: greedy tokens, the time of
  every decode step (between consecutive tokens, from a streamer's timestamps) and the chain of servers; the session
  is opened before the clock starts. `server_push` picks a client with that `ClientConfig.server_push` (default:
  the config's default).
- `{"op": "move", "input_ids": [[...]] (or "prompt_tokens": N, "seed": S for random ones), "mode": "kv" | "replay" |
  "auto", "from": peer id, "to": peer id}` -> opens a session, prefills the prompt and decodes 2 (its first span
  moved to `from` first if the route put it elsewhere), moves its first span to server `to`
  (`InferenceSession.migrate`), timed, decodes 2 more: `{"move_s", "started_at", "ended_at" (wall clock), "reply"
  (the server's), "from", "tokens", "expected" (the same 4 tokens generated without a move, in a session of their
  own)}`.
- `{"op": "decode_on", "peer_id": P, "prompt_tokens": N}` -> starts a session whose first span is on server P (moved
  there if the route put it elsewhere) decoding greedily in the background, one token after the other, until
  `{"op": "decode_stop"}` -> `{"stamps": [wall-clock time of every token]}`.
- `{"op": "quit"}` -> exits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
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


def random_prompt(tokens: int, seed: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, tokens), generator=generator)


def move(model: DistributedModelForCausalLM, request: dict[str, Any]) -> dict[str, Any]:
    if "input_ids" in request:
        prompt = torch.tensor(request["input_ids"], dtype=torch.long)
    else:
        prompt = random_prompt(int(request["prompt_tokens"]), int(request.get("seed", 0)), model.config.vocab_size)
    with model.inference_session(max_length=prompt.shape[1] + 8) as reference:
        expected = model.generate(prompt, session=reference, max_new_tokens=4, do_sample=False)
    with model.inference_session(max_length=prompt.shape[1] + 8) as session:
        before = model.generate(prompt, session=session, max_new_tokens=2, do_sample=False)
        if session.route[0].peer_id != request["from"]:
            session.migrate(0, str(request["from"]), mode="kv")
        source = session.route[0].peer_id
        started_at, started = time.time(), time.perf_counter()
        reply = session.migrate(0, str(request["to"]), mode=str(request["mode"]))
        move_s, ended_at = time.perf_counter() - started, time.time()
        after = model.generate(before[:, -1:], session=session, max_new_tokens=2, do_sample=False)
        if session.route[0].peer_id != request["to"]:
            raise RuntimeError(f"the session is on {session.route[0].peer_id} after its move to {request['to']}")
    return {"move_s": move_s, "started_at": started_at, "ended_at": ended_at, "reply": reply, "from": source,
            "tokens": torch.cat([before, after[:, 1:]], dim=1)[:, prompt.shape[1]:].tolist(),
            "expected": expected[:, prompt.shape[1]:].tolist()}


class BackgroundDecoder:
    """One session decoding token after token on a thread, stamping each token, until stopped."""

    def __init__(self, model: DistributedModelForCausalLM, peer_id: str, prompt_tokens: int) -> None:
        self.model, self.stop_event = model, threading.Event()
        self.stamps: list[float] = []
        self.session = model.inference_session(max_length=2048)
        prompt = random_prompt(prompt_tokens, 1, model.config.vocab_size)
        self.output = model.generate(prompt, session=self.session, max_new_tokens=1, do_sample=False)
        if self.session.route[0].peer_id != peer_id:
            self.session.migrate(0, peer_id, mode="kv")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop_event.is_set() and self.session.position < self.session.max_length - 2:
                self.output = self.model.generate(self.output[:, -1:], session=self.session, max_new_tokens=1,
                                                  do_sample=False)
                self.stamps.append(time.time())
        except BaseException as error:  # reported by stop()
            self.error = error

    def stop(self) -> list[float]:
        self.stop_event.set()
        self.thread.join()
        self.session.close()
        if self.error is not None:
            raise self.error
        return self.stamps


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
    decoder: BackgroundDecoder | None = None
    try:
        model_for(default_push)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            try:
                model = model_for(bool(request.get("server_push", default_push)))
                if request.get("op") == "move":
                    reply = move(model, request)
                elif request.get("op") == "decode_on":
                    decoder = BackgroundDecoder(model, str(request["peer_id"]), int(request["prompt_tokens"]))
                    reply = {"started": True}
                elif request.get("op") == "decode_stop":
                    reply = {"stamps": decoder.stop()}
                else:
                    reply = generate(model, request)
            except Exception as error:  # reported to the driver, which decides
                reply = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps(reply), flush=True)
    finally:
        for model in models.values():
            model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
