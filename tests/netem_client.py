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
from collections.abc import Callable
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

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


class _AfterTokens(BaseStreamer):
    """Calls `action` once, right after the `after`-th generated token was streamed; stamps every token."""

    def __init__(self, after: int, action: Callable[[], None]) -> None:
        self.after, self.action, self.puts = after, action, -1
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1  # the prompt is the first put
        if self.puts >= 1:
            self.stamps.append(time.time())
        if self.puts == self.after:
            self.action()

    def end(self) -> None:
        pass


def move(model: DistributedModelForCausalLM, request: dict[str, Any]) -> dict[str, Any]:
    if "input_ids" in request:
        prompt = torch.tensor(request["input_ids"], dtype=torch.long)
    else:
        prompt = random_prompt(int(request["prompt_tokens"]), int(request.get("seed", 0)), model.config.vocab_size)
    with model.inference_session(max_length=prompt.shape[1] + 8) as reference:
        expected = model.generate(prompt, session=reference, max_new_tokens=4, do_sample=False)
    timed: dict[str, Any] = {}
    with model.inference_session(max_length=prompt.shape[1] + 8) as session:

        def move_now() -> None:  # between the 2nd and the 3rd token of the generation
            if session.route[0].peer_id != request["from"]:
                session.migrate(0, str(request["from"]), mode="kv")
            timed["from"] = session.route[0].peer_id
            started_at, started = time.time(), time.perf_counter()
            timed["reply"] = session.migrate(0, str(request["to"]), mode=str(request["mode"]))
            timed["move_s"], timed["ended_at"] = time.perf_counter() - started, time.time()
            timed["started_at"] = started_at

        output = model.generate(prompt, session=session, max_new_tokens=4, do_sample=False,
                                streamer=_AfterTokens(2, move_now))
        if session.route[0].peer_id != request["to"]:
            raise RuntimeError(f"the session is on {session.route[0].peer_id} after its move to {request['to']}")
    return {**timed, "tokens": output[:, prompt.shape[1]:].tolist(), "expected": expected[:, prompt.shape[1]:].tolist()}


class _Until(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class BackgroundDecoder:
    """One session decoding token after token on a thread, stamping each token, until stopped."""

    def __init__(self, model: DistributedModelForCausalLM, peer_id: str, prompt_tokens: int) -> None:
        self.model, self.stop_event = model, threading.Event()
        self.session = model.inference_session(max_length=2048)
        self.prompt = random_prompt(prompt_tokens, 1, model.config.vocab_size)
        self.streamer = _AfterTokens(0, lambda: None)
        model.generate(self.prompt, session=self.session, max_new_tokens=1, do_sample=False)
        if self.session.route[0].peer_id != peer_id:
            self.session.migrate(0, peer_id, mode="kv")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None
        self.thread.start()

    def _run(self) -> None:
        try:
            room = self.session.max_length - self.session.position - 2
            self.model.generate(self.prompt[:, :1], session=self.session, max_new_tokens=room, min_new_tokens=room,
                                do_sample=False, streamer=self.streamer,
                                stopping_criteria=StoppingCriteriaList([_Until(self.stop_event)]))
        except BaseException as error:  # reported by stop()
            self.error = error

    def stop(self) -> list[float]:
        self.stop_event.set()
        self.thread.join()
        self.session.close()
        if self.error is not None:
            raise self.error
        return self.streamer.stamps


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
