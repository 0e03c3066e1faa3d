"""`DistributedModelForCausalLM`: embeddings and LM head run locally, every transformer block runs on the swarm.

It is a transformers `PreTrainedModel` with `GenerationMixin`, so `generate()` works as usual (greedy, sampling,
eos, streamers). Each `generate()` runs inside an inference session; only new tokens cross the network.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from client.batched_head import BatchedHead
from client.inference import InferenceSession
from client.swarm_client import ClientConfig, SwarmClient
from swarm.model import DEFAULT_MODEL, ClientHead, ModelSource, resolve_model

Chain = tuple[tuple[str, int, int], ...]


def chain_of(session: InferenceSession) -> Chain:
    """Gives the chain `session` runs on now: its servers and their blocks, the batched head's group."""
    return tuple((span.peer_id, span.start, span.end) for span in session.route)


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose blocks are served by a swarm found through `initial_peers`."""

    config_class = PretrainedConfig
    base_model_prefix = "head"
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig, *, source: ModelSource, swarm: SwarmClient, dtype: torch.dtype):
        super().__init__(config)
        self.source = source
        self.swarm = swarm
        self.head = ClientHead(source, dtype=dtype)
        self.batched_head = BatchedHead(self.head)  # threads generating at once share its passes
        self._thread_state = threading.local()  # each thread's generate() runs in its own session
        generation_file = Path(source.path) / "generation_config.json"
        if generation_file.is_file():
            self.generation_config = GenerationConfig.from_pretrained(source.path)

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model: str = DEFAULT_MODEL,
        *,
        initial_peers: list[str],
        dtype: torch.dtype = torch.float32,
        client_config: ClientConfig | None = None,
    ) -> DistributedModelForCausalLM:
        """Gives a client for `model` (hub-style name, checkpoint folder or .gguf) on the swarm at `initial_peers`."""
        source = resolve_model(model)
        swarm = SwarmClient(source.model_id, source.num_blocks, list(initial_peers), client_config)
        config = source.config
        config._attn_implementation = "sdpa"
        return cls(config, source=source, swarm=swarm, dtype=dtype).eval()

    @property
    def _active_session(self) -> InferenceSession | None:
        return getattr(self._thread_state, "session", None)

    @_active_session.setter
    def _active_session(self, session: InferenceSession | None) -> None:
        self._thread_state.session = session

    def inference_session(self, *, max_length: int, batch: int = 1, prompt_tokens: int = 0) -> InferenceSession:
        """Gives a new session holding up to `max_length` tokens on every server of its chain (`prompt_tokens`, if
        known, tells the orchestrator the job's size)."""
        return InferenceSession(self.swarm, max_length=max_length, batch=batch, prompt_tokens=prompt_tokens)

    @contextlib.contextmanager
    def use_session(self, session: InferenceSession) -> Iterator[InferenceSession]:
        """Makes `forward` run through `session`, whose servers already hold the history before `position`."""
        previous, self._active_session = self._active_session, session
        session.generate_offset = session.position
        try:
            yield session
        finally:
            self._active_session = previous

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.head.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head.lm_head

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs: object,
    ) -> CausalLMOutputWithPast:
        """Gives logits for the tokens of `input_ids` that the session has not seen yet (all of them without one)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: pass sequences of equal length without padding")
        session = self._active_session
        if session is None:
            with self.inference_session(max_length=input_ids.shape[1], batch=input_ids.shape[0]) as temporary:
                hidden = temporary.step(self.head.embed(input_ids))
        else:
            seen = session.position - session.generate_offset
            new_ids = input_ids[:, seen:]
            if new_ids.shape[1] == 0:
                raise ValueError("forward called without new tokens for the active session")
            # generate() keeps the last token's logits only: the last server then sends back one row, not a
            # prompt's every row (half a prefill's bytes on the client's link)
            hidden, sent_on = self._step(session, new_ids, last_only=logits_to_keep == 1)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if session is None:
            return CausalLMOutputWithPast(logits=self.batched_head.logits(hidden))
        # a decode step's row joins the pass of the chain it was counted on (even if it failed over on the way)
        group = sent_on if sent_on is not None else chain_of(session)
        asked = time.perf_counter()
        logits = self.batched_head.logits(hidden, group, sent=sent_on is not None)
        times = session.step_times
        times.head_returned_s = time.perf_counter()
        if sent_on is not None:
            times.head_ms += (times.head_returned_s - asked) * 1000
        return CausalLMOutputWithPast(logits=logits)

    def _step(self, session: InferenceSession, new_ids: torch.Tensor, *, last_only: bool = False
              ) -> tuple[torch.Tensor, Chain | None]:
        """Gives the swarm's output for `new_ids` (with `last_only`, for the last token only), and for a decode step
        the chain it was announced on to the batched head, which keeps the threads of this process that use one
        chain in step."""
        if new_ids.shape[1] != 1:
            return session.step(self.head.embed(new_ids), last_only=last_only), None
        returned = withdrawn = False
        group = chain_of(session)

        def on_output() -> None:
            nonlocal returned
            returned = True
            if not withdrawn:
                self.batched_head.step_returned(group)

        def on_wait() -> None:  # it failed over and backs off: the chain's other sessions do not wait for it
            nonlocal withdrawn
            withdrawn = True
            self.batched_head.step_failed(group, returned=False)

        times = session.step_times
        if times.head_returned_s is not None:
            times.between_ms += (time.perf_counter() - times.head_returned_s) * 1000
        gate = self.batched_head.step_sent(group)
        try:
            hidden = session.step(self.head.embed(new_ids), on_output=on_output, on_wait=on_wait,
                                  before_send=gate.wait if gate is not None else None)
        except BaseException:
            if not withdrawn:
                self.batched_head.step_failed(group, returned=returned)
            raise
        return hidden, None if withdrawn else group

    def generate(  # type: ignore[override]
        self, inputs: torch.Tensor | None = None, *, session: InferenceSession | None = None, **kwargs: object
    ) -> torch.Tensor:
        """Gives `transformers` generate() output; with `session`, `inputs` holds only the new turn's tokens."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids")
        kwargs["use_cache"] = False  # the servers hold the KV cache; every step here sends only new tokens
        if session is not None:
            # The servers have not seen the last token(s) the previous turn generated: send them first.
            pending = session.unsent_ids
            if pending is not None:
                input_ids = torch.cat([pending.to(input_ids.device), input_ids], dim=1)
            with self.use_session(session):
                output = super().generate(input_ids, **kwargs)
            session.unsent_ids = output[:, session.position - session.generate_offset :]
            return output[:, 0 if pending is None else pending.shape[1] :]
        max_length = self._max_length_for(input_ids, kwargs)
        with self.inference_session(max_length=max_length, batch=input_ids.shape[0],
                                    prompt_tokens=input_ids.shape[1]) as temporary, \
                self.use_session(temporary):
            return super().generate(input_ids, **kwargs)

    def _max_length_for(self, input_ids: torch.Tensor, kwargs: dict[str, object]) -> int:
        max_new_tokens = kwargs.get("max_new_tokens")
        if isinstance(max_new_tokens, int):
            return input_ids.shape[1] + max_new_tokens
        max_length = kwargs.get("max_length") or self.generation_config.max_length
        return int(max_length)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Leaves the swarm (DHT node and background loop)."""
        self.swarm.shutdown()
