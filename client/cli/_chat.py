"""`lorad chat`: try an adapter in a conversation read line by line from stdin; shared generation flags."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lorad.client.cli._context import make_client, opt
from lorad.client.cli._output import EXIT_OK, print_json
from lorad.client.types import ChatMessage, Role

# Earlier turns sent with each message: enough for a follow-up question, small enough that the rendered prompt
# stays far below SmolLM2's 2,048-token context with 128-token answers.
HISTORY_TURNS = 6


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The generation flags `generate` and `chat` share (defaults are the daemon's: 0 means "default")."""
    p.add_argument("--max-tokens", type=int, default=0, help="new tokens, up to 2048 (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), up to 2")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass, 0 to 1 (default 0 = off)")
    p.add_argument(
        "--repetition-penalty", type=float, default=0.0, help="1 to 2; 1 = off (default 0 = the daemon's 1.1)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (equal seeds give equal output)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The client.generate keywords of the shared flags."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
    }


def add_parsers(sub: Any, parent: argparse.ArgumentParser) -> None:
    """Registers `chat`."""
    ch = sub.add_parser(
        "chat",
        parents=[parent],
        help="chat with an adapter (or the base model): one message per stdin line",
        description="Each line read from stdin is a user message; the answer is printed below it. The last "
        f"{HISTORY_TURNS} turns go with each message. End with Ctrl-D (or end of the piped input).",
    )
    ch.add_argument("--adapter", default=None, help="adapter id or job id (default: base model only)")
    ch.add_argument("--system", default=None, help="a system message before the conversation")
    add_sampling_args(ch)
    ch.set_defaults(func=chat)


def chat(args: argparse.Namespace) -> int:
    """Reads user lines from stdin and streams each answer; --json prints one object per turn."""
    as_json = opt(args, "json")
    tty = sys.stdin.isatty() and not as_json
    history: list[ChatMessage] = []
    with make_client(args) as c:
        adapter = c.adapter_id_of(args.adapter) if args.adapter else None  # a job id resolves once, up front
        while True:
            if tty:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            turns = [*history[-HISTORY_TURNS:], ChatMessage(Role.USER, text)]
            answer, prompt_tokens, finish = [], 0, None
            for chunk in c.generate(turns, adapter=adapter, system=args.system, **sampling_kwargs(args)):
                answer.append(chunk.text)
                prompt_tokens = prompt_tokens or chunk.prompt_token_count
                finish = chunk.finish_reason or finish
                if not as_json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            reply = "".join(answer)
            if as_json:
                print_json(
                    {"user": text, "assistant": reply, "prompt_token_count": prompt_tokens, "finish_reason": finish}
                )
            else:
                sys.stdout.write("\n")
            history += [ChatMessage(Role.USER, text), ChatMessage(Role.ASSISTANT, reply)]
    if tty:
        print()
    return EXIT_OK
