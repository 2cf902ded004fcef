"""The chats: a user tells the assistant about their life over several turns, one turn states the fact that
the last turn asks for, and other turns state facts of the same kind (other codes, cities, names, passwords).

A chat is seeded by (split, index): the asked fact's turn is drawn uniformly among the statement turns, its
kind and subject at random; `competitors` other statement turns each state a fact of the same kind about
another subject, and the remaining ones may state a fact of another kind. Every statement turn is
`filler` sentences of everyday life (no numbers, names or places) with its fact, if any, at a random place
among them. The question is the subject's plain question, with no words of the answer handed over.

Splits: values come from kvpop_eval.english_tasks' pools (names, cities and passwords partitioned by split;
numbers drawn from the split's own seed), filler sentences are partitioned between validation and test by
a stable hash, so the test split's chats share no value and no filler sentence with validation's.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from functools import lru_cache

from kvpop_eval.english_tasks import SPLITS as POOL_SPLITS, _pool

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
POOLS = {"city": "city", "person": "person", "password": "key"}  # english_tasks' pool of each kind's values

# Everyday sentences with no number, name or place: the body of every statement turn.
FILLER = (
    "Yesterday I finally cleaned out the garage and found a box of old letters.",
    "I have been trying to drink more water during the day.",
    "The weather has been cold and grey all week.",
    "My morning coffee tasted burnt today, so I made a second cup.",
    "I started reading a long novel about a family of sailors.",
    "Our kitchen tap has been dripping since the weekend.",
    "I walked to work instead of taking the bus and enjoyed it.",
    "The neighbours' cat keeps sleeping on our doormat.",
    "I baked bread for the first time and it came out rather flat.",
    "My phone battery does not last a whole day anymore.",
    "I am thinking about painting the bedroom a lighter colour.",
    "Last night I watched a documentary about deep sea creatures.",
    "The new cafe around the corner makes excellent pastries.",
    "I forgot my umbrella and got soaked on the way home.",
    "We are planning a small garden party for the summer.",
    "I have been learning to knit, but my scarf is very uneven.",
    "The printer at work jammed three times this morning.",
    "I repotted all my houseplants over the weekend.",
    "My back has been sore since I moved the sofa.",
    "I signed up for a beginners' class in pottery.",
    "The train was late again and I missed the start of a meeting.",
    "I made a big pot of vegetable soup that will last for days.",
    "I keep meaning to call my old school friends more often.",
    "The leaves on the trees outside are turning yellow already.",
    "I bought a new pair of running shoes that feel very light.",
    "Our washing machine makes a strange noise when it spins.",
    "I spent the afternoon sorting through old photographs.",
    "My favourite radio programme changed its presenter.",
    "I tried a new recipe with lentils and it was surprisingly good.",
    "The streets were very quiet this morning.",
    "I have too many browser tabs open and cannot find anything.",
    "I went swimming after work and felt much better for it.",
    "The library near my house is being renovated.",
    "I lost one glove somewhere between the shop and the bus stop.",
    "We had a long family dinner that went on until late.",
    "I am slowly getting used to waking up earlier.",
    "The supermarket was out of the bread I usually buy.",
    "I finally fixed the wobbly leg of the kitchen table.",
    "My inbox is full of newsletters I never asked for.",
    "I enjoy listening to the rain at night.",
    "The heating in the office is either too hot or too cold.",
    "I picked strawberries at a farm and ate half of them on the way.",
    "My laptop fan has become very loud lately.",
    "I have been sleeping badly because of the street noise.",
    "We rearranged the living room to make space for a bookshelf.",
    "I started keeping a small notebook for my thoughts.",
    "The bakery gave me an extra roll for free this morning.",
    "I spent far too long choosing a new toothbrush.",
    "My hands were freezing after cycling without gloves.",
    "I am trying to spend less time looking at screens in the evening.",
    "The river path was muddy after all the rain.",
    "I cooked dinner for friends and burnt the rice a little.",
    "Our old car needed new tyres before the winter.",
    "I enjoyed a long walk through the woods on the weekend.",
    "The meeting today could easily have been an email.",
    "I found a lovely second-hand armchair at a flea market.",
    "My tomato plants are finally producing fruit.",
    "The kids next door have started learning the trumpet.",
    "I made a list of things to fix around the house.",
    "I fell asleep on the sofa while watching a film.",
    "The post office queue took almost the whole lunch break.",
    "I have been trying to learn a few words of a new language every day.",
    "My shoes squeak loudly on the office floor.",
    "The sunset over the rooftops was beautiful this evening.",
    "I organised my spice drawer and threw out the old jars.",
    "The bus driver this morning was unusually cheerful.",
    "I decided to take a short break from social media.",
    "We spent the evening playing board games.",
    "My coat needs a new button before it gets colder.",
    "I made pancakes for breakfast on a weekday for once.",
    "The gym was crowded, so I went for a run outside instead.",
    "I have been listening to old songs from my teenage years.",
    "Our fridge is almost empty and I need to go shopping.",
    "I helped a friend carry boxes up several flights of stairs.",
    "The wind knocked over our garden chairs during the night.",
    "I bought flowers for the kitchen table just to cheer it up.",
    "My to-do list keeps getting longer instead of shorter.",
    "I tried meditating for a few minutes before bed.",
    "The hallway light flickers whenever someone closes the door.",
    "I finished a jigsaw puzzle that had been on the table for weeks.",
    "I am looking forward to a quiet weekend at home.",
    "The coffee machine at work has been broken for days.",
    "I wrote a long letter by hand, which felt old-fashioned.",
    "My sunglasses broke when I sat on them by accident.",
    "The market had wonderful fresh vegetables today.",
    "I have started going to bed without my phone in the room.",
    "I cleaned the windows and the whole flat looks brighter.",
    "A bird has built a nest on our balcony.",
    "I spilled tea on my notes right before a presentation.",
    "The evenings are getting longer and lighter.",
    "I tried to fix my bicycle chain and got grease everywhere.",
    "My favourite mug has a small crack in it now.",
    "I enjoyed a slow breakfast with the newspaper.",
    "I am trying to be more patient when I am stuck in traffic.",
    "The park was full of people flying kites.",
    "I bought a cookbook and have not opened it yet.",
    "We started a habit of walking together after dinner.",
    "My desk is covered in sticky notes I no longer understand.",
    "I have been humming the same tune all day.",
    "The snow turned to slush within a few hours.",
)


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


REMEMBER = " Please remember that."


def filler_split(sentence: str) -> str:
    """Validation or test: a stable hash of the sentence (the same on every machine)."""
    return SPLITS[int(hashlib.sha256(f"chat-filler:{sentence}".encode()).hexdigest()[:8], 16) % 2]


@dataclass(frozen=True)
class ChatShape:
    """What every chat of a task set has in common (chosen on validation)."""

    statement_turns: int = 7  # user turns before the question
    filler: int = 5  # everyday sentences per statement turn
    competitors: int = 3  # statement turns that state another fact of the asked kind
    other_facts: int = 2  # statement turns that state a fact of another kind

    def __post_init__(self) -> None:
        if self.statement_turns < 2 or self.filler < 0 or self.competitors < 0 or self.other_facts < 0 \
                or 1 + self.competitors + self.other_facts > self.statement_turns:
            raise ValueError(f"a chat needs >= 2 statement turns holding the asked fact, its competitors and the other "
                             f"facts, got {self}")


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
    subjects = rng.sample(SUBJECTS[kind], 1 + shape.competitors)
    other_kinds = [rng.choice([k for k in KINDS if k != kind]) for _ in range(shape.other_facts)]
    taken: set[str] = set()
    facts = [(kind, subject, _value(kind, split, rng, taken)) for subject in subjects]
    facts += [(other, rng.choice(SUBJECTS[other]), _value(other, split, rng, taken)) for other in other_kinds]
    turn_of = rng.sample(range(shape.statement_turns), len(facts))  # facts[0] (the asked one) at a uniform turn
    fillers = rng.sample([s for s in FILLER if filler_split(s) == split], shape.filler * shape.statement_turns)
    requests = rng.sample([s for s in REQUESTS if filler_split(s) == split], shape.statement_turns)
    users = []
    for turn in range(shape.statement_turns):
        sentences = fillers[turn * shape.filler : (turn + 1) * shape.filler]
        if turn in turn_of:
            fact_kind, subject, value = facts[turn_of.index(turn)]
            sentences.insert(rng.randrange(len(sentences) + 1), rng.choice(subject.statements).format(value) + REMEMBER)
        users.append(" ".join([*sentences, requests[turn]]))
    asked = facts[0][1]
    users.append(asked.question)
    return {"split": split, "index": index, "shape": asdict(shape), "kind": kind, "users": users,
            "answer": facts[0][2], "fact_turn": turn_of[0], "competing": [value for k, _, value in facts[1:] if k == kind]}


def answered(text: str, chat: dict) -> bool:
    """The answer, and no competing value of its kind, in the reply (case-insensitive): naming every code
    told in the chat is not recalling the one asked for."""
    lowered = text.lower()
    return chat["answer"].lower() in lowered and not any(value.lower() in lowered for value in chat["competing"])
