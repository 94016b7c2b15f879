"""Structured-output prompts for distilling a draft: extraction into JSON schemas, classification into
enums, and tool calls, each with the constraint the target answers it under.

Contract: ``structured_prompts(seed, count)`` returns ``count`` prompts (dicts with ``id``, ``source``
"structured", ``domain`` (the task family), ``subject``, ``messages``, ``split`` and ``constraint``:
``{"kind", "source"}`` as ``specstream.data.constraint.Constraint`` takes them) built offline from
the lists below: a task family draws its facts (names, cities, items, numbers, dates) from value
pools, writes them as a sentence in one of its phrasings, and asks for them in one of its schemas
(keys, their order and nesting vary). What the model answers comes from the target itself, under
the constraint (self-distillation, tools.distill.data).

Held out by value: every ``HELD_OUT_EVERY``-th value of each pool (crc32 order), and the values that
``bench structured`` asks about (``BENCH_VALUES``), are drawn only by held-out prompts, so a held-out
answer's values were never trained on and the benchmark's questions measure a draft on values it has
not seen.

What it does not know: tokenization, chat templates, models.
"""

from __future__ import annotations

import json
import random
import zlib

from specstream.data.constraint import Constraint
from specstream.text.tools import Tool, tool_constraint, tools_system_text

__all__ = ["BENCH_VALUES", "FAMILIES", "HELD_OUT_EVERY", "constraint_of", "structured_prompts"]

HELD_OUT_EVERY = 6  # within a pool, every 6th value in crc32 order is held out
HELD_OUT_SHARE = 8  # one prompt in 8 is held out (it draws only held-out values)
ID_BASE = 2_000_000  # prompt ids, apart from the everyday prompts' (tools.distill.everyday)

FIRST = ("Anna", "Ben", "Carlos", "Diana", "Ethan", "Fatima", "George", "Hannah", "Ivan", "Julia", "Kenji", "Laura",
         "Mohammed", "Nina", "Oscar", "Priya", "Quentin", "Rosa", "Samuel", "Tara", "Umar", "Vera", "William",
         "Xavier", "Yuki", "Zoe", "Adam", "Bella", "Chris", "Daniel", "Emma", "Felix", "Grace", "Henry", "Isabel",
         "Jack", "Karen", "Liam", "Maria", "Noah", "Olivia", "Peter", "Rachel", "Sofia", "Thomas", "Victor",
         "Wendy", "Lucas", "Mia", "David", "Sarah", "James", "Elena", "Omar", "Chloe", "Leo", "Alice", "Hugo",
         "Marie", "Alan", "Jane", "Tom")
LAST = ("Smith", "Garcia", "Nguyen", "Kowalski", "Rossi", "Tanaka", "Okafor", "Muller", "Silva", "Johnson",
        "Brown", "Martin", "Novak", "Ivanova", "Patel", "Kim", "Larsen", "Dubois", "Schmidt", "Costa", "Ahmed",
        "Lopez", "Wilson", "Taylor", "Anderson", "Fischer", "Moreau", "Santos", "Yamamoto", "Hansen", "Clark",
        "Walker", "Young", "King", "Wright", "Baker", "Hughes", "Evans", "Turner", "Scott", "Curie", "Turing",
        "Doe", "Lee")
CITIES = ("London", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Athens", "Stockholm", "Helsinki",
          "Amsterdam", "Brussels", "Munich", "Hamburg", "Zurich", "Milan", "Barcelona", "Seville", "Lyon",
          "Marseille", "Copenhagen", "Budapest", "Krakow", "Edinburgh", "Toronto", "Chicago", "Boston", "Seattle",
          "Denver", "Austin", "Miami", "New York", "San Francisco", "Los Angeles", "Mexico City", "Sydney",
          "Melbourne", "Auckland", "Singapore", "Seoul", "Osaka", "Bangkok", "Mumbai", "Delhi", "Cairo", "Nairobi",
          "Cape Town", "Lagos", "Dubai", "Istanbul", "Buenos Aires", "Lima", "Bogota", "Vancouver", "Montreal",
          "Paris", "Manchester", "Berlin", "Oslo", "Rome", "Tokyo")
ITEMS = ("oranges", "bananas", "carrots", "tomatoes", "potatoes", "onions", "lemons", "cucumbers", "pears",
         "peppers", "muffins", "bagels", "croissants", "yogurts", "cookies", "pencils", "erasers", "folders",
         "envelopes", "markers", "batteries", "light bulbs", "towels", "candles", "mugs", "plates", "spoons",
         "forks", "glasses", "socks", "shirts", "scarves", "gloves", "tickets", "books", "magazines", "cables",
         "chargers", "headphones", "keyboards", "apples", "bread", "eggs", "notebooks", "stapler")
DOMAINS = ("example.com", "mail.com", "inbox.org", "post.net", "company.io")
JOBS = ("teacher", "nurse", "engineer", "chef", "pilot", "designer", "doctor", "lawyer", "farmer", "painter",
        "journalist", "architect", "programmer", "musician", "librarian", "electrician", "dentist", "baker")
COLORS = ("red", "blue", "green", "black", "white", "yellow", "grey", "purple", "orange", "brown")
EVENTS = ("team meeting", "birthday party", "book club", "yoga class", "job interview", "dentist appointment",
          "concert", "wedding", "conference talk", "football match", "piano lesson", "product launch")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD")
COMPANIES = ("Acme", "Globex", "Initech", "Umbrella", "Stark Industries", "Wayne Enterprises", "Hooli", "Vandelay",
             "Soylent", "Cyberdyne", "Tyrell", "Wonka")
# What `bench structured` (tools.bench.structured) asks about: drawn by held-out prompts only.
BENCH_VALUES = frozenset({"Marie", "Curie", "Alan", "Turing", "Jane", "Doe", "Tom", "Lee", "Paris", "Manchester",
                          "Berlin", "Oslo", "Rome", "Tokyo", "apples", "bread", "eggs", "notebooks", "stapler"})
POOLS = {"first": FIRST, "last": LAST, "city": CITIES, "item": ITEMS, "domain": DOMAINS, "job": JOBS,
         "color": COLORS, "event": EVENTS, "currency": CURRENCIES, "company": COMPANIES}

STRING = {"type": "string", "maxLength": 40}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
COUNT = {"type": "integer", "minimum": 1}
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
CATEGORIES = {"billing": ("I was charged twice for my subscription", "my invoice shows the wrong amount",
                          "I want a refund for last month", "the discount code was not applied to my bill"),
              "shipping": ("my parcel has not arrived after two weeks", "the box came damaged",
                           "the tracking number does not work", "I received someone else's order"),
              "technical": ("the app freezes when I log in", "I cannot reset my password",
                            "the website shows an error on checkout", "notifications stopped working on my phone"),
              "other": ("I would like to change my username", "do you have a store near me",
                        "can I speak to a manager about a job", "I have a suggestion for a new feature")}
TONES = {"positive": ("Thanks a lot, you are always helpful.", "I love your service otherwise!"),
         "neutral": ("Please let me know.", "I am writing to report it."),
         "negative": ("This is really frustrating!", "I am very disappointed and angry.")}


def constraint_of(prompt: dict) -> Constraint | None:
    """A prompt's constraint (its ``{"kind", "source"}``), None for free text."""
    return Constraint(**prompt["constraint"]) if prompt.get("constraint") else None


def _hash(text: str, seed: int = 0) -> int:
    return zlib.crc32(f"{seed}:{text}".encode())


def _split_pools() -> dict[str, dict[str, tuple[str, ...]]]:
    """{split: {pool: values}}: every HELD_OUT_EVERY-th value in crc32 order (seed-independent) and
    the benchmark's values are held out; a pool keeps at least one value in each split."""
    out = {"train": {}, "held_out": {}}
    for name, values in POOLS.items():
        ordered = sorted(values, key=_hash)
        held = {v for v in ordered[::HELD_OUT_EVERY]} | {v for v in values if v in BENCH_VALUES}
        out["held_out"][name] = tuple(v for v in values if v in held)
        out["train"][name] = tuple(v for v in values if v not in held)
    return out


class _Facts:
    """Values drawn for one prompt, from its split's pools."""

    def __init__(self, rng: random.Random, pools: dict[str, tuple[str, ...]]) -> None:
        self.rng, self.pools = rng, pools

    def pick(self, pool: str) -> str:
        return self.rng.choice(self.pools[pool])

    def person(self) -> str:
        return f"{self.pick('first')} {self.pick('last')}"

    def email(self, name: str) -> str:
        first, _, last = name.lower().partition(" ")
        local = self.rng.choice((f"{first}.{last}", f"{first}", f"{first[0]}{last}",
                                 f"{first}{self.rng.randint(1, 99)}"))
        return f"{local}@{self.pick('domain')}"

    def date(self) -> str:
        return f"{self.rng.randint(2020, 2027)}-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}"


def _obj(props: dict, order: list[str] | None = None) -> dict:
    keys = order or list(props)
    return {"type": "object", "properties": {k: props[k] for k in keys}, "required": keys,
            "additionalProperties": False}


def _person(f: _Facts) -> tuple[str, str, dict]:
    name, age, city = f.person(), f.rng.randint(18, 90), f.pick("city")
    job = f.pick("job")
    fields = {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": STRING}
    text = f.rng.choice((f"{name}, {age}, lives in {city}.", f"{name} is {age} years old and lives in {city}.",
                         f"Meet {name} from {city}, aged {age}.", f"{name} ({age}) moved to {city} last year."))
    extra = f.rng.random()
    if extra < 0.3:
        fields["occupation"] = STRING
        text = text[:-1] + f" and works as a {job}."
    elif extra < 0.5:
        email = f.email(name)
        fields["email"] = {"type": "string", "maxLength": 60}
        text += f" Email: {email}."
    keys = list(fields)
    if f.rng.random() < 0.3:
        f.rng.shuffle(keys)
    renamed = {"name": f.rng.choice(("name", "name", "full_name")), "city": f.rng.choice(("city", "city", "location"))}
    schema = _obj({renamed.get(k, k): v for k, v in fields.items()}, [renamed.get(k, k) for k in keys])
    return "the person", text, schema


def _order(f: _Facts) -> tuple[str, str, dict]:
    name, city, express = f.person(), f.pick("city"), f.rng.random() < 0.5
    email = f.email(name)
    how = f.rng.choice(("express shipping", "next-day delivery")) if express else \
        f.rng.choice(("standard delivery", "regular shipping"))
    text = f.rng.choice((f"{name} ({email}) wants {how} to {city}.", f"{name}, {email}, {how} to {city}.",
                         f"Please send it to {city} with {how}. Customer: {name}, email {email}."))
    customer = _obj({"name": STRING, "email": {"type": "string", "maxLength": 60}})
    shipping = _obj({"city": STRING, "express": {"type": "boolean"}})
    if f.rng.random() < 0.5:
        return "the order", text, _obj({"customer": customer, "shipping": shipping})
    return "the order", text, _obj({"customer": customer, "city": STRING, "express": {"type": "boolean"}})


def _items(f: _Facts) -> tuple[str, str, dict]:
    chosen = f.rng.sample(f.pools["item"], k=min(len(f.pools["item"]), f.rng.randint(1, 4)))
    counts = [f.rng.randint(1, 12) for _ in chosen]
    said = [f"{NUMBERS[n] if n < len(NUMBERS) and f.rng.random() < 0.5 else n} {item}"
            for n, item in zip(counts, chosen)]
    listed = said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]
    text = f.rng.choice((f"{listed}.", f"I need {listed}.", f"Please buy {listed}."))
    key = f.rng.choice(("items", "items", "products"))
    row = _obj({"name": {"type": "string", "maxLength": 30},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99}})
    return "the items", text, _obj({key: {"type": "array", "minItems": 1, "maxItems": 4, "items": row}})


def _ticket(f: _Facts) -> tuple[str, str, dict]:
    category = f.rng.choice(list(CATEGORIES))
    tone = f.rng.choice(list(TONES))
    text = f"'{f.rng.choice(CATEGORIES[category]).capitalize()}. {f.rng.choice(TONES[tone])}'"
    props = {"category": {"enum": list(CATEGORIES)}, "priority": {"enum": ["low", "medium", "high"]},
             "sentiment": {"enum": list(TONES)}}
    keys = list(props)
    if f.rng.random() < 0.3:
        keys = keys[:2] if f.rng.random() < 0.5 else [keys[0], keys[2]]
    return "this support ticket", text, _obj(props, keys)


def _event(f: _Facts) -> tuple[str, str, dict]:
    event, date, city, who = f.pick("event"), f.date(), f.pick("city"), f.person()
    text = f.rng.choice((f"The {event} with {who} is on {date} in {city}.",
                         f"{who} invited me to a {event} in {city} on {date}.",
                         f"Reminder: {event}, {date}, {city}, organised by {who}."))
    props = {"title": STRING, "date": DATE, "city": STRING, "organizer": STRING}
    keys = list(props) if f.rng.random() < 0.5 else ["title", "date", "city"]
    return "the event", text, _obj(props, keys)


def _product(f: _Facts) -> tuple[str, str, dict]:
    company, color, item = f.pick("company"), f.pick("color"), f.pick("item")
    price, stock = round(f.rng.uniform(2, 300), 2), f.rng.random() < 0.6
    text = f.rng.choice((f"{company} sells {color} {item} for {price} dollars; {'in stock' if stock else 'sold out'}.",
                         f"The {color} {item} from {company} cost ${price} and are "
                         f"{'available' if stock else 'out of stock'}."))
    props = {"brand": STRING, "product": STRING, "color": {"enum": list(COLORS)}, "price": {"type": "number"},
             "in_stock": {"type": "boolean"}}
    keys = list(props) if f.rng.random() < 0.5 else ["product", "price", "in_stock"]
    return "the product", text, _obj(props, keys)


TOOLS = (
    Tool("get_weather", "The current weather in a city", json.dumps(_obj(
        {"city": STRING, "unit": {"enum": ["celsius", "fahrenheit"]}}))),
    Tool("search_flights", "Flights between two cities on a date", json.dumps(_obj(
        {"origin": STRING, "destination": STRING, "date": DATE}))),
    Tool("book_hotel", "Book a hotel room", json.dumps(_obj(
        {"city": STRING, "nights": {**COUNT, "maximum": 30}, "guests": {**COUNT, "maximum": 8}}))),
    Tool("send_email", "Send an email", json.dumps(_obj(
        {"to": {"type": "string", "maxLength": 60}, "subject": {"type": "string", "maxLength": 60}}))),
    Tool("convert_currency", "Convert an amount between currencies", json.dumps(_obj(
        {"amount": {"type": "number"}, "from": {"enum": list(CURRENCIES)}, "to": {"enum": list(CURRENCIES)}}))),
    Tool("set_reminder", "Set a reminder", json.dumps(_obj(
        {"text": {"type": "string", "maxLength": 60}, "date": DATE}))),
)


def _tool_request(f: _Facts, tool: Tool) -> str:
    city, other = f.pick("city"), f.pick("city")
    if tool.name == "get_weather":
        return f.rng.choice((f"What's the weather in {city} today?", f"Is it cold in {city} right now?",
                             f"How warm is it in {city}, in fahrenheit?"))
    if tool.name == "search_flights":
        return f.rng.choice((f"Find a flight from {city} to {other} on {f.date()}.",
                             f"I need to fly {city} to {other}, {f.date()}."))
    if tool.name == "book_hotel":
        return f"Book a hotel in {city} for {f.rng.randint(1, 7)} nights for {f.rng.randint(1, 4)} guests."
    if tool.name == "send_email":
        name = f.person()
        return f"Email {f.email(name)} with the subject '{f.pick('event').capitalize()} on {f.date()}'."
    if tool.name == "convert_currency":
        a, b = f.rng.sample(CURRENCIES, 2)
        return f"How much is {f.rng.randint(5, 900)} {a} in {b}?"
    return f"Remind me about the {f.pick('event')} on {f.date()}."


def _tool_prompt(f: _Facts) -> tuple[list[dict], dict, str]:
    offered = f.rng.sample(TOOLS, k=f.rng.randint(2, 4))
    wanted = f.rng.choice(offered)
    constraint = tool_constraint(list(offered), "required", parallel=False)
    messages = [{"role": "system", "content": tools_system_text(list(offered))},
                {"role": "user", "content": _tool_request(f, wanted)}]
    return messages, {"kind": constraint.kind, "source": constraint.source}, wanted.name


# family -> builder of (what is extracted, the text, the schema)
FAMILIES = {"person": _person, "order": _order, "items": _items, "ticket": _ticket, "event": _event,
            "product": _product}
ASKS = ("Extract {what} as JSON: {text}", "Return {what} as JSON. {text}", "{text}\nGive me {what} as JSON.",
        "Turn this into JSON ({what}): {text}")
LIST_ASKS = ("List the shopping items as JSON: {text}", "List the items as JSON: {text}",
             "Write the items as a JSON list: {text}")
CLASSIFY_ASKS = ("Classify this support ticket as JSON: {text}", "Label {what} as JSON: {text}")
TOOL_SHARE = 0.25  # of the prompts, tool calls


def structured_prompts(seed: int = 0, count: int = 1000) -> list[dict]:
    """``count`` prompts, a quarter tool calls and the rest spread over FAMILIES; ids from
    ``ID_BASE``; the same seed and count give the same set."""
    pools = _split_pools()
    out = []
    for i in range(count):
        rng = random.Random(_hash(f"structured:{i}", seed))
        split = "held_out" if _hash(f"split:{i}", seed) % HELD_OUT_SHARE == 0 else "train"
        facts = _Facts(rng, pools[split])
        if rng.random() < TOOL_SHARE:
            messages, constraint, subject = _tool_prompt(facts)
            domain = "tool"
        else:
            domain = rng.choice(list(FAMILIES))
            what, text, schema = FAMILIES[domain](facts)
            asks = LIST_ASKS if domain == "items" else CLASSIFY_ASKS if domain == "ticket" else ASKS
            messages = [{"role": "user", "content": rng.choice(asks).format(what=what, text=text)}]
            constraint, subject = {"kind": "json_schema", "source": json.dumps(schema)}, what
        out.append({"id": ID_BASE + i, "source": "structured", "domain": domain, "subject": subject,
                    "messages": messages, "split": split, "constraint": constraint})
    return out
