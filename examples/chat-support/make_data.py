"""Writes train.jsonl and dev.jsonl: a toy, fully synthetic customer-support chat data set
(no real person or ticket). Each row is one conversation with a ``user`` id (a customer may
open several conversations: the column user-level privacy groups by) and ``messages``.

    python examples/chat-support/make_data.py
"""

import json
import random
from pathlib import Path

PRODUCTS = ["router", "phone", "laptop", "printer", "watch", "speaker"]
ISSUES = {
    "will not turn on": "Hold the power button for ten seconds, then charge it for an hour before trying again.",
    "is slow": "Restart it and install the latest update from the settings menu.",
    "lost its connection": "Turn it off and on again, then reconnect it to your network.",
    "shows an error": "Write down the error code and reset it to factory settings from the settings menu.",
    "was damaged in delivery": "We are sorry. Reply with your order number and we will send a replacement.",
}
SYSTEM = "You are a helpful support agent for an electronics shop. Answer briefly."


def conversation(rng: random.Random) -> list[dict]:
    product, issue = rng.choice(PRODUCTS), rng.choice(list(ISSUES))
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Hello, my {product} {issue}."},
            {"role": "assistant", "content": f"Sorry to hear that your {product} {issue}. {ISSUES[issue]}"}]
    if rng.random() < 0.4:  # a follow-up turn
        msgs += [{"role": "user", "content": "Thanks. And if that does not help?"},
                 {"role": "assistant", "content": f"Then bring the {product} to any of our shops for a free check."}]
    return msgs


def main() -> None:
    rng = random.Random(0)
    here = Path(__file__).parent
    for name, n, users in (("train", 400, 120), ("dev", 40, 20)):
        with open(here / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"user": f"{name}-customer-{rng.randrange(users):03d}",
                                    "messages": conversation(rng)}) + "\n")


if __name__ == "__main__":
    main()
