"""Multi-step reasoning and math problems for `augment`, generated from random parameters.

Each generator writes one problem statement (no answer: the target writes it); numbers are chosen
so the problem has a clean answer (integer ages, whole-number rates, a consistent ordering).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from .augment_lists import FEMALE_NAMES, NAMES

CARDS = ["heart", "face card", "king or a queen", "red ace"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def ordering(rng: random.Random) -> str:
    people = rng.sample(NAMES, rng.randint(3, 5))
    more, less, most, least = rng.choice([
        ("taller", "shorter", "tallest", "shortest"), ("older", "younger", "oldest", "youngest"),
        ("faster", "slower", "fastest", "slowest"), ("heavier", "lighter", "heaviest", "lightest"),
    ])  # fmt: skip
    facts = []
    for a, b in zip(people, people[1:]):  # people[0] ranks first; each fact compares neighbours in rank
        facts.append(f"{a} is {more} than {b}." if rng.random() < 0.5 else f"{b} is {less} than {a}.")
    rng.shuffle(facts)
    question = rng.choice([f"Who is the {least}?", f"Who is the {most}?", f"Rank them from {most} to {least}."])
    return " ".join(facts) + " " + question


def siblings(rng: random.Random) -> str:
    name = rng.choice(FEMALE_NAMES)
    brothers, sisters = rng.randint(1, 5), rng.randint(2, 6)
    return (
        f"{name} has {brothers} brother{'s' if brothers > 1 else ''}. Each of her brothers has {sisters} sisters. "
        f"How many sisters does {name} have?"
    )


def weekday(rng: random.Random) -> str:
    day, n = rng.choice(DAYS), rng.randint(10, 500)
    return rng.choice([
        f"If today is {day}, what day of the week will it be in {n} days?",
        f"If today is {day}, what day of the week was it {n} days ago?",
        f"A project starts on a {day} and takes {n} days. On what day of the week does it end?",
    ])  # fmt: skip


def clock(rng: random.Random) -> str:
    hour, minute = rng.randint(5, 22), rng.choice(range(0, 60, 5))
    hours, minutes = rng.randint(1, 9), rng.choice(range(5, 60, 5))
    return (
        f"A train leaves at {hour:02d}:{minute:02d} and the journey takes {hours} hours and {minutes} minutes. "
        "At what time does it arrive? If it is delayed by a quarter of the journey time, when does it arrive instead?"
    )


def work_rate(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    ta, tb = rng.choice([(2, 3), (3, 6), (4, 12), (6, 12), (5, 20), (10, 15), (12, 24), (6, 3)])
    task = rng.choice(["paint a fence", "mow a lawn", "fill a pool with a hose", "sort a pile of letters"])
    return f"{a} can {task} in {ta} hours and {b} can do it in {tb} hours. How long does it take them working together?"


def meeting_trains(rng: random.Random) -> str:
    distance = rng.choice(range(120, 900, 30))
    v1, v2 = rng.choice(range(40, 130, 10)), rng.choice(range(40, 130, 10))
    return (
        f"Two trains start {distance} km apart and travel toward each other, one at {v1} km/h and the other at "
        f"{v2} km/h. How long until they meet, and how far has the faster train gone by then?"
    )


def dice(rng: random.Random) -> str:
    return rng.choice([
        f"When rolling two fair dice, what is the probability that the total is at least {rng.randint(4, 11)}?",
        f"Three fair coins are tossed. What is the probability of getting exactly {rng.randint(1, 2)} heads?",
        f"A bag has {rng.randint(2, 7)} red and {rng.randint(2, 7)} blue marbles. Two are drawn without "
        "replacement. What is the probability that both are the same color?",
        f"A card is drawn from a standard deck. What is the probability that it is a {rng.choice(CARDS)}?",
        f"What is the probability of rolling a {rng.randint(1, 6)} at least once in {rng.randint(2, 5)} rolls of a "
        "fair die?",
    ])  # fmt: skip


def counting(rng: random.Random) -> str:
    word = rng.choice(["LEVEL", "BANANA", "PUZZLE", "LETTER", "APPLE", "STATISTICS", "COFFEE", "ORANGE"])
    n, k = rng.randint(6, 12), rng.randint(2, 4)
    return rng.choice([
        f"How many different arrangements of the letters of the word {word} are there?",
        f"A club has {n} members. In how many ways can it choose a committee of {k}?",
        f"In how many ways can {k} prizes (first, second, third...) be given to {n} runners?",
        f"How many {k}-digit numbers have all different digits and no zero?",
    ])  # fmt: skip


def sequence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    if kind == 0:
        terms = [start + step * i for i in range(5)]
    elif kind == 1:
        terms = [start * step**i for i in range(5)] if start < 6 else [step * 2**i for i in range(5)]
    elif kind == 2:
        terms = [(i + start % 5) ** 2 for i in range(5)]
    else:
        terms = [start, start + step]
        while len(terms) < 6:
            terms.append(terms[-1] + terms[-2])
    return f"What is the next number in the sequence {', '.join(map(str, terms))}? Explain the rule."


def syllogism(rng: random.Random) -> str:
    a, b, c = rng.sample(["cats", "musicians", "teachers", "runners", "poets", "engineers", "birds", "painters",
                          "gardeners", "chess players"], 3)  # fmt: skip
    form = rng.choice([
        f"All {a} are {b}. All {b} are {c}. Are all {a} {c}?", f"All {a} are {b}. Some {b} are {c}. Are some {a} {c}?",
        f"No {a} are {b}. Some {c} are {a}. Can we conclude that some {c} are not {b}?",
        f"Some {a} are {b}. All {b} are {c}. Must some {a} be {c}?",
    ])  # fmt: skip
    return form + " Explain whether the conclusion follows."


def knights(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    claim = rng.choice(["We are both liars.", f"{b} and I are the same kind.", "At least one of us is a liar."])
    return (
        f'On an island, knights always tell the truth and liars always lie. {a} says: "{claim}" What are {a} and {b}?'
    )


def ages(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    young = rng.randint(3, 20)
    times = rng.randint(2, 4)
    old = young * times
    for years in range(1, 40):  # a later year at which the ratio is a whole number
        if (old + years) % (young + years) == 0 and (old + years) // (young + years) < times:
            ratio = (old + years) // (young + years)
            return (
                f"{a} is {times} times as old as {b}. In {years} years, {a} will be {ratio} times as old as {b}. "
                "How old are they now?"
            )
    return f"{a} is {times} times as old as {b}, and together they are {old + young} years old. How old is each?"


def geometry(rng: random.Random) -> str:
    points = [(rng.randint(-5, 9), rng.randint(-5, 9)) for _ in range(3)]
    width = rng.randint(2, 15)
    return rng.choice([
        "A triangle has vertices at " + ", ".join(f"({x}, {y})" for x, y in points) + ". What is its area?",
        f"A rectangle is {rng.randint(2, 4)} times as long as it is wide, and its perimeter is "
        f"{2 * width * 5} cm. What are its length and width?",
        f"A circle has a circumference of {rng.randint(10, 60)} cm. What is its area?",
        f"A ladder {rng.choice([5, 10, 13, 15, 17, 25])} m long leans against a wall with its foot "
        f"{rng.choice([3, 5, 6, 8])} m from the wall. How high up the wall does it reach?",
    ])  # fmt: skip


def _signed(n: int) -> str:
    return f"+ {n}" if n >= 0 else f"- {-n}"


def equations(rng: random.Random) -> str:
    x, y = rng.randint(-9, 12), rng.randint(-9, 12)
    a, b, c, d = (rng.randint(1, 9) for _ in range(4))
    c = c if c != a else a + 1
    r1, r2 = rng.randint(-8, 8), rng.randint(-8, 8)
    return rng.choice([
        f"Solve for x: {a}x {_signed(b)} = {c}x {_signed(a * x + b - c * x)}.",
        f"Solve the system: {a}x + {b}y = {a * x + b * y} and {c}x - {d}y = {c * x - d * y}.",
        f"Find the roots of x^2 {_signed(-(r1 + r2))}x {_signed(r1 * r2)} = 0.",
        f"If f(x) = {a}x^2 - {b}x + {c}, what is f({x})? And what is f(f(1))?",
    ])  # fmt: skip


def venn(rng: random.Random) -> str:
    total, both = rng.randint(25, 60), rng.randint(2, 8)
    first, second = rng.randint(both + 3, total // 2), rng.randint(both + 3, total // 2)
    a, b = rng.sample(["play football", "play tennis", "play chess", "sing in the choir", "swim", "do robotics"], 2)
    return (
        f"In a class of {total} students, {first} {a}, {second} {b}, and {both} do both. "
        f"How many students do neither? How many do exactly one?"
    )


def growth(rng: random.Random) -> str:
    amount = rng.choice(range(1000, 20000, 500))
    rate = rng.choice([3, 4, 5, 6, 8, 10])
    years = rng.randint(2, 6)
    return rng.choice([
        f"${amount} is invested at {rate}% interest compounded yearly. How much is it worth after {years} years?",
        f"A company spends ${amount} on equipment in its first year and half as much each following year. "
        f"How much has it spent after {years} years?",
        f"A town of {amount * 3} people grows by {rate}% a year. About how many people live there after {years} years?",
        f"A price rises by {rate * 2}% and then falls by {rate * 2}%. Is it back where it started? "
        f"Explain with ${amount}.",
    ])  # fmt: skip


def machines(rng: random.Random) -> str:
    n, t, m = rng.randint(3, 9), rng.choice([4, 5, 6, 8, 10]), rng.randint(10, 120)
    return (
        f"If {n} machines make {n} widgets in {t} minutes, how long would {m} machines take to make {m} widgets? "
        f"And how many widgets would {m} machines make in {t * 3} minutes?"
    )


def row_position(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    left, right = rng.randint(3, 20), rng.randint(3, 20)
    return (
        f"In a row of people, {name} is {_ordinal(left)} from the left and {_ordinal(right)} from the right. "
        "How many people are in the row?"
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def physics(rng: random.Random) -> str:
    v, mass, force = rng.randint(5, 40), rng.randint(1, 50), rng.randint(5, 200)
    height = rng.randint(5, 100)
    return rng.choice([
        f"A ball is thrown straight up at {v} m/s. How high does it rise, and how long until it lands? "
        "Ignore air resistance and explain each step.",
        f"A force of {force} N pushes a {mass} kg cart on a frictionless floor. What is its acceleration, and how fast "
        "is it moving after 3 seconds?",
        f"A stone is dropped from {height} m. How long does it take to hit the ground, and how fast is it going then?",
        "A satellite's orbit around the Earth shrinks slightly. What happens to its speed and its orbital period? "
        "Explain using physics principles.",
        f"How much energy does it take to heat {mass / 10:.1f} kg of water from 20 C to 100 C? Explain the formula.",
        f"A {math.floor(mass * 10)} W light bulb is left on for {v} hours. How many kilowatt-hours does it use?",
    ])  # fmt: skip


PUZZLES: dict[str, Callable[[random.Random], str]] = {
    "ordering": ordering,
    "siblings": siblings,
    "weekday": weekday,
    "clock": clock,
    "work_rate": work_rate,
    "meeting_trains": meeting_trains,
    "dice": dice,
    "counting": counting,
    "sequence": sequence,
    "syllogism": syllogism,
    "knights": knights,
    "ages": ages,
    "geometry": geometry,
    "equations": equations,
    "venn": venn,
    "growth": growth,
    "machines": machines,
    "row_position": row_position,
    "physics": physics,
}
