"""Everyday chat prompts for distilling a draft: what users ask a small assistant, across domains.

Contract: ``everyday_prompts(seed)`` returns prompts (dicts with ``id``, ``source`` "everyday",
``domain``, ``subject``, ``messages`` and ``split``) built offline from the lists below: for each
domain (general knowledge, how-to, writing, advice, science, history, code, math, conversation) a
list of subjects and a list of request templates, every subject asked in ``PER_SUBJECT`` of its
domain's templates (chosen by a stable hash, so the same seed gives the same set). No dataset can
be downloaded here, so the variety comes from the cross product; what the model answers comes from
the target itself (self-distillation, tools.distill.data).

Held out by subject: a subject whose crc32 falls in the held-out bucket is asked only in the
held-out split, so a held-out prompt never shares its subject with a training prompt; every
domain has held-out subjects (the split is per domain, ``HELD_OUT_EVERY``).

What it does not know: tokenization, chat templates, models.
"""

from __future__ import annotations

import zlib

__all__ = ["DOMAINS", "HELD_OUT_EVERY", "PER_SUBJECT", "everyday_prompts"]

HELD_OUT_EVERY = 8  # within a domain, every 8th subject in crc32 order is held out (12.5%)
PER_SUBJECT = 6  # templates each subject is asked in
ID_BASE = 1_000_000  # prompt ids, apart from the documentation prompts' (tools.distill.prompts)

# domain -> (templates with {s} for the subject, subjects)
DOMAINS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "general": (
        ("What is {s}?", "Tell me about {s}.", "Explain {s} in simple terms.", "Why is {s} important?",
         "Give me three interesting facts about {s}.", "How would you describe {s} to a child?",
         "What should everyone know about {s}?", "Summarize what {s} is in a short paragraph.",
         "What are the pros and cons of {s}?", "Where does {s} come from?"),
        ("the Olympic Games", "coffee", "the internet", "public libraries", "tea ceremonies", "the stock market",
         "credit cards", "recycling", "the United Nations", "jazz music", "chess", "the Eiffel Tower",
         "electric cars", "social media", "the Amazon rainforest", "volcanoes", "the moon landing",
         "vaccines", "bees", "the Great Wall of China", "passports", "time zones", "the metric system",
         "elections", "museums", "national parks", "airplanes", "the postal service", "football", "yoga",
         "chocolate", "the piano", "sushi", "the calendar", "bicycles", "trains", "newspapers", "podcasts",
         "video games", "the weather forecast"),
    ),
    "howto": (
        ("How do I {s}?", "What is the best way to {s}?", "Give me step-by-step instructions to {s}.",
         "I'm a beginner. How can I {s}?", "What are some tips to {s}?", "What mistakes should I avoid when I {s}?",
         "Can you explain how to {s} quickly?", "What do I need to {s}?"),
        ("make pancakes", "change a flat tire", "start running", "grow tomatoes", "save money each month",
         "learn a new language", "write a resume", "clean a laptop keyboard", "boil an egg", "fall asleep faster",
         "plan a trip", "paint a room", "make a budget", "bake bread", "tie a tie", "improve my handwriting",
         "take better photos with my phone", "organize my closet", "prepare for a job interview", "make friends in a new city",
         "keep houseplants alive", "learn to swim", "study for an exam", "cook rice", "remove a coffee stain",
         "back up my computer", "train a puppy", "start a vegetable garden", "meditate", "make a cup of tea",
         "set up a home Wi-Fi network", "write a thank-you note", "wash a wool sweater", "reduce screen time",
         "learn to play guitar", "make a smoothie", "stay focused while working from home", "fix a leaky faucet",
         "give a good presentation", "choose a good watermelon"),
    ),
    "writing": (
        ("Write a short story about {s}.", "Write a poem about {s}.", "Write a haiku about {s}.",
         "Write a short blog post about {s}.", "Write a friendly email to a colleague about {s}.",
         "Write a product description for {s}.", "Write a limerick about {s}.",
         "Write the opening paragraph of a novel about {s}.", "Write a short speech about {s}.",
         "Write a funny tweet about {s}."),
        ("a lost cat", "the first day of school", "a robot who learns to cook", "autumn leaves", "a rainy Monday",
         "a dragon afraid of fire", "friendship", "the ocean", "a small bakery", "a journey to Mars",
         "an old lighthouse", "a birthday surprise", "winter mornings", "a detective in Paris", "a talking tree",
         "a summer road trip", "the last day of summer", "a time traveler", "a village festival", "a broken clock",
         "a new smartphone", "a mountain hike", "a city at night", "a haunted library", "a lazy Sunday",
         "a brave little mouse", "the stars", "a garden in spring", "a football match", "a cup of coffee",
         "moving to a new house", "a snowstorm", "a pirate ship", "a wise old owl", "learning to ride a bike"),
    ),
    "advice": (
        ("I need advice about {s}.", "What should I do about {s}?", "Any tips for {s}?",
         "How can I deal with {s}?", "My friend is struggling with {s}. How can I help?",
         "What is a healthy way to handle {s}?", "Can you give me some advice on {s}?",
         "I'm worried about {s}. What do you suggest?"),
        ("stress at work", "a difficult roommate", "procrastination", "public speaking anxiety", "a breakup",
         "choosing a college major", "asking for a raise", "feeling lonely", "managing my time", "eating healthier",
         "a long-distance relationship", "starting a small business", "getting more sleep", "saving for retirement",
         "a noisy neighbor", "changing careers", "staying motivated to exercise", "talking to my parents about money",
         "burnout", "making a hard decision", "setting boundaries", "a job rejection", "moving abroad",
         "raising a teenager", "spending less on clothes", "being more confident", "a conflict with my boss",
         "studying while working", "planning a wedding on a budget", "caring for an elderly parent",
         "learning to say no", "buying my first car", "handling criticism", "keeping in touch with old friends"),
    ),
    "science": (
        ("How does {s} work?", "Explain {s}.", "What causes {s}?", "Can you explain {s} to a high school student?",
         "What is the science behind {s}?", "Why does {s} happen?", "What did scientists learn about {s}?",
         "What is a simple experiment that shows {s}?"),
        ("photosynthesis", "gravity", "rainbows", "the water cycle", "earthquakes", "black holes", "DNA",
         "the immune system", "climate change", "magnets", "sound waves", "the seasons", "evolution",
         "electricity", "the human heart", "lightning", "tides", "plate tectonics", "the greenhouse effect",
         "nuclear energy", "vision in the human eye", "fermentation", "the speed of light", "antibiotics",
         "solar panels", "the digestive system", "clouds", "friction", "the periodic table", "sleep",
         "batteries", "the big bang", "ocean currents", "muscles", "static electricity", "bird migration",
         "the ozone layer", "atoms", "memory in the brain", "rust"),
    ),
    "history": (
        ("Tell me about {s}.", "What happened during {s}?", "Why was {s} important?", "What caused {s}?",
         "Summarize {s} in a few sentences.", "What were the consequences of {s}?",
         "Who were the key people in {s}?", "What can we learn from {s}?"),
        ("the Roman Empire", "the French Revolution", "the Industrial Revolution", "ancient Egypt",
         "the Renaissance", "the printing press", "the Silk Road", "the Cold War", "the Vikings",
         "the American Revolution", "the fall of the Berlin Wall", "the Aztec Empire", "World War I",
         "the invention of the telephone", "ancient Greece", "the Black Death", "the space race",
         "the Ottoman Empire", "the Meiji Restoration", "the abolition of slavery", "the Great Depression",
         "the Mongol Empire", "the discovery of penicillin", "the Magna Carta", "the Ming dynasty",
         "the age of exploration", "the women's suffrage movement", "the building of the pyramids",
         "the Protestant Reformation", "the first Olympic Games", "the invention of writing",
         "the Apollo 11 mission", "the Inca Empire", "the Hundred Years' War"),
    ),
    "code": (
        ("Write a Python function to {s}.", "How do I {s} in Python?", "Show me JavaScript code to {s}.",
         "Explain how to {s} in Python, with an example.", "Write a short program that can {s}.",
         "What is the simplest way to {s} in Python?", "Can you write a function that will {s} and explain it?",
         "I'm learning to code. How would I {s}?"),
        ("reverse a string", "check if a number is prime", "sort a list of names", "read a text file",
         "count the words in a sentence", "find the largest number in a list", "convert Celsius to Fahrenheit",
         "remove duplicates from a list", "check if a word is a palindrome", "compute a factorial",
         "generate a random password", "merge two dictionaries", "find the average of a list",
         "print the Fibonacci sequence", "download a web page", "parse a JSON string", "validate an email address",
         "count vowels in a string", "flatten a nested list", "capitalize every word in a sentence",
         "sum the digits of a number", "find common elements of two lists", "write a simple calculator",
         "measure how long a function takes", "create a class for a bank account", "sort a dictionary by value",
         "convert a list to a string", "get the current date and time", "check if a year is a leap year",
         "split a sentence into words", "make a to-do list program", "implement binary search",
         "read a CSV file", "draw a triangle of stars"),
    ),
    "math": (
        ("What is {s}?", "Explain {s} with an example.", "How do I calculate {s}?",
         "Can you help me understand {s}?", "Solve a simple problem about {s} and explain each step.",
         "Why does {s} work?", "Give me a practice question about {s} with the answer.",
         "What is an easy way to remember {s}?"),
        ("the Pythagorean theorem", "percentages", "fractions", "the area of a circle", "compound interest",
         "long division", "probability", "the mean, median and mode", "prime numbers", "negative numbers",
         "square roots", "the slope of a line", "solving a linear equation", "the volume of a cube",
         "multiplying fractions", "ratios", "simple interest", "exponents", "the order of operations",
         "converting decimals to fractions", "the perimeter of a rectangle", "angles in a triangle",
         "rounding numbers", "the quadratic formula", "averages", "unit conversion", "a 15 percent tip",
         "the distance between two points", "factoring numbers", "standard deviation", "logarithms",
         "the circumference of a circle", "speed, distance and time", "Roman numerals"),
    ),
    "conversation": (
        ("{s}", ),
        ("Hi! How are you today?", "Can you recommend a good book?", "What's your favorite season and why?",
         "Tell me a joke.", "What should I cook for dinner tonight?", "I'm bored. Any ideas?",
         "Can you suggest a name for my new puppy?", "What's a fun weekend activity?",
         "What movie should I watch tonight?", "Good morning! Any tips to start the day well?",
         "Can you help me pick a gift for my mom?", "What are some good hobbies to try?",
         "I just got a promotion!", "It's raining all day here. What can I do inside?",
         "Do you have any fun facts?", "What's a good icebreaker question?", "Can you recommend some music to relax?",
         "I can't decide between a cat and a dog. Help!", "What are some healthy snacks?",
         "Tell me something that will make me smile.", "What's a good game to play with friends?",
         "Can you suggest a quick workout?", "I'm learning to cook. What should I make first?",
         "What should I pack for a beach day?", "Can you give me a riddle?", "What's a nice way to say thank you?",
         "Let's chat about space.", "What are you able to help me with?", "Can you describe a perfect day?",
         "Suggest a theme for a birthday party.", "What is a good habit to start this year?",
         "How do I make small talk at a party?", "What's something interesting to learn this week?",
         "Give me a motivational quote and explain it.", "What are fun things to do in a big city?",
         "I'm nervous about tomorrow. Can you cheer me up?"),
    ),
}


def _hash(text: str, seed: int) -> int:
    return zlib.crc32(f"{seed}:{text}".encode())


def _held_out(domain: str, subjects: tuple[str, ...]) -> set[str]:
    """Every HELD_OUT_EVERY-th subject of the domain in crc32 order (seed-independent: the split
    is a property of the subject, so retraining with another seed keeps it)."""
    ordered = sorted(subjects, key=lambda s: _hash(s, 0))
    return set(ordered[::HELD_OUT_EVERY])


def everyday_prompts(seed: int = 0, per_subject: int = PER_SUBJECT) -> list[dict]:
    """Every subject of every domain in ``per_subject`` of its domain's templates (all of them
    when it has fewer), as single-turn chat prompts; ids from ``ID_BASE``."""
    out = []
    for domain, (templates, subjects) in DOMAINS.items():
        held = _held_out(domain, subjects)
        for subject in subjects:
            chosen = sorted(templates, key=lambda t: _hash(f"{domain}|{subject}|{t}", seed))[:per_subject]
            for template in chosen:
                out.append({"id": ID_BASE + len(out), "source": "everyday", "domain": domain, "subject": subject,
                            "messages": [{"role": "user", "content": template.format(s=subject)}],
                            "split": "held_out" if subject in held else "train"})
    return out
