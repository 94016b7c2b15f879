"""The chat prompts a draft is distilled on: questions about documentation that ships with Python and Debian.

Contract: ``build_prompts(n, seed)`` returns ``n`` prompts (dicts with ``id``, ``source``,
``messages`` and ``split``), drawn from three local, offline sources:

* docstrings of the running interpreter's standard library (``ast``, no import): modules, public
  functions and classes;
* the language reference topics of ``pydoc_data.topics`` (what ``help("for")`` prints);
* section 1 manual pages under ``/usr/share/man/man1`` (NAME line and DESCRIPTION text, roff
  stripped), when installed.

Each item is put in a varied instruction template (summarise, explain, write an example, answer a
question...). Everything is keyed by stable hashes, so the same machine image yields the same set;
the set used for a shipped draft is saved next to it, so a retrain reads that file and never
depends on what this machine has installed. An item is held out when its *subject* (module, topic
or command) hashes into the held-out bucket, so held-out prompts never share a subject with
training prompts.

What it does not know: tokenization, chat templates, models.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HELD_OUT_EVERY", "Snippet", "build_prompts", "snippets"]

HELD_OUT_EVERY = 20  # a subject is held out when crc32(subject) % 20 == 0 (about 5%)
ROUND_IDS = 100_000  # prompt ids of round r start at r * ROUND_IDS
_MAX_CHARS = 700  # documentation excerpt per prompt
_MAN_ROOT = Path("/usr/share/man/man1")


@dataclass(frozen=True)
class Snippet:
    source: str  # "docstring", "topic" or "man"
    subject: str  # module / topic / command: the unit of the held-out split
    name: str  # what the text documents, e.g. "json.dumps", "for", "ls"
    text: str  # the documentation itself, trimmed


def _trim(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text.strip())
    text = re.sub(r"\n{3,}", "\n\n", text)
    if len(text) <= _MAX_CHARS:
        return text
    cut = text.rfind("\n\n", 0, _MAX_CHARS)
    if cut < _MAX_CHARS // 3:
        cut = text.rfind(". ", 0, _MAX_CHARS) + 1
    return text[: cut if cut > _MAX_CHARS // 3 else _MAX_CHARS].rstrip()


def _stdlib_docstrings() -> Iterator[Snippet]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in ("site-packages", "test", "tests", "idle_test", "__pycache__") or part.startswith("_")
               for part in rel.parts[:-1]) or rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 80:
            yield Snippet("docstring", module, module, _trim(doc))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 60:
                    yield Snippet("docstring", module, f"{module}.{node.name}", _trim(doc))


def _pydoc_topics() -> Iterator[Snippet]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        text = topics[name]
        # Long topics become several snippets, one per section.
        for i, part in enumerate(p for p in re.split(r"\n(?=[A-Z][^\n]{3,60}\n\*{3,})", text) if len(p) > 200):
            yield Snippet("topic", name, name if i == 0 else f"{name} ({i + 1})", _trim(part))


_ROFF_ESCAPES = re.compile(r"\\f[BIRP]|\\f\(..|\\f\[[^]]*\]|\\[/,&|^]|\\\(..|\\\*.")


_FONT_MACRO = re.compile(r"^\.(B|I|BR|RB|IR|RI|BI|IB|SM|SB) ")


def _roff_text(line: str) -> str:
    line = _ROFF_ESCAPES.sub("", line).replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
    return line.replace("\\(aq", "'").replace("\\", "")


def _debian_man_pages(per_package: int) -> list[Path]:
    """Section 1 pages installed by Debian packages (dpkg's file lists), at most ``per_package`` of
    each package (chosen by hash), so one big package cannot crowd out the rest."""
    pages: list[Path] = []
    for listing in sorted(Path("/var/lib/dpkg/info").glob("*.list")):
        try:
            mine = [Path(line) for line in listing.read_text(errors="replace").splitlines()
                    if line.startswith(str(_MAN_ROOT) + "/") and line.endswith(".1.gz")]
        except OSError:
            continue
        mine = sorted((p for p in mine if p.is_file()), key=lambda p: zlib.crc32(p.name.encode()))
        pages.extend(mine[:per_package])
    return sorted(set(pages))


def _man_pages(per_package: int = 12) -> Iterator[Snippet]:
    if not _MAN_ROOT.is_dir():
        return
    for page in _debian_man_pages(per_package):
        try:
            source = gzip.decompress(page.read_bytes()).decode("utf-8", errors="replace")
        except (OSError, EOFError):
            continue
        sections: dict[str, list[str]] = {}
        current = None
        for line in source.splitlines():
            if line.startswith((".SH", ".Sh")):
                current = _roff_text(line[3:].strip().strip('"')).upper()
                sections[current] = []
            elif current is not None and not line.startswith((".", "'")):
                sections[current].append(_roff_text(line))
            elif current is not None and _FONT_MACRO.match(line):
                # .B word / .BR word , : font macros carry running text
                sections[current].append(_roff_text(" ".join(w.strip('"') for w in line.split()[1:])))
            elif current is not None and line.startswith((".PP", ".P", ".LP", ".TP", ".IP")):
                sections[current].append("")
        name = " ".join(sections.get("NAME", [])).strip()
        # Lines of a paragraph run together; "" entries (paragraph macros) separate paragraphs.
        paragraphs = " ".join(line if line else "\n\n" for line in sections.get("DESCRIPTION", []))
        description = "\n\n".join(" ".join(p.split()) for p in paragraphs.split("\n\n") if p.strip())
        command = page.name.removesuffix(".1.gz")
        if " - " not in name or len(description) < 120 or not re.fullmatch(r"[\w.+-]+", command):
            continue
        yield Snippet("man", command, command, _trim(f"{name}\n\n{description}"))


def snippets() -> list[Snippet]:
    return [*_stdlib_docstrings(), *_pydoc_topics(), *_man_pages()]


def _first_sentence(text: str) -> str:
    first = re.split(r"(?<=[.!?])\s|\n\n", text.strip(), maxsplit=1)[0].strip()
    return " ".join(first.split()).rstrip(".")


# Instruction templates per source; {name}, {text}, {summary}, {module} are filled in.
_TEMPLATES: dict[str, list[str]] = {
    "docstring": [
        "Summarize what `{name}` does in a few sentences. Here is its documentation:\n\n{text}",
        "Explain the following Python documentation to a beginner:\n\n{text}",
        "Write a short Python example that uses `{name}`.",
        "What is `{name}` in Python used for?",
        "Write a Python function that does this: {summary}.",
        "Here is the docstring of `{name}`:\n\n{text}\n\nWhat are its key points?",
        "I am reading the Python standard library. What does the `{module}` module do?",
        "Rewrite this documentation in plain English:\n\n{text}",
    ],
    "topic": [
        "Explain this part of the Python language reference in simple terms:\n\n{text}",
        "What does the Python language reference say about `{name}`? Answer briefly.",
        "Give an example of Python code that illustrates this:\n\n{text}",
        "Summarize the following text about Python:\n\n{text}",
    ],
    "man": [
        "What does the `{name}` command do on Linux?",
        "Here is part of the manual page of `{name}`:\n\n{text}\n\nExplain how to use it.",
        "How do I use `{name}`? Give two examples.",
        "Summarize this manual page in a few sentences:\n\n{text}",
        "What is the difference between `{name}` and similar commands? Its manual says:\n\n{text}",
    ],
}
_SYSTEMS = [None, None, None, "You are a concise assistant.", "You are a helpful programming tutor.",
            "Answer in a friendly tone."]


def build_prompts(n: int, seed: int = 0, rounds: int = 1) -> list[dict]:
    """``n`` prompts per round spread over the sources (see the module docstring), in a fixed order.
    Round r asks about the same documentation with the r-th next instruction template and system
    prompt; a later round skips prompts an earlier one already has (round 0 itself may repeat a
    module-level question for several of the module's functions, as the shipped draft was trained
    on). Prompt ids are ``r * ROUND_IDS + i``."""
    pool = snippets()
    keyed = sorted(pool, key=lambda s: zlib.crc32(f"{seed}:{s.source}:{s.name}".encode()))
    by_source: dict[str, list[Snippet]] = {}
    for s in keyed:
        by_source.setdefault(s.source, []).append(s)
    # Round-robin over sources so no single source dominates.
    order: list[Snippet] = []
    queues = [list(v) for _, v in sorted(by_source.items())]
    while len(order) < n and any(queues):
        for q in queues:
            if q and len(order) < n:
                order.append(q.pop(0))
    prompts: list[dict] = []
    seen: set[str] = set()
    for r in range(rounds):
        for i, s in enumerate(order):
            h = zlib.crc32(f"{seed}:template:{s.name}".encode())
            templates = _TEMPLATES[s.source]
            content = templates[(h + r) % len(templates)].format(name=s.name, text=s.text,
                                                                 summary=_first_sentence(s.text), module=s.subject)
            system = _SYSTEMS[(h // 7 + r) % len(_SYSTEMS)]
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": content}]
            key = json.dumps(messages)
            if r and key in seen:  # e.g. a question about a module, asked for each of its functions
                continue
            seen.add(key)
            split = "held_out" if zlib.crc32(s.subject.encode()) % HELD_OUT_EVERY == 0 else "train"
            prompts.append({"id": r * ROUND_IDS + i, "source": s.source, "subject": s.subject, "messages": messages,
                            "split": split})
    return prompts
