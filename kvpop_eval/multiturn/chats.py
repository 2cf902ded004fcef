"""The chats: over several turns a user pastes passages of text and asks for small things, one turn states
the fact that the last turn asks for, and other turns state facts of the same kind (other codes, cities,
names, passwords) about other subjects.

A chat is seeded by (split, index): the asked fact's turn is drawn uniformly among the statement turns, its
kind and subject at random; `competitors` other statement turns each state a fact of the same kind about
another subject, `other_facts` ones a fact of another kind. Every statement turn is a lead-in, a passage of
at most `passage_chars` characters and a request, its fact (if any) before or after the passage. The question
is the subject's plain question, with no words of the answer handed over.

Splits: the passages come from kvpop_eval.text_sources, validation's from the reference, readme and chat
sources, test's from the held-out ones only (legal, changelog), which no design choice, scorer or head
calibration ever read; the subjects (each fact's statements and question) and the requests are split in two
by a stable hash; values come from kvpop_eval.english_tasks' split pools (numbers from the split's seed).
A test chat shares no passage source, subject, request or value with validation's.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from functools import lru_cache

from kvpop_eval import text_sources
from kvpop_eval.english_tasks import SPLITS as POOL_SPLITS, _pool
from kvpop_eval.text_sources import HELD_OUT

SPLITS = ("validation", "test")


@dataclass(frozen=True)
class Subject:
    """One fact a user may state: its phrasings (`{}` the value) and the question that asks for it."""

    statements: tuple[str, ...]
    question: str


SUBJECTS: dict[str, tuple[Subject, ...]] = {
    "number": (
        Subject(("The code of my locker at the gym is {}.", "My locker at the gym opens with the code {}."),
                "What is the code of my locker at the gym?"),
        Subject(("The combination of my bike lock is {}.", "I lock my bike with the combination {}."),
                "What is the combination of my bike lock?"),
        Subject(("The door code of my building is {}.", "To get into my building I type {} at the front door."),
                "What is the door code of my building?"),
        Subject(("The tracking number of my parcel is {}.", "My parcel can be followed online with the tracking number {}."),
                "What is the tracking number of my parcel?"),
        Subject(("My library card number is {}.", "The number printed on my library card is {}."),
                "What is my library card number?"),
        Subject(("My car insurance policy number is {}.", "The policy number on my car insurance papers is {}."),
                "What is my car insurance policy number?"),
        Subject(("The safe in my hotel room opens with {}.", "I set the safe in my hotel room to {}."),
                "Which code opens the safe in my hotel room?"),
        Subject(("My employee number at work is {}.", "At work I am employee number {}."),
                "What is my employee number at work?"),
    ),
    "city": (
        Subject(("My sister works in the city of {}.", "My sister found a job in the city of {}."),
                "In which city does my sister work?"),
        Subject(("My brother lives in the city of {}.", "My brother has an apartment in the city of {}."),
                "In which city does my brother live?"),
        Subject(("My best friend just moved to the city of {}.", "My best friend packed up and moved to the city of {}."),
                "To which city did my best friend move?"),
        Subject(("My parents grew up in the city of {}.", "Both of my parents were raised in the city of {}."),
                "In which city did my parents grow up?"),
        Subject(("Next month I fly to the city of {} for a conference.", "The conference I am going to is in the city of {}."),
                "In which city is the conference I am going to?"),
        Subject(("My cousin studies in the city of {}.", "My cousin goes to university in the city of {}."),
                "In which city does my cousin study?"),
        Subject(("I was born in the city of {}.", "The city where I was born is {}."),
                "In which city was I born?"),
        Subject(("The head office of my company is in the city of {}.", "My company has its head office in the city of {}."),
                "In which city is the head office of my company?"),
    ),
    "person": (
        Subject(("My dentist is called {}.", "I have been going to a dentist named {} for years."),
                "What is my dentist's name?"),
        Subject(("My new neighbour's name is {}.", "The neighbour who just moved in next door is called {}."),
                "What is my new neighbour's name?"),
        Subject(("My manager at work is called {}.", "At work I report to a manager named {}."),
                "What is my manager's name?"),
        Subject(("Our dog is named {}.", "We called our dog {}."),
                "What is our dog's name?"),
        Subject(("My piano teacher is called {}.", "I take piano lessons with a teacher named {}."),
                "What is my piano teacher's name?"),
        Subject(("My landlord's name is {}.", "The apartment belongs to a landlord called {}."),
                "What is my landlord's name?"),
        Subject(("The plumber who fixed our sink is called {}.", "A plumber named {} fixed our sink."),
                "What is the name of the plumber who fixed our sink?"),
        Subject(("My daughter's best friend is called {}.", "My daughter spends every afternoon with her best friend {}."),
                "What is the name of my daughter's best friend?"),
    ),
    "password": (
        Subject(("The wifi password at home is {}.", "At home the wifi password is {}."),
                "What is the wifi password at home?"),
        Subject(("The password of my laptop is {}.", "I unlock my laptop with the password {}."),
                "What is the password of my laptop?"),
        Subject(("The password for my bank's phone service is {}.", "When I call my bank I give the password {}."),
                "What is the password for my bank's phone service?"),
        Subject(("The password of our family photo album online is {}.", "Our family photo album online is protected by the password {}."),
                "What is the password of our family photo album online?"),
        Subject(("The code word for picking up my kids from school is {}.", "Whoever picks up my kids from school must say the code word {}."),
                "What is the code word for picking up my kids from school?"),
        Subject(("The password of the office printer is {}.", "The office printer asks for the password {}."),
                "What is the password of the office printer?"),
    ),
}
KINDS = tuple(SUBJECTS)
ANSWER_AS = {"number": "the number", "city": "the city", "person": "the name", "password": "the password"}
CUE = "Going back to what I told you earlier: "
SYSTEM = ("You are a helpful assistant. Over several messages the user shares passages of text and details of their life. "
          "Keep every detail in mind; when the user later asks about one, answer with it directly.")
POOLS = {"city": "city", "person": "person", "password": "key"}  # english_tasks' pool of each kind's values

# What a statement turn asks of the assistant after telling it about the day: something a small model answers
# helpfully (a turn that only tells it things draws apologies from SmolLM2-135M, which its later replies repeat).
REQUESTS = (
    "Can you give me a tip for sleeping better?",
    "What is a simple way to keep basil alive on a windowsill?",
    "How can I make my mornings less rushed?",
    "What is a good stretch for a stiff neck?",
    "Can you suggest a quick vegetarian dinner?",
    "How do I remove a coffee stain from a shirt?",
    "What is an easy way to save a little money each week?",
    "Can you recommend a relaxing activity for a rainy evening?",
    "How often should I water a cactus?",
    "What can I do to stay focused while working from home?",
    "How do I make a cup of tea taste less bitter?",
    "What is a good way to start learning to draw?",
    "Can you suggest a short exercise routine I can do at home?",
    "How can I keep my kitchen knives sharp?",
    "What should I pack for a weekend hiking trip?",
    "How do I stop my glasses from fogging up?",
    "What is a healthy snack for the afternoon?",
    "How can I make my small apartment feel bigger?",
    "What is a polite way to decline an invitation?",
    "How do I keep bread fresh for longer?",
    "Can you suggest a board game for four people?",
    "What is a good habit to build this month?",
    "How can I remember to drink enough water?",
    "What is the best way to clean a wooden table?",
    "How do I keep a conversation going with someone I just met?",
    "Can you give me an idea for a weekend day trip?",
    "How can I make a boring commute more pleasant?",
    "What is a simple way to organise my wardrobe?",
    "How do I calm down before a presentation?",
    "What vegetables are easy to grow on a balcony?",
    "How can I get better at remembering people's names?",
    "What is a nice gift for a friend who loves cooking?",
    "How do I keep my phone battery healthy?",
    "Can you suggest a way to unwind after a long day?",
    "What is a good way to practise a new language every day?",
    "How do I fix a squeaky door?",
    "What can I cook with leftover rice?",
    "How do I make my houseplants grow fuller?",
    "What is a fun thing to do with kids on a Sunday?",
    "How can I write a short thank-you note?",
)


# What a statement turn asks instead when the chat's shape acknowledges: a short receipt, so the model's replies
# stay short and the chat stays a chat about what the user tells.
ACKNOWLEDGE = (
    "Just say OK for now.", "Reply with OK if you got it.", "No need to comment, just say OK.", "Only answer OK for now.",
    "Please just confirm with OK.", "A short OK is enough as a reply.", "Say OK and wait for my next message.",
    "Answer with OK, nothing more.", "Just acknowledge with OK.", "Reply OK so I know you read it.",
    "Nothing to do yet, just reply OK.", "Give me a quick OK.",
)

REMEMBER = " Please remember that."
LEADS = ("Here is something I am reading today:", "I came across this passage:", "Look at this text I have to go through:",
         "This is part of what I read this morning:")
SOURCES = {"validation": ("reference", "readme", "chat"), "test": HELD_OUT}  # the passages' text sources


def _half(text: str) -> str:
    """Validation or test: a stable hash of a request (the same on every machine)."""
    return SPLITS[int(hashlib.sha256(f"chat-filler:{text}".encode()).hexdigest()[:8], 16) % 2]


@lru_cache(maxsize=None)
def subjects(kind: str, split: str) -> tuple[Subject, ...]:
    """The split's subjects of `kind`: ordered by a stable hash of their question, every other one (so each
    split holds half of every kind's subjects, and a test chat states and asks nothing validation's do)."""
    ordered = sorted(SUBJECTS[kind], key=lambda subject: hashlib.sha256(f"chat-subject:{subject.question}".encode()).hexdigest())
    return tuple(ordered[SPLITS.index(split)::2])


@dataclass(frozen=True)
class ChatShape:
    """What every chat of a task set has in common (chosen on validation)."""

    statement_turns: int = 5  # user turns before the question
    passage_chars: int = 400  # at most, the pasted passage of each statement turn
    competitors: int = 2  # statement turns that state another fact of the asked kind
    other_facts: int = 1  # statement turns that state a fact of another kind
    cue: int = 0  # 1: the question opens with CUE (a pointer to the past turns, no word of the answer)
    acknowledge: int = 0  # 1: statement turns ask for an OK (ACKNOWLEDGE) instead of a tip (REQUESTS)
    system: int = 0  # 1: the chat opens with SYSTEM as its system prompt (0: the chat template's default)

    def __post_init__(self) -> None:
        if self.statement_turns < 2 or self.passage_chars < 0 or self.other_facts < 0 \
                or not 0 <= self.competitors < min(len(subjects(kind, split)) for kind in KINDS for split in SPLITS) \
                or 1 + self.competitors + self.other_facts > self.statement_turns:
            raise ValueError(f"a chat needs >= 2 statement turns holding the asked fact, its competitors (fewer than each "
                             f"kind's subjects in a split) and the other facts, got {self}")


def _passage(split: str, rng: random.Random, chars: int) -> str:
    """A pasted passage of one of the split's sources: a block cut to at most `chars` at a sentence or line end."""
    if chars == 0:
        return ""
    source = rng.choice(SOURCES[split])
    block = rng.choice(text_sources.blocks(source, split))
    if len(block) <= chars:
        return block
    head = block[:chars]
    cut = max(head.rfind(". ") + 1, head.rfind("\n"))
    return head[:cut].rstrip() if cut > chars // 3 else head.rsplit(" ", 1)[0]


@lru_cache(maxsize=None)
def _values(kind: str, split: str) -> tuple[str, ...]:
    """The split's values of `kind`, without any that another split has as a value of any kind (a name may be
    a person in one split's pool and a city in another's)."""
    elsewhere = {value for other in POOL_SPLITS if other != split for pool in set(POOLS.values()) for value in _pool(pool, other)}
    return tuple(value for value in _pool(POOLS[kind], split) if value not in elsewhere)


def _value(kind: str, split: str, rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randrange(100000, 1000000)) if kind == "number" else rng.choice(_values(kind, split))
        if value not in taken:
            taken.add(value)
            return value


def make_chat(split: str, index: int, shape: ChatShape) -> dict:
    """One chat: its user turns (the last the question), the answer, and the competing values of its kind."""
    if split not in SPLITS:
        raise ValueError(f"chats exist for splits {SPLITS}, got {split!r}")
    rng = random.Random(f"multiturn-v2:{split}:{index}")
    kind = rng.choice(KINDS)
    asked_kind = rng.sample(subjects(kind, split), 1 + shape.competitors)
    other_kinds = [rng.choice([k for k in KINDS if k != kind]) for _ in range(shape.other_facts)]
    taken: set[str] = set()
    facts = [(kind, subject, _value(kind, split, rng, taken)) for subject in asked_kind]
    facts += [(other, rng.choice(subjects(other, split)), _value(other, split, rng, taken)) for other in other_kinds]
    turn_of = rng.sample(range(shape.statement_turns), len(facts))  # facts[0] (the asked one) at a uniform turn
    asks = ACKNOWLEDGE if shape.acknowledge else REQUESTS
    pool = [s for s in asks if _half(s) == split]
    requests = rng.sample(pool, shape.statement_turns) if len(pool) >= shape.statement_turns else \
        [rng.choice(pool) for _ in range(shape.statement_turns)]
    users = []
    for turn in range(shape.statement_turns):
        parts = [rng.choice(LEADS) + "\n\n" + _passage(split, rng, shape.passage_chars)] if shape.passage_chars else []
        if turn in turn_of:
            _, subject, value = facts[turn_of.index(turn)]
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(subject.statements).format(value) + REMEMBER)
        users.append("\n\n".join([*parts, requests[turn]]))
    users.append(CUE * shape.cue + f"{facts[0][1].question} Answer with {ANSWER_AS[kind]} only.")
    return {"split": split, "index": index, "shape": asdict(shape), "kind": kind, "users": users,
            **({"system": SYSTEM} if shape.system else {}),
            "answer": facts[0][2], "fact_turn": turn_of[0], "competing": [value for k, _, value in facts[1:] if k == kind]}


def answered(text: str, chat: dict) -> bool:
    """The answer, and no competing value of its kind, in the reply (case-insensitive): naming every code
    told in the chat is not recalling the one asked for."""
    lowered = text.lower()
    return chat["answer"].lower() in lowered and not any(value.lower() in lowered for value in chat["competing"])
