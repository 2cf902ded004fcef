"""Generic English training texts for the learned scorer of a real model (SmolLM2 and the like).

    python -m kvpop_train.scorer.english_texts --out build/scorer-texts/english.jsonl [--num 192]

Contexts are the docstrings of CPython's standard library modules (every module, class and function
docstring of a module, in source order), read with `ast` from the interpreter's own files: English
prose about many topics, identical on every machine. `pydoc_data` is left out: it is the haystack of
the English benchmark (kvpop_eval/english_tasks.py), and none of the benchmark's task families
(pass keys, magic numbers, variable chains, generated people) appear here.

Each context is continued by generic recall questions about sentences spread over it ("Which sentence
above mentions X?" answered by quoting it), so a token's future attention reflects content that is
read back later, not the position of a question known in advance. Which sentences are asked about
(`--questions-about`): `random` ones; or `values` first, every sentence that states a value (a number
of two or more digits or a quoted literal, as the docstrings themselves write them), then random ones;
or `value-only`, the same sentences asked for their value alone ("Which value does the text above give
where it mentions X?" answered by the value), the rest quoted. Random questions make every sentence
equally likely to be read back, so the targets carry no signal about content; a reader is asked later
for the specific things a text states, and the value questions say so. Records are
{"context", "continuations"}, the format `python -m kvpop_train.scorer.train --texts` reads.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

EXCLUDED = ("pydoc_data", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages")


def stdlib_docstrings() -> dict[str, list[str]]:
    """Module name -> its docstrings, in source order (only modules with enough prose)."""
    return source_docstrings(Path(sysconfig.get_paths()["stdlib"]))


def package_docstrings(packages: list[str]) -> dict[str, list[str]]:
    """The same for installed packages (their versions are pinned in requirements*.txt, so the texts are
    reproducible); module names are prefixed with the package's."""
    modules: dict[str, list[str]] = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{package!r} is not an installed package")
        for location in spec.submodule_search_locations:
            found = source_docstrings(Path(location))
            modules.update({f"{package}.{name}": docstrings for name, docstrings in found.items()})
    return modules


def source_docstrings(root: Path) -> dict[str, list[str]]:
    """Module name (relative to `root`) -> every module, class and function docstring of at least 12
    words, whitespace collapsed, in source order; modules with under 2,000 characters of it are left out."""
    modules: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in EXCLUDED for part in relative.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        docstrings = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text.split()) >= 12:
                    docstrings.append(" ".join(text.split()))
        if sum(len(text) for text in docstrings) >= 2000:
            modules[".".join(relative.with_suffix("").parts)] = docstrings
    return modules


# A sentence that states a value: a number of two or more digits, or a quoted literal ('utf-8', "GET").
VALUE = re.compile(r"\b\d{2,}\b|'[^'\s]{2,30}'|\"[^\"\s]{2,30}\"")
ABOUT = ("random", "values", "value-only")


def split_sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text)


def recall_questions(context: str, rng: random.Random, count: int, about: str = "random") -> list[str]:
    """Recall questions about `count` sentences of `context`, each answered by quoting the sentence
    (with about="value-only", a sentence that states a value is answered by its value(s) alone).

    about="random": any sentences. about="values" / "value-only": first every sentence that states a
    value (VALUE), then random ones up to `count`: what a reader is asked to recall later is mostly the
    specific, the numbers and names, rarely the connecting prose, so the targets should say so."""
    if about not in ABOUT:
        raise ValueError(f"about must be one of {ABOUT}, not {about!r}")
    sentences = [s for s in split_sentences(context) if 6 <= len(s.split()) <= 40]
    valued = [i for i, sentence in enumerate(sentences) if about != "random" and VALUE.search(sentence)]
    rest = [i for i in range(len(sentences)) if i not in valued]
    picked = sorted(valued + rng.sample(rest, max(0, min(count - len(valued), len(rest)))))
    questions = []
    for index in picked:
        words = [w.strip(".,;:()'\"") for w in sentences[index].split()]
        words = [w for w in words if len(w) >= 6 and w.isalpha()]
        values = VALUE.findall(sentences[index]) if about == "value-only" else []
        if words and values:
            questions.append(f"\n\nQuestion: Which value does the text above give where it mentions \"{rng.choice(words)}\"?"
                             f"\nAnswer: {' '.join(values)}")
        elif words:
            questions.append(f"\n\nQuestion: Which sentence above mentions \"{rng.choice(words)}\"?\nAnswer: {sentences[index]}")
    return questions


def english_texts(
    num: int, max_chars: int = 12000, questions: int = 8, seed: int = 0, about: str = "random", min_values: int = 0,
    windows: int = 1, packages: dict[str, int] | None = None,
) -> list[dict]:
    """`num` contexts of up to `max_chars` characters (~3k tokens), each with recall continuations
    (`about`: see recall_questions); contexts with fewer than `min_values` value sentences are skipped.

    A module gives up to `windows` contexts: its docstrings cut into consecutive runs of up to `max_chars`.
    Every module's first run comes first (so a larger `windows` only appends texts), then every second one.
    `packages`: installed package -> how many of its contexts follow the standard library's, drawn at random
    (seeded) from all of its contexts (`package_docstrings`)."""
    packages = packages or {}
    rng = random.Random(seed)
    modules = stdlib_docstrings()
    names = sorted(modules)
    rng.shuffle(names)
    extra = package_docstrings(list(packages))
    extra_names = sorted(extra)
    random.Random(seed + 1).shuffle(extra_names)  # apart from `rng`: the stdlib's texts do not change
    stdlib_runs = {name: _runs(modules[name], max_chars) for name in names}
    package_runs = {name: _runs(extra[name], max_chars) for name in extra_names}
    drawn_from: dict[str, list[dict]] = {package: [] for package in packages}  # package -> its contexts
    records = []
    passes = [(stdlib_runs, names, w) for w in range(windows)] + [(package_runs, extra_names, w) for w in range(windows)]
    for runs, group, window in passes:
        from_package = runs is package_runs
        for name in group:
            if window >= len(runs[name]):
                continue
            context = runs[name][window]
            if sum(1 for sentence in split_sentences(context) if VALUE.search(sentence)) < min_values:
                continue
            continuations = recall_questions(context, rng, questions, about)
            if len(context) >= 2000 and continuations:
                source = ("" if from_package else "stdlib:") + name + (f"#{window}" if window else "")
                record = {"source": source, "context": context, "continuations": continuations}
                (drawn_from[name.partition(".")[0]] if from_package else records).append(record)
            if not packages and len(records) == num:
                return records
    draw = random.Random(seed)
    for package, count in packages.items():
        records += draw.sample(drawn_from[package], min(count, len(drawn_from[package])))
    return records[:num]


def _runs(docstrings: list[str], max_chars: int) -> list[str]:
    """Docstrings joined into consecutive contexts of up to `max_chars` (one longer docstring is dropped)."""
    runs, context = [], ""
    for text in docstrings:
        if len(context) + len(text) + 2 > max_chars and context:
            runs.append(context)
            context = ""
        if len(text) > max_chars:
            continue
        context += ("\n\n" if context else "") + text
    if context:
        runs.append(context)
    return runs


def _counts(spec: str) -> dict[str, int]:
    """"numpy:30,torch:30" -> {"numpy": 30, "torch": 30}."""
    counts = {}
    for item in filter(None, spec.split(",")):
        name, _, count = item.partition(":")
        if not count.isdigit():
            raise argparse.ArgumentTypeError(f"--packages wants NAME:COUNT items, got {item!r}")
        counts[name] = int(count)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpop_train.scorer.english_texts", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num", type=int, default=192)
    parser.add_argument("--max-chars", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions-about", choices=ABOUT, default="random",
                        help="which sentences the recall questions ask for (values: every one stating a number or literal first)")
    parser.add_argument("--min-values", type=int, default=0, help="skip contexts with fewer value sentences")
    parser.add_argument("--windows", type=int, default=1, help="contexts per module (consecutive runs of its docstrings)")
    parser.add_argument("--packages", type=_counts, default={},
                        help="installed packages whose docstrings follow the stdlib's, as NAME:COUNT,... (COUNT contexts each)")
    args = parser.parse_args(argv)
    records = english_texts(args.num, args.max_chars, seed=args.seed, about=args.questions_about, min_values=args.min_values,
                            windows=args.windows, packages=args.packages)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"wrote {len(records)} contexts ({sum(len(r['context']) for r in records)} characters) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
