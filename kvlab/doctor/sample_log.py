"""A realistic request log to try the doctor on: the dynamic content the article's 4.3 and 5.4 warn
about.

Two apps share one server:

- **support**: a multi-tenant help desk. Each request's system prompt starts with the current time
  and the customer's name and account, then the platform's rules (the same for every tenant), the
  tenant's company profile, and three knowledge-base documents retrieved for the conversation's
  topic, in the order the retriever happened to return them. Conversations keep their full history.
  A mobile client builds the same system prompt with other whitespace, and a legacy batch job sends
  hand-rendered ChatML prompts (``{"prompt": ...}``) that differ from the template in one space.
- **coding**: an IDE assistant. Each system prompt starts with a fresh request id (a UUID); the
  client sends its tools in a different order every time; the conversation keeps only the last two
  exchanges (a sliding window), so the history is rebuilt on every turn.

``make_log`` returns JSON-able dicts in arrival order and ``truth``, what was planted where, so
tests, benchmarks (scripts/bench_doctor.py) and notebook 08 can check what the doctor finds; write
it with ``kvlab.doctor.logio`` or as JSON lines and run ``python -m kvlab.doctor`` on it.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid
from dataclasses import dataclass, field

FIRST = [
    "Alice",
    "Bruno",
    "Chen",
    "Dara",
    "Elif",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemal",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Yara",
    "Zoe",
]
LAST = [
    "Zhang",
    "Silva",
    "Okafor",
    "Novak",
    "Haddad",
    "Kowalski",
    "Tanaka",
    "Garcia",
    "Ivanova",
    "Moreau",
    "Schmidt",
    "Nguyen",
    "Rossi",
    "Larsen",
    "Kim",
    "Costa",
]
TIERS = ["free", "plus", "gold"]

PLATFORM_RULES = """You are the customer-support assistant of the HelpDesk platform.
Follow these rules in every answer:
1. Be polite, concise and specific; greet the customer by name only in your first reply.
2. Use only the company profile and the knowledge-base documents below; never invent \
policies, prices or dates.
3. If the documents do not answer the question, say so and offer to open a ticket for a human agent.
4. Never ask for passwords, full card numbers or one-time codes, and never repeat them if \
the customer sends them.
5. For refunds above the limit in the company profile, collect the order number and escalate.
6. Answer in the customer's language; keep product names in their original spelling.
7. End with one short question that moves the case forward, unless the case is solved.
8. If the customer is upset, acknowledge it in one sentence before you answer."""

TENANTS = {
    "acme": (
        "Acme Outdoor",
        "sells tents, backpacks and stoves online in the EU",
        "Returns within 30 days, unused, with the receipt. "
        "Refund limit for the assistant: 150 EUR.",
        "Support hours: 08:00-20:00 CET, Monday to Saturday.",
    ),
    "globex": (
        "Globex Mobile",
        "is a prepaid mobile network with eSIM plans",
        "Plans can be cancelled any time; unused credit is refunded within 14 days. "
        "Refund limit: 40 EUR.",
        "Support hours: around the clock; network incidents are posted on the status page.",
    ),
    "initech": (
        "Initech Office",
        "delivers office furniture and printers to companies",
        "Damaged deliveries must be reported within 48 hours with photos. Refund limit: 500 EUR.",
        "Support hours: 09:00-17:00 CET on working days.",
    ),
    "umbrella": (
        "Umbrella Pharmacy",
        "runs an online pharmacy for non-prescription products",
        "Opened medicines cannot be returned. Refund limit: 60 EUR.",
        "Support hours: 07:00-22:00 CET every day; urgent medical questions go to a pharmacist.",
    ),
}
TOPICS = {
    "returns": [
        "How to start a return",
        "Refund timelines",
        "Items that cannot be returned",
        "Return shipping labels",
    ],
    "shipping": [
        "Delivery times by country",
        "Tracking a parcel",
        "Lost or late parcels",
        "Changing the address",
    ],
    "billing": ["Payment methods", "Invoices and VAT", "Double charges", "Promo codes"],
    "account": [
        "Resetting access",
        "Changing the e-mail address",
        "Deleting an account",
        "Two-factor login",
    ],
}
SENTENCES = ["Customers can do this from the account page under Orders.",
             "The process takes about five minutes and needs the order number.",
             "An e-mail confirms every step, usually within ten minutes.",
             "If the button is missing, the order is older than the limit in the policy.",
             "Agents can override this only with a manager's approval.",
             "The status page lists known incidents and their expected resolution.",
             "Refunds go back to the original payment method.",
             "Bank processing adds up to five working days.",
             "Partial refunds are possible for bundles.",
             "Customers outside the EU pay the return shipping themselves."]
QUESTIONS = {
    "returns": ["I want to return the {item} I bought last week, how does that work?",
                "My {item} arrived broken. Can I get my money back?",
                "Is it too late to send back the {item}? I ordered it a month ago."],
    "shipping": ["Where is my {item}? The tracking has not moved for three days.",
                 "Can you ship the {item} to my office instead of my home?",
                 "How long does delivery of a {item} take to Portugal?"],
    "billing": ["I was charged twice for the {item}. Please fix this.",
                "Can I get an invoice with my company's VAT number for the {item}?",
                "My promo code did not work when I ordered the {item}."],
    "account": ["I cannot log in any more since I changed my phone.",
                "How do I change the e-mail address on my account?",
                "Please delete my account and all my data."],
}
ITEMS = [
    "tent",
    "backpack",
    "camping stove",
    "eSIM plan",
    "office chair",
    "laser printer",
    "vitamin pack",
    "desk lamp",
]
FOLLOWUPS = [
    "Thanks. And how long will that take?",
    "The order number is {order}. What happens next?",
    "I did that, but nothing happened. Any other idea?",
    "OK. Can I talk to a human agent?",
    "Great, that solved it. One more thing: do you also sell {item}s?",
]
REPLIES = ["Thank you for the details. {s1} {s2} Is there anything else about your order?",
           "I understand, that is frustrating. {s1} {s2} Could you send me the order number?",
           "{s1} {s2} I have noted this on your case. Would you like me to open a ticket?"]

CODING_RULES = """You are CodePilot, the coding assistant inside the team's IDE.
Rules:
- Prefer small, reviewable changes; show diffs, not whole files.
- Run the tests with the run_tests tool before you claim something works.
- Never print secrets from the environment or from configuration files.
- Explain the reason for a change in one or two sentences.
- If a request is ambiguous, ask one clarifying question first."""

TOOLS = [
    (
        "run_tests",
        "Run the project's test suite or a subset of it.",
        {"path": "string", "keyword": "string"},
    ),
    ("read_file", "Read a file of the repository.", {"path": "string"}),
    (
        "search_code",
        "Search the repository for a regular expression.",
        {"pattern": "string", "glob": "string"},
    ),
    ("apply_patch", "Apply a unified diff to the working tree.", {"diff": "string"}),
    ("list_files", "List the files under a folder.", {"path": "string"}),
    ("git_diff", "Show the uncommitted changes.", {}),
]
CODE_ASKS = [
    "Why does this function return None sometimes?\n```python\ndef {f}(items):\n    for i in "
    "items:\n        if i.ok:\n            return i.value\n```",
    "Write a unit test for {f} that covers the empty list.",
    "Refactor {f} so it does not mutate its argument:\n```python\ndef {f}(xs):\n    xs.sort()\n    "
    "return xs[0]\n```",
    "The CI says `ImportError: cannot import name '{f}'`. What did I break?",
    "Add type hints to {f} and explain any Optional you add.",
]
CODE_FOLLOWUPS = [
    "Run the tests and tell me what fails.",
    "Now make it work for generators too.",
    "Can you show the diff again, smaller?",
    "Explain the second change in one sentence.",
]
CODE_REPLIES = [
    "The function falls through the loop when no item is ok, so Python returns None. Return a "
    "default after the loop or raise ValueError. {extra}",
    "Here is a minimal change:\n```diff\n- xs.sort()\n+ xs = sorted(xs)\n```\nIt no longer changes "
    "the caller's list. {extra}",
    "I ran the tests: 42 passed, 1 failed in test_{f}.py because the fixture expects a list. "
    "{extra}",
]
FUNCS = ["parse_items", "load_config", "merge_rows", "first_valid", "pick_best", "normalize"]


@dataclass
class Truth:
    """What ``make_log`` planted: the lines of the system prompts that vary, and how."""

    timestamp_line: str = "Current time: "
    customer_line: str = "Customer: "
    request_id_line: str = "Request-ID: "
    doc_header: str = "[Document "
    coding_window: int = 2
    tenants: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def _doc(rng: random.Random, tenant: str, topic: str, k: int, sentences: int) -> str:
    title = TOPICS[topic][k]
    body = " ".join(random.Random(f"{tenant}/{topic}/{k}").sample(SENTENCES, sentences))
    return f"[Document {tenant[:2].upper()}-{topic[:3]}-{k + 1}] {title}\n{body}"


def platform_rules(n: int = 8) -> str:
    """The platform's rules (the same for every tenant), the first ``n`` of them."""
    lines = PLATFORM_RULES.split("\n")
    return "\n".join(lines[: 2 + n])


def support_system(
    tenant: str, now: dt.datetime, user: dict, docs: list[str], mobile: bool, rules: int = 8
) -> str:
    """The help desk's system prompt, built the way the app builds it (volatile lines first)."""
    name, what, policy, hours = TENANTS[tenant]
    sep = "\n\n\n" if mobile else "\n\n"  # the mobile client's template leaves an extra blank line
    company = f"Company: {name}{' ' if mobile else ''}\n{name} {what}.\n{policy}\n{hours}"
    return (f"Current time: {now:%Y-%m-%d %H:%M:%S} UTC\n"
            f"Customer: {user['name']} (account {user['id']}, {user['tier']} tier)\n\n"
            f"{platform_rules(rules)}{sep}{company}{sep}# Knowledge base\n\n" + "\n\n".join(docs))


def coding_system(request_id: str) -> str:
    """The IDE assistant's system prompt: a request id on top, then fixed rules."""
    return f"Request-ID: {request_id}\n{CODING_RULES}"


def tool_specs() -> list[dict]:
    """The coding assistant's tools in OpenAI format."""
    return [
        {
            "type": "function",
            "function": {
                "name": n,
                "description": d,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": v} for k, v in p.items()},
                },
            },
        }
        for n, d, p in TOOLS
    ]


def make_log(
    support_conversations: int = 300,
    coding_conversations: int = 120,
    turns: tuple[int, int] = (1, 5),
    users: int = 120,
    tenants: tuple[str, ...] = ("acme", "globex", "initech", "umbrella"),
    docs_per_request: int = 3,
    doc_sentences: int = 3,
    mobile_share: float = 0.25,
    legacy_share: float = 0.05,
    seed: int = 0,
    start: dt.datetime | None = None,
    rules: int = 8,
    tools: int = 6,
) -> tuple[list[dict], Truth]:
    """Requests of both apps interleaved in arrival order (JSON-able dicts), and what was planted.

    ``rules``, ``doc_sentences`` and ``tools`` set the prompt sizes (fewer = shorter prompts, e.g.
    for a model with a 1,024-token context).
    """
    rng = random.Random(seed)
    start = start or dt.datetime(2024, 5, 3, 8, 0, 0)
    people = []
    for u in range(users):
        people.append(
            {
                "id": f"u-{1000 + u * 7 % 9000}",
                "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
                "tier": rng.choice(TIERS),
                "tenant": tenants[u % len(tenants)],
                "mobile": rng.random() < mobile_share,
            }
        )
    events: list[tuple[float, int, dict]] = []
    day = 12 * 3600
    order = 0
    truth = Truth(tenants=list(tenants))
    for c in range(support_conversations):
        user = people[rng.randrange(users)]
        tenant = user["tenant"]
        topic = rng.choice(list(TOPICS))
        item = rng.choice(ITEMS)
        t = rng.uniform(0, day)
        msgs: list[dict] = []
        legacy = rng.random() < legacy_share
        n_turns = 1 if legacy else rng.randint(*turns)
        for k in range(n_turns):
            docs_k = [_doc(rng, tenant, topic, j, doc_sentences) for j in range(docs_per_request)]
            rng.shuffle(docs_k)  # the retriever's order changes with every query
            now = start + dt.timedelta(seconds=t)
            system = support_system(tenant, now, user, docs_k, user["mobile"], rules)
            q = (rng.choice(QUESTIONS[topic]) if k == 0 else rng.choice(FOLLOWUPS)).format(
                item=item, order=f"A{rng.randrange(10**6):06d}"
            )
            msgs.append({"role": "user", "content": q})
            meta = {"user": user["id"], "tenant": tenant, "session": f"s{c}", "app": "support",
                    "timestamp": now.isoformat(timespec="seconds")}
            if legacy:
                prompt = (
                    f"<|im_start|>system \n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                    "<|im_start|>assistant\n"
                )  # hand-rendered: a stray space after the role
                events.append((t, order, {"prompt": prompt, **meta, "client": "legacy-batch"}))
            else:
                events.append(
                    (
                        t,
                        order,
                        {
                            "messages": [{"role": "system", "content": system}]
                            + [dict(m) for m in msgs],
                            **meta,
                            "client": "mobile" if user["mobile"] else "web",
                        },
                    )
                )
            order += 1
            s1, s2 = rng.sample(SENTENCES, 2)
            msgs.append({"role": "assistant", "content": rng.choice(REPLIES).format(s1=s1, s2=s2)})
            t += rng.uniform(30, 240)
    for c in range(coding_conversations):
        dev = f"dev-{rng.randrange(40):02d}"
        f = rng.choice(FUNCS)
        t = rng.uniform(0, day)
        exchanges: list[list[dict]] = []
        for k in range(rng.randint(*turns)):
            q = (rng.choice(CODE_ASKS) if k == 0 else rng.choice(CODE_FOLLOWUPS)).format(f=f)
            tool_list = tool_specs()[:tools]
            # built from an unordered registry: a different order every request
            rng.shuffle(tool_list)
            # sliding window of 2 exchanges
            kept = [m for ex in exchanges[-truth.coding_window:] for m in ex]
            rid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            now = start + dt.timedelta(seconds=t)
            events.append(
                (
                    t,
                    order,
                    {
                        "messages": [
                            {"role": "system", "content": coding_system(rid)},
                            *kept,
                            {"role": "user", "content": q},
                        ],
                        "tools": tool_list,
                        "user": dev,
                        "tenant": "devtools",
                        "session": f"c{c}",
                        "app": "coding",
                        "timestamp": now.isoformat(timespec="seconds"),
                    },
                )
            )
            order += 1
            reply = rng.choice(CODE_REPLIES).format(
                f=f, extra=rng.choice(["", "Want me to apply it?", "Shall I run the tests?"])
            )
            exchanges.append(
                [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]
            )
            t += rng.uniform(20, 120)
    events.sort(key=lambda e: (e[0], e[1]))
    log = [e[2] for e in events]
    truth.counts = {"requests": len(log), "support": sum(r.get("app") == "support" for r in log),
                    "coding": sum(r.get("app") == "coding" for r in log),
                    "legacy": sum("prompt" in r for r in log)}
    return log, truth
