"""Short, simple English stories generated from templates: the default model's training text.

Written for llm_jax (same license), deterministic for a seed and needing no download. In the spirit of
TinyStories (Eldan & Li, 2023): a small vocabulary, short sentences, and a plot — a character wants
something, meets a problem, and it ends well. A story keeps its names, pronouns, places and objects
consistent from start to end, so a model must carry them over from earlier in its context rather than
guess them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator

GIRL_NAMES = ("Lily", "Mia", "Emma", "Sara", "Anna", "Lucy", "Zoe", "Amy", "Ella", "Rosa", "Nina", "Kim",
              "Jane", "Maya", "Ruby", "Sue", "Eva", "Ivy")
BOY_NAMES = ("Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Noah", "Finn", "Omar", "Jake", "Bob",
             "Dan", "Ravi", "Luke", "Hugo", "Eli", "Adam")
ANIMAL_NAMES = ("Pip", "Spot", "Fluffy", "Buddy", "Coco", "Daisy", "Milo", "Rosie", "Bella", "Tiny",
                "Sunny", "Dot")
NAMES = GIRL_NAMES + BOY_NAMES + ANIMAL_NAMES
ANIMAL_SHARE = 0.25  # of characters; the others are girls and boys in equal shares
ANIMALS = ("cat", "dog", "bunny", "bear", "duck", "mouse", "fox", "bird", "frog", "puppy", "kitten", "owl")
SIZES = ("little", "small", "big", "happy", "kind", "curious", "shy", "brave", "silly", "sleepy")
COLORS = ("red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown", "shiny")
TOYS = ("ball", "kite", "teddy bear", "toy car", "doll", "hat", "book", "drum", "boat", "blanket", "crown",
        "robot", "train", "truck", "bucket", "scarf")
FOODS = ("cookie", "apple", "cake", "sandwich", "orange", "pie", "banana", "muffin", "pear", "carrot")
HELPERS = ("mom", "dad", "grandma", "grandpa", "big sister", "big brother")
FEELINGS_GOOD = ("happy", "glad", "proud", "excited")
FEELINGS_BAD = ("sad", "scared", "upset", "worried")
LIKES = ("play with {poss} {toy}", "sing songs", "draw pictures", "run and jump", "read books",
         "dance in the sun", "look at the clouds", "help {poss} {helper}", "play hide and seek",
         "pick flowers", "splash in puddles", "build towers with blocks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Place:
    name: str  # "the park"
    spot: str  # where in it something happens
    detail: str  # a sentence describing it


PLACES = (
    Place(name="the park", spot="under the slide", detail="There were swings and a big slide."),
    Place(name="the garden", spot="behind the flowers", detail="The flowers were red and yellow."),
    Place(name="the forest", spot="under a big tree", detail="The trees were tall and green."),
    Place(name="the beach", spot="in the sand", detail="The sun was warm and the water was blue."),
    Place(name="the farm", spot="near the barn", detail="There were cows, pigs and chickens."),
    Place(name="the pond", spot="by the water", detail="Ducks swam in the cool water."),
    Place(name="the hill", spot="behind a rock", detail="From the top, you could see the whole town."),
    Place(name="the yard", spot="under a bush", detail="The grass was soft and green."),
    Place(name="the zoo", spot="near the lions", detail="There were monkeys, lions and big elephants."),
    Place(name="the school", spot="under a desk", detail="The rooms were bright and full of books."),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Character:
    name: str
    kind: str  # "girl", "boy" or an animal
    she: str  # subject pronoun
    her: str  # object pronoun
    hers: str  # possessive determiner ("her", "his")


def _pronouns(female: bool) -> dict[str, str]:
    return {"she": "she", "her": "her", "hers": "her"} if female else {"she": "he", "her": "him", "hers": "his"}


def _character(rng: random.Random, *, avoid: tuple[str, ...] = (), animal: bool | None = None) -> Character:
    animal = rng.random() < ANIMAL_SHARE if animal is None else animal
    if animal:
        name = rng.choice([n for n in ANIMAL_NAMES if n not in avoid])
        return Character(name=name, kind=rng.choice(ANIMALS), **_pronouns(rng.random() < 0.5))
    female = rng.random() < 0.5
    name = rng.choice([n for n in (GIRL_NAMES if female else BOY_NAMES) if n not in avoid])
    return Character(name=name, kind="girl" if female else "boy", **_pronouns(female))


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class _Story:
    """The cast and props of one story, and the phrasing choices shared by every plot."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.hero = _character(rng)
        self.friend = _character(rng, avoid=(self.hero.name,))
        self.place = rng.choice(PLACES)
        self.toy = rng.choice(TOYS)
        self.color = rng.choice(COLORS)
        self.food = rng.choice(FOODS)
        self.helper = rng.choice(HELPERS)
        self.size = rng.choice(SIZES)
        self.good = rng.choice(FEELINGS_GOOD)  # one feeling of each kind per story, so they stay consistent
        self.bad = rng.choice(FEELINGS_BAD)

    def pick(self, *options: str) -> str:
        return self.fill(self.rng.choice(options))

    def fill(self, template: str) -> str:
        h, f = self.hero, self.friend
        return template.format(
            name=h.name, kind=h.kind, a_kind=_a(h.kind), she=h.she, her=h.her, poss=h.hers, She=_cap(h.she),
            Poss=_cap(h.hers), fname=f.name, fkind=f.kind, fwho=self.friend_who, fshe=f.she, fher=f.her,
            Fshe=_cap(f.she),
            place=self.place.name, spot=self.place.spot, toy=self.toy, color=self.color, food=self.food,
            a_food=_a(self.food), helper=self.helper, size=self.size, a_size=_a(self.size),
            good=self.good, bad=self.bad)

    def maybe(self, probability: float, *options: str) -> list[str]:
        """One of ``options`` with ``probability``, else nothing: optional sentences vary the length."""
        return [self.pick(*options)] if self.rng.random() < probability else []

    def opening(self) -> list[str]:
        who = "{a_size} {kind}" if self.rng.random() < 0.7 else "{a_kind}"
        first = self.pick(f"Once upon a time, there was {who} named {{name}}.",
                          f"Once upon a time, there lived {who} named {{name}}.",
                          f"There once was {who} named {{name}}.",
                          f"{{name}} was {who} who lived near {{place}}.",
                          f"In a little town, there was {who} named {{name}}.")
        like = self.fill(self.rng.choice(LIKES))
        second = self.pick(f"{{She}} loved to {like}.", f"Every day, {{she}} liked to {like}.",
                           f"{{She}} liked to {like} more than anything.")
        home = []
        if self.hero.kind in ("girl", "boy"):
            home = self.maybe(0.25, "{She} lived in a small house with {poss} {helper}.",
                              "{She} lived with {poss} {helper} in a little town.")
        return [first, *home, second]

    def detail(self) -> list[str]:
        return [self.place.detail] if self.rng.random() < 0.3 else []

    @property
    def friend_who(self) -> str:
        f = self.friend
        return f"{f.name} the {f.kind}" if f.kind not in ("girl", "boy") else f"{self.hero.hers} friend {f.name}"

    def ending(self, body: list[str], morals: tuple[str, ...]) -> list[str]:
        endings = ["{name} smiled. It was the best day ever.", "That night, {name} went to bed with a big smile.",
                   "{name} was very {good}, and they all lived happily ever after.",
                   "And {name} never forgot that day.", "The end."]
        if any(self.friend.name in line for line in body):
            endings.append("From that day on, {name} and {fname} were best friends.")
        return [*self.maybe(0.5, *morals), self.pick(*endings)]


Plot = Callable[[_Story], tuple[list[str], tuple[str, ...]]]  # the body, and the morals it may end with


def _lost_toy(s: _Story) -> tuple[list[str], tuple[str, ...]]:
    return [
        *s.opening(),
        s.pick("One day, {name} took {poss} {color} {toy} to {place}.",
               "One sunny day, {name} went to {place} with {poss} {color} {toy}."),
        *s.detail(),
        s.pick("Later, {she} could not find it.", "But when it was time to go home, the {toy} was gone!"),
        *s.maybe(0.5, "{name} felt {bad}.", '"Where is my {toy}?" cried {name}.'),
        s.pick('Then {fwho} came by. "I will help you look," said {fname}.',
               'Just then, {fwho} walked over and said, "Let us look together."'),
        s.pick("They looked everywhere. At last, {fname} found the {toy} {spot}.",
               "Soon they found the {toy} {spot}."),
        s.pick('"Thank you, {fname}!" said {name}.', "{name} hugged {poss} {toy} and thanked {fname}."),
    ], ("{name} learned that friends help each other.", "{name} learned to take good care of {poss} things.")


def _new_friend(s: _Story) -> tuple[list[str], tuple[str, ...]]:
    return [
        *s.opening(),
        s.pick("One day, {name} went to {place}.", "One morning, {name} walked to {place}."),
        *s.detail(),
        s.pick("There {she} saw a little {fkind} named {fname}, all alone.",
               "{She} saw a small {fkind} sitting {spot}. It was {fname}, and {fshe} looked {bad}."),
        s.pick('"Why are you alone?" asked {name}.', '"Hi! What is wrong?" asked {name}.'),
        s.pick('"I have no friends to play with," said {fname}.', '"I am new here," said {fname}.'),
        s.pick('{name} smiled. "You can play with me!"', '"I will be your friend," said {name}.'),
        s.pick("They played with the {color} {toy} all day.", "They ran, jumped and laughed together.",
               "{name} shared {poss} {food} with {fname}, and they played until the sun went down."),
    ], ("{name} learned that it is good to be kind to others.", "A kind word can make a new friend.")


def _rainy_day(s: _Story) -> tuple[list[str], tuple[str, ...]]:
    return [
        *s.opening(),
        s.pick("One day, {name} wanted to go to {place}.",
               "{name} and {poss} friend {fname} wanted to go to {place}."),
        s.pick("But then, dark clouds came and it began to rain.", "But it started to rain."),
        s.pick("{name} was {bad}.", '"Oh no!" said {name}. "Now I cannot play."'),
        s.pick('{Poss} {helper} said, "We can have fun inside."', '{Poss} {helper} said, "Let us play a game."'),
        s.pick("They built a fort with pillows and blankets.", "They baked cookies together in the kitchen.",
               "They drew a big picture of {place}."),
        s.pick("Soon, the sun came out. There was a big rainbow in the sky!",
               "After a while, the rain stopped. {name} ran outside and jumped in the puddles."),
    ], ("{name} learned that a rainy day can be a happy day too.",
        "{name} learned that you can have fun anywhere.")


def _sharing(s: _Story) -> tuple[list[str], tuple[str, ...]]:
    return [
        *s.opening(),
        s.pick("One day, {poss} {helper} gave {her} a big {food}.", "One day, {name} had {a_food} for a snack."),
        s.pick("{She} took it to {place}. There {she} met {fwho}.", "At {place}, {she} met {fwho}."),
        s.pick('{fname} looked at the {food}. "Can I have some?" {fshe} asked.',
               "{fname} had no snack and looked {bad}."),
        s.pick("{name} wanted to eat it all. But then {she} thought about how {fname} felt.",
               "{name} thought for a moment."),
        s.pick("{She} broke the {food} in two and gave half to {fname}.",
               '"Let us share," said {name}, and {she} gave {fname} half of the {food}.'),
        s.pick('"Thank you!" said {fname}. The {food} was yummy.', "They ate the {food} together and smiled."),
    ], ("{name} learned that sharing makes everyone happy.", "It is good to share with friends.")


def _afraid(s: _Story) -> tuple[list[str], tuple[str, ...]]:
    fear = s.rng.choice(("the dark", "big dogs", "the deep water", "loud thunder", "the tall slide"))
    return [
        *s.opening(),
        s.fill(f"But {{name}} was afraid of {fear}."),
        s.pick("One day, {name} went to {place} with {poss} {helper}.", "One night, {name} could not sleep."),
        s.fill(f'"I am scared of {fear}," said {{name}}.'),
        s.pick('{Poss} {helper} held {poss} hand. "It is okay to be scared. I am right here."',
               '{Poss} {helper} smiled. "Let us be brave together."'),
        s.pick("{name} took a deep breath.", "{name} counted to three."),
        s.pick(f"{{She}} was not so afraid of {fear} anymore.", "It was not so bad after all!"),
        s.pick("{She} felt brave and {good}.", '"I did it!" said {name}.'),
    ], ("{name} learned that being brave is not the same as never being scared.",
        "{name} learned that it is good to ask for help.")


def _building(s: _Story) -> tuple[list[str], tuple[str, ...]]:
    thing, verb = s.rng.choice((("sandcastle", "built"), ("tower", "built"), ("cake", "baked"),
                                ("picture", "drew"), ("paper boat", "made"), ("snowman", "built")))
    bumped = s.rng.random() < 0.5  # the friend breaks it and helps, or the wind does and the helper helps
    return [
        *s.opening(),
        s.fill(f"One day, {{name}} {verb} a big {thing} at {{place}}. {{She}} worked very hard."),
        s.fill(f"Then {{fwho}} ran by and bumped into the {thing}." if bumped
               else f"But then a big wind came and the {thing} fell down."),
        s.fill('"Oh no!" cried {name}. {She} felt {bad}.'),
        s.pick('"I am sorry," said {fname}. "I will help you make a new one."' if bumped
               else '"Do not give up," said {poss} {helper}. "I will help you."'),
        s.fill(f"So they worked together, and the new {thing} was even better than before."),
    ], ("{name} learned to never give up.", "When things go wrong, you can always try again.")


PLOTS: tuple[Plot, ...] = (_lost_toy, _new_friend, _rainy_day, _sharing, _afraid, _building)


def story(rng: random.Random) -> str:
    """One story as a single paragraph (no newlines)."""
    s = _Story(rng)
    body, morals = rng.choice(PLOTS)(s)
    return " ".join(body + s.ending(body, morals))


def stories(seed: int) -> Iterator[str]:
    """An endless, deterministic stream of stories for ``seed``."""
    rng = random.Random(seed)
    while True:
        yield story(rng)
