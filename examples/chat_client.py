"""Chat with a running swarm from the terminal; every turn sends only its new tokens through one inference session.

    .venv/bin/python -m examples.chat_client --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...

Type a message and press Enter; an empty line, Ctrl-D or Ctrl-C ends the chat.
"""

from __future__ import annotations

import argparse
import sys

from transformers import AutoTokenizer, PreTrainedTokenizerBase, TextStreamer

from client import ClientConfig, DistributedModelForCausalLM, InferenceSession
from swarm.model import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    """Gives the argument parser of the chat client."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs printed by swarm-dht")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model the swarm serves (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens the session reserves on every server")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest reply in tokens")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none", help="hidden states on wire")
    return parser


def chat(
    model: DistributedModelForCausalLM, tokenizer: PreTrainedTokenizerBase, session: InferenceSession,
    max_new_tokens: int,
) -> None:
    """Answers user turns until an empty line, EOF or a full session."""
    messages: list[dict[str, str]] = []
    sent_text = ""  # the conversation as the session's servers have seen it (plus the last generated token)
    while True:
        try:
            question = input("\nyou: ").strip()
        except EOFError:
            return
        if not question:
            return
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not text.startswith(sent_text):
            raise RuntimeError("the chat template re-rendered earlier turns differently; restart the chat")
        new_ids = tokenizer(text[len(sent_text):], add_special_tokens=False, return_tensors="pt")["input_ids"]
        if session.position + new_ids.shape[1] + max_new_tokens + 1 > session.max_length:
            print(f"(the session's {session.max_length} tokens are used up; restart with a larger --max-length)")
            return
        print("bot: ", end="", flush=True)
        output = model.generate(
            new_ids, session=session, max_new_tokens=max_new_tokens, do_sample=False,
            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
            pad_token_id=tokenizer.eos_token_id,
        )
        reply_ids = output[0, new_ids.shape[1]:]
        messages.append({"role": "assistant", "content": tokenizer.decode(reply_ids, skip_special_tokens=True)})
        sent_text = text + tokenizer.decode(reply_ids, skip_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point; gives the exit code."""
    args = build_parser().parse_args(argv)
    config = ClientConfig(compression=None if args.compression == "none" else args.compression)
    model = DistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, client_config=config
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.source.path)
        with model.inference_session(max_length=args.max_length) as session:
            chat(model, tokenizer, session, args.max_new_tokens)
    except KeyboardInterrupt:
        pass
    finally:
        print()
        model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
