"""One prompt builder per task kind of `augment`: ``build(rng, material) -> (prompt, origin) | None``.

Each builder picks material (`augment_sources.Material`, parsed from the training prompts) or
built-in lists (`augment_lists`), an instruction phrasing and an output format, all from ``rng``;
``origin`` names the training-prompt source the material came from (``builtin`` where none did).
A builder returns None when its material is missing; the driver then tries again or moves on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from . import augment_lists as lists
from .augment_puzzles import PUZZLES
from .augment_sources import Material, Piece, trim_words

Built = tuple[str, str] | None
PASSAGE_WORDS = (60, 90, 120, 150, 170)  # passages are cut (at a sentence) to one of these lengths


def _pick(rng: random.Random, items: Sequence):
    return rng.choice(items) if items else None


def _passage(rng: random.Random, piece: Piece, longest: int = 170) -> str:
    return trim_words(piece.text, rng.choice([n for n in PASSAGE_WORDS if n <= longest]))


def _a(word: str) -> str:
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


# ---- summarization -----------------------------------------------------------------------------------------------
_SUMMARY_ASKS = [
    "Summarize: {text}",
    "Summarize the following text in one sentence.\n\n{text}",
    "Write a one-paragraph summary of this article:\n\n{text}",
    "Summarize the main points of the passage below as {n} bullet points.\n\n{text}",
    "{text}\n\nSummarize the text above in no more than {words} words.",
    "Give me a TL;DR of this:\n\n{text}",
    "Read the following and write a short summary for a busy reader.\n\n{text}",
    "Write a headline and a two-sentence summary for this news story:\n\n{text}",
    "Explain what this text is about to a ten-year-old, in a few sentences.\n\n{text}",
    "Condense this into three key takeaways:\n\n{text}",
    "Please summarize the text below, keeping every number and name that matters.\n\n{text}",
    "Text:\n{text}\n\nWrite a concise abstract of the text.",
]
_DIALOGUE_ASKS = [
    "Summarize this conversation:\n\n{text}",
    "{text}\n\nSummarize the dialogue above in one sentence.",
    "Write a short summary of what was agreed in this chat:\n\n{text}",
    "Summarize: {text}",
    "Read the dialogue and list, as bullet points, what each person wants.\n\n{text}",
    "Turn this conversation into a brief third-person summary.\n\n{text}",
]


def summarization(rng: random.Random, m: Material) -> Built:
    if m.dialogues and rng.random() < 0.25:
        piece = rng.choice(m.dialogues)
        return rng.choice(_DIALOGUE_ASKS).format(text=piece.text), piece.source
    if rng.random() < 0.1 and len(m.passages) > 1:
        a, b = rng.sample(m.passages, 2)
        text = f"Article 1:\n{_passage(rng, a, 90)}\n\nArticle 2:\n{_passage(rng, b, 90)}"
        ask = rng.choice(["Summarize both articles, one paragraph each.", "Summarize each article in one sentence."])
        return f"{ask}\n\n{text}", a.source
    piece = _pick(rng, m.passages)
    if piece is None:
        return None
    ask = rng.choice(_SUMMARY_ASKS)
    return ask.format(text=_passage(rng, piece), n=rng.choice([3, 4, 5]), words=rng.choice([30, 50, 80])), piece.source


# ---- retrieval-augmented QA ------------------------------------------------------------------------------------
_RAG_ASKS = [
    "Answer the question using only the context below. If the context does not contain the answer, say so.\n\n"
    "Context:\n{context}\n\nQuestion: {question}",
    "{context}\n\n{question}",
    "{context}\n\nBased on the passage above, answer: {question}",
    "Read the text and answer the question that follows.\n\n{context}\n\nQuestion: {question}\nAnswer:",
    "Use the documents to answer the question, and say which document you used.\n\n{context}\n\nQuestion: {question}",
    "Here is some background information:\n{context}\n\nFrom that information, {question_lower}",
    "Context: {context}\nQuestion: {question}\nGive a short answer, then one sentence of explanation.",
]


def rag(rng: random.Random, m: Material) -> Built:
    pair = _pick(rng, m.qa)
    if pair is None:
        return None
    passage = trim_words(pair.passage, rng.choice([120, 150, 170, 200]))
    documents = [passage]
    if len(m.passages) > 1 and rng.random() < 0.4:  # a distractor beside the document that holds the answer
        documents.insert(rng.randrange(2), _passage(rng, rng.choice(m.passages), 60))
    if len(documents) > 1 or rng.random() < 0.3:
        context = "\n\n".join(f"Document {i + 1}:\n{text}" for i, text in enumerate(documents))
    else:
        context = documents[0]
    question = pair.question
    if rng.random() < 0.08 and len(m.qa) > 1:  # unanswerable from this context: the model should say so
        question = rng.choice(m.qa).question
    ask = rng.choice(_RAG_ASKS)
    return ask.format(context=context, question=question, question_lower=_lower_first(question)), pair.source


# ---- closed-book QA ---------------------------------------------------------------------------------------------
_QA_ASKS = [
    "{q}",
    "{q}",
    "Answer briefly: {q}",
    "{q} Explain your answer in two or three sentences.",
    "Q: {q}\nA:",
    "Give a short factual answer: {q}",
    "{q} If you are not sure, say what you do know.",
    "Please answer the following question and give one supporting fact. {q}",
]


def qa(rng: random.Random, m: Material) -> Built:
    pool = m.questions
    if m.qa and rng.random() < 0.3:  # questions from reading comprehension that stand alone (Wikipedia, SciQ)
        pair = rng.choice(m.qa)
        if pair.source.split(":")[-1].startswith(("adversarial_qa", "sciq")):
            return rng.choice(_QA_ASKS).format(q=pair.question), pair.source
    piece = _pick(rng, pool)
    if piece is None:
        return None
    return rng.choice(_QA_ASKS).format(q=piece.text), piece.source


# ---- extraction -----------------------------------------------------------------------------------------------
_EXTRACT_ASKS = [
    "List every person mentioned in the text below, with one line on who they are.\n\n{text}",
    "Extract all dates, numbers and amounts from the passage, each with what it refers to.\n\n{text}",
    'Extract the named entities from the text and return JSON with the keys "people", "organizations", '
    '"places" and "dates".\n\n{text}',
    "From the text below, make a Markdown table with the columns Entity, Type and Role in the text.\n\n{text}",
    "{text}\n\nIdentify the key facts in the passage above as a bulleted list.",
    "Read the passage and extract every place name, in the order they appear.\n\n{text}",
    'Return a JSON object with the fields "topic", "main_claim", "people" and "numbers" for this text:\n\n{text}',
    "Pull out all the organizations and companies named in this text. Output one per line.\n\n{text}",
    'Extract the events described in the text as a JSON list of objects with "when", "who" and "what".\n\n{text}',
]
_REVIEW_ASKS = [
    "From the review below, extract the product or place reviewed, the pros, the cons and the likely star "
    "rating, as JSON.\n\n{text}",
    "Make a table of the complaints and the compliments in this review.\n\n{text}",
    "List the specific features the reviewer mentions, each with whether they liked it.\n\n{text}",
]
_DIALOGUE_EXTRACT = [
    "From this conversation, extract every plan or appointment: who, what and when, as a JSON list.\n\n{text}",
    "List the speakers in this dialogue and, for each, the one thing they want.\n\n{text}",
    "Extract all times, places and numbers mentioned in the conversation below.\n\n{text}",
]
_PROBLEM_EXTRACT = [
    "Do not solve this problem. Extract every quantity in it, with its unit and what it describes, as a JSON list."
    "\n\n{text}",
    "List the known values and the unknown in this word problem as a table (no solution needed):\n\n{text}",
]
_REVIEW_SOURCES = ("amazon", "yelp", "imdb", "app_reviews", "rotten_tomatoes")


def extraction(rng: random.Random, m: Material) -> Built:
    roll = rng.random()
    if roll < 0.12 and m.dialogues:
        piece = rng.choice(m.dialogues)
        return rng.choice(_DIALOGUE_EXTRACT).format(text=piece.text), piece.source
    if roll < 0.22 and m.problems:
        piece = rng.choice(m.problems)
        return rng.choice(_PROBLEM_EXTRACT).format(text=piece.text), piece.source
    piece = _pick(rng, m.passages)
    if piece is None:
        return None
    asks = _REVIEW_ASKS if piece.source.split(":")[-1].startswith(_REVIEW_SOURCES) else _EXTRACT_ASKS
    return rng.choice(asks).format(text=_passage(rng, piece, 150)), piece.source


# ---- translation ----------------------------------------------------------------------------------------------
TARGET_LANGUAGES = ["German", "French", "Spanish", "Chinese", "Japanese"]
_INTO_ENGLISH = [
    "Translate {lang} to English: {text}",
    "Translate {lang} to English: {text}",
    "Translate the following {lang} text into English:\n\n{text}",
    'What does this mean in English? "{text}"',
    "Please translate into English: {text}",
    "Translate this into natural English:\n{text}",
    "{text}\n\nTranslate the text above from {lang} into English.",
]
_FROM_ENGLISH = [
    "Translate English to {lang}: {text}",
    "Translate the following sentence into {lang}:\n\n{text}",
    'How would you say this in {lang}? "{text}"',
    "Translate into {lang}, keeping the meaning and the tone: {text}",
    "Give a {lang} translation of the text below.\n\n{text}",
    "{text}\n\nTranslate the text above into {lang}.",
]
_ROUND_TRIP = [
    "Translate this sentence into {lang}, then translate your {lang} version back into English: {text}",
    'Translate into {lang} and back to English, and point out anything that changed: "{text}"',
]


def translation(rng: random.Random, m: Material) -> Built:
    roll = rng.random()
    if roll < 0.45:  # into English, mostly from German
        lang = rng.choices(["German", "French", "Spanish"], weights=[6, 2, 2])[0]
        return rng.choice(_INTO_ENGLISH).format(lang=lang, text=lists.foreign_sentence(rng, lang)), "builtin"
    piece = _pick(rng, m.sentences)
    if piece is None:
        return None
    text = piece.text
    if rng.random() < 0.2:
        follow = [s for s in rng.sample(m.sentences, min(3, len(m.sentences))) if s.source == piece.source]
        text = " ".join([text] + [s.text for s in follow[:1] if s.text != text])
    lang = rng.choice(TARGET_LANGUAGES)
    asks = _ROUND_TRIP if roll > 0.87 else _FROM_ENGLISH
    return rng.choice(asks).format(lang=lang, text=text), piece.source


# ---- writing -------------------------------------------------------------------------------------------------
def _topic(rng: random.Random, m: Material, headlines: bool = True) -> tuple[str, str]:
    """A topic: a short headline or title from the prompts (``headlines``), else a built-in one."""
    short = [p for p in m.topics if len(p.text.split()) <= 12] if headlines else []
    if short and rng.random() < 0.4:
        piece = rng.choice(short)
        return piece.text.rstrip("."), piece.source
    return rng.choice(lists.WRITING_TOPICS), "builtin"


_RECIPIENTS = ["your manager", "a colleague", "a customer", "your landlord", "a professor", "an old friend",
               "the city council", "a hiring manager", "your team", "a supplier"]  # fmt: skip
_EMAIL_PURPOSES = ["asking for feedback on a report about {t}", "requesting a one-week extension for work on {t}",
                   "announcing news about {t}", "apologizing for a mistake related to {t}",
                   "inviting them to a meeting about {t}", "following up on an earlier conversation about {t}",
                   "proposing a new idea related to {t}", "declining an invitation to an event about {t}"]  # fmt: skip
_NEWS_ASKS = [
    "Write a short news article based on this report: {t}", "Write a blog post reacting to this news: {t}",
    "Write an opinion column of about {w} words about this news: {t}",
    "Write a social media thread of {n} posts explaining this news to {a}: {t}",
    "Write a letter to the editor responding to this story: {t}",
]  # fmt: skip


def writing(rng: random.Random, m: Material) -> Built:
    form = rng.randrange(13)
    tone, audience = rng.choice(lists.TONES), rng.choice(lists.AUDIENCES)
    words = rng.choice([100, 150, 200, 300, 400])
    topic, origin = _topic(rng, m, headlines=form in (1, 5, 8, 10, 11))
    if form == 0:
        purpose = rng.choice(_EMAIL_PURPOSES).format(t=topic)
        prompt = f"Write {_a(tone)} email to {rng.choice(_RECIPIENTS)} {purpose}. Keep it short and to the point."
    elif form == 1:
        prompt = f"Write a blog post of about {words} words about {topic} for {audience}."
        prompt += rng.choice(["", " Include a catchy title.", f" Give {rng.choice([3, 5, 7])} practical tips."])
    elif form == 2 and m.concepts:
        piece = rng.choice([c for c in m.concepts if "," in c.text] or m.concepts)
        prompt, origin = f"Write a short story that uses all of these words: {piece.text}.", piece.source
    elif form == 2:
        prompt = f"Write a short story ({words} words or fewer) about {topic}."
    elif form == 3 and m.sentences:
        piece = rng.choice(m.sentences)
        prompt, origin = f'Write a short story that begins with this sentence: "{piece.text}"', piece.source
    elif form == 4:
        kind = rng.choice(["haiku", "limerick", "sonnet", "free-verse poem", "rhyming poem of three stanzas"])
        if m.concepts and rng.random() < 0.3:
            piece = rng.choice(m.concepts)
            prompt, origin = f"Write {_a(kind)} about {piece.text.replace(', ', ' and ')}.", piece.source
        else:
            prompt = f"Write {_a(kind)} about {topic}."
    elif form == 5:
        kind = rng.choice(["persuasive", "argumentative", "descriptive", "reflective", "compare-and-contrast"])
        prompt = f"Write {_a(kind)} essay of about {words} words on {topic}."
    elif form == 6:
        product = rng.choice(lists.PRODUCTS)
        medium = rng.choice(["a radio ad", "an Instagram post", "a short print ad", "a 30-second video script"])
        prompt, origin = f"Write {medium} for {product}, aimed at {audience}.", "builtin"
    elif form == 7 and m.passages:
        piece = rng.choice([p for p in m.passages if p.source.split(":")[-1].startswith("dbpedia")] or m.passages)
        text = trim_words(piece.text, 60)
        prompt = f"Using the description below, write a catchy advertisement of about 80 words.\n\n{text}"
        origin = piece.source
    elif form == 8:
        prompt = f"Write a short news article with the headline: {topic}"
    elif form == 9:
        occasion = rng.choice(["a retirement party", "a graduation", "a town-hall meeting", "a product launch"])
        prompt = f"Write {_a(tone)} two-minute speech for {occasion} that touches on {topic}."
    elif form == 10:
        prompt = f"Write {_a(tone)} social media thread of {rng.choice([3, 4, 5])} posts about {topic}."
    elif form == 11 and m.topics:
        news = [p for p in m.topics if len(p.text.split()) > 12] or m.topics
        piece = rng.choice(news)
        ask = rng.choice(_NEWS_ASKS)
        prompt = ask.format(t=piece.text, w=words, n=rng.choice([3, 4, 5]), a=audience)
        origin = piece.source
    else:
        prompt = f"Write {_a(tone)} letter to the editor of a local newspaper about {topic}."
    return prompt, origin


# ---- roleplay --------------------------------------------------------------------------------------------------
def roleplay(rng: random.Random, m: Material) -> Built:
    role = rng.choice(lists.ROLES)
    roll = rng.random()
    if roll < 0.2 and m.passages:
        reviews = [p for p in m.passages if p.source.split(":")[-1].startswith(("yelp", "amazon", "app_reviews"))]
        piece = _pick(rng, reviews)
        if piece is not None:
            owner = "the owner of the business" if "yelp" in piece.source else "the maker of the product"
            text = trim_words(piece.text, 120)
            return f"You are {owner}. Reply in character, politely and specifically, to this review:\n\n{text}", (
                piece.source
            )
    if roll < 0.45 and m.questions:
        piece = rng.choice(m.questions)
        ask = rng.choice([
            "You are {role}. Stay in character and answer this question: {q}",
            "Pretend to be {role}. Someone asks you: \"{q}\" Respond the way {role} would.",
            "Take on the role of {role} for the rest of this conversation. My first question: {q}",
        ])  # fmt: skip
        return ask.format(role=role, q=piece.text), piece.source
    if roll < 0.6 and m.dialogues:
        piece = rng.choice(m.dialogues)
        speaker = piece.text.splitlines()[-1].split(":", 1)[0]
        other = next((line.split(":", 1)[0] for line in piece.text.splitlines() if not line.startswith(speaker)), "")
        return (
            f"Continue this conversation as {other or speaker}, staying in character for two or three more turns."
            f"\n\n{piece.text}",
            piece.source,
        )
    topic, origin = _topic(rng, m, headlines=False)
    counterpart = rng.choice(lists.COUNTERPARTS)
    ask = rng.choice([
        "You are {role}. I am {counterpart}. We meet and I ask you about {topic}. Respond in character.",
        "Let's role-play: you are {role} and I am {counterpart}. Begin the scene by telling me about {topic}.",
        "Embrace the role of {role}. In character, give me your honest opinion on {topic}.",
        "Act as {role}. Describe a typical day in your life, and mention {topic} along the way.",
        "You are {role}, and you must convince {counterpart} to care about {topic}. Stay in character.",
    ])  # fmt: skip
    return ask.format(role=role, counterpart=counterpart, topic=topic), origin


# ---- coding ----------------------------------------------------------------------------------------------------
def _fence(language: str) -> str:
    return {"Python": "python", "JavaScript": "javascript"}.get(language, "")


def coding(rng: random.Random, m: Material) -> Built:
    roll = rng.random()
    if roll < 0.45:
        what, name = rng.choice(lists.CODING_TASKS)
        language = rng.choice(lists.CODING_LANGUAGES)
        if language == "JavaScript":
            name = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
        ask = rng.choice([
            "Write a {lang} function `{name}` that {what}.", "Implement `{name}` in {lang}: a function that {what}.",
            "In {lang}, write a function that {what}.", "Can you write {lang} code for a function that {what}?",
            "Write a {lang} program with a function that {what}, and print a few examples.",
        ])  # fmt: skip
        prompt = ask.format(lang=language, name=name, what=what)
        extra = rng.choice(lists.CODING_EXTRAS)
        return (prompt + " " + extra).strip(), "builtin"
    if roll < 0.55:
        language = rng.choice(["Python", "JavaScript", "TypeScript", "Java", "C++"])
        thing = rng.choice(lists.CODING_CLASSES)
        return f"Write {thing} as a {language} class, with a short example of how to use it.", "builtin"
    if roll < 0.62 and m.problems:
        piece = rng.choice(m.problems)
        language = rng.choice(["Python", "JavaScript"])
        return f"Write a {language} program that solves this word problem and prints the answer:\n\n{piece.text}", (
            piece.source
        )
    language, what, code, (old, new) = rng.choice(lists.SNIPPETS)
    fence = _fence(language)
    action = rng.random()
    if action < 0.4:
        buggy = code.replace(old, new)
        ask = rng.choice([
            "Here is a {lang} function that {what}. Is there any bug in it? If so, fix it.",
            "This {lang} function {what}, or it should: it gives wrong results for some inputs. Find the bug and "
            "explain it.", "Review this {lang} function that {what} and point out any problems.",
        ])  # fmt: skip
        shown = buggy
    else:
        ask = rng.choice([
            "Explain what this {lang} function does, step by step.",
            "What is the time and space complexity of this {lang} function? Explain.",
            "Add comments and documentation to this {lang} function that {what}.",
            "Write unit tests for this {lang} function that {what}.",
            "Rewrite this {lang} function in {other}, keeping the same behaviour.",
            "Suggest three ways to improve this {lang} function that {what}.",
        ])  # fmt: skip
        shown = code
    other = "JavaScript" if language == "Python" else "Python"
    text = ask.format(lang=language, what=what, other=other)
    return f"{text}\n\n```{fence}\n{shown}\n```", "builtin"


# ---- STEM and humanities explanations -------------------------------------------------------------------------
_EXPLAIN = [
    "Explain {c} to a high school student.",
    "What is {c}? Give a concrete example.",
    "Explain {c} in simple terms, then give one common misconception about it.",
    "Write a short explainer on {c} for {audience}.",
    "Why does {c} matter? Answer in a few paragraphs.",
    "Describe {c} in three levels of detail: one sentence, one paragraph, and a detailed explanation.",
]


def stem(rng: random.Random, m: Material) -> Built:
    roll = rng.random()
    if roll < 0.25 and m.facts:
        piece = rng.choice(m.facts)
        if piece.text.startswith("- "):
            return f"Explain this process in your own words and say why each step happens:\n\n{piece.text}", (
                piece.source
            )
        return f"Explain the science behind this statement: {piece.text}", piece.source
    if roll < 0.4 and m.questions:
        science = [q for q in m.questions if q.source.split(":")[-1].startswith("sciq")]
        piece = _pick(rng, science)
        if piece is not None:
            return f"Answer this question and explain the concept behind it: {piece.text}", piece.source
    if roll < 0.5:
        a, b = rng.choice(lists.STEM_PAIRS)
        return f"Explain the difference between {a} and {b}, with an example of each.", "builtin"
    if roll < 0.6:
        return PUZZLES["physics"](rng), "builtin"
    concept = rng.choice(lists.STEM_CONCEPTS)
    return rng.choice(_EXPLAIN).format(c=concept, audience=rng.choice(lists.AUDIENCES)), "builtin"


def humanities(rng: random.Random, m: Material) -> Built:
    roll = rng.random()
    if roll < 0.2 and m.passages:
        history = [p for p in m.passages if p.source.split(":")[-1].startswith("adversarial_qa")]
        piece = _pick(rng, history)
        if piece is not None:
            ask = rng.choice([
                "What is the historical context of the passage below, and why does it matter?",
                "Read the passage and explain its significance for the period it describes.",
                "Summarize the passage and discuss one question a historian might ask about it.",
            ])  # fmt: skip
            return f"{ask}\n\n{trim_words(piece.text, 150)}", piece.source
    if roll < 0.35:
        a, b = rng.choice(lists.HUMANITIES_PAIRS)
        return f"Compare and contrast {a} and {b}.", "builtin"
    if roll < 0.5:
        work, theme = rng.choice(lists.WORKS), rng.choice(lists.THEMES)
        return f"Discuss the theme of {theme} in {work}, with examples from the text.", "builtin"
    concept = rng.choice(lists.HUMANITIES_CONCEPTS)
    if roll < 0.62:
        grade, periods = rng.choice(lists.GRADES), rng.choice([1, 2, 3])
        return (
            f"Create a lesson plan that teaches {concept} to {grade} students over {periods} class period"
            f"{'s' if periods > 1 else ''}, with activities and homework.",
            "builtin",
        )
    if roll < 0.72:
        return f"Discuss the causes and consequences of {concept}.", "builtin"
    return rng.choice(_EXPLAIN).format(c=concept, audience=rng.choice(lists.AUDIENCES)), "builtin"


# ---- multi-step reasoning ---------------------------------------------------------------------------------------
_PROBLEM_ASKS = [
    "Solve this step by step, then check your answer a second way.\n\n{p}",
    "{p} Show your reasoning, and put the final answer on its own line as 'Answer: <number>'.",
    "Write a new word problem like the one below, with different numbers and a different setting, then solve it."
    "\n\n{p}",
    "Explain how you would solve this problem, step by step, before computing anything.\n\n{p}",
    "Turn this word problem into an equation, then solve the equation.\n\n{p}",
    "{p}\n\nA student answered {wrong}. Is that right? Explain where the reasoning goes right or wrong.",
    "Solve the problem below. Then say which piece of information was the most important.\n\n{p}",
]


def reasoning(rng: random.Random, m: Material) -> Built:
    if m.problems and rng.random() < 0.3:
        piece = rng.choice(m.problems)
        return rng.choice(_PROBLEM_ASKS).format(p=piece.text, wrong=rng.randint(2, 400)), piece.source
    name = rng.choice([k for k in PUZZLES if k != "physics"])
    prompt = PUZZLES[name](rng)
    style = rng.random()
    if style < 0.3:
        prompt += " Explain your reasoning step by step."
    elif style < 0.4:
        prompt = "Think carefully. " + prompt
    return prompt, "builtin"


# ---- long contexts (opt-in: `LONG_KINDS`) ------------------------------------------------------------------------
# Spec-Bench's summarization and rag prompts are long (median ~740-750 tokens, up to ~1,480), every default kind's
# are short (augment's MAX_TOKENS 300). The training prompts hold no long documents (1,293 prose passages, median
# 94 words), so a long context is stitched from several passages: as one multi-part text to summarize, or as
# numbered documents of which one holds the answer to the question.
LONG_PASSAGES = (4, 9)  # passages a long context stitches, at least and at most
_LONG_SUMMARY_ASKS = [
    "Summarize the following text in one paragraph.\n\n{text}",
    "{text}\n\nSummarize the text above in {n} bullet points.",
    "Read the collection of articles below and write a short summary of each, one paragraph each.\n\n{text}",
    "Write a concise overview of the documents below: what each is about, in a sentence or two.\n\n{text}",
    "{text}\n\nWhat are the main points of these texts? Answer in no more than {words} words.",
    "Here are several news items and reviews:\n\n{text}\n\nGive me a TL;DR of each.",
    "Summarize the documents below for a busy reader, keeping every number and name that matters.\n\n{text}",
]


def _long_documents(rng: random.Random, pieces: list[str]) -> str:
    style = rng.random()
    if style < 0.5:
        return "\n\n".join(f"Document {i + 1}:\n{text}" for i, text in enumerate(pieces))
    if style < 0.75:
        return "\n\n".join(f"[{i + 1}] {text}" for i, text in enumerate(pieces))
    return "\n\n".join(f"Article {i + 1}:\n{text}" for i, text in enumerate(pieces))


def long_summarization(rng: random.Random, m: Material) -> Built:
    if len(m.passages) < LONG_PASSAGES[0]:
        return None
    chosen = rng.sample(m.passages, min(len(m.passages), rng.randint(*LONG_PASSAGES)))
    text = _long_documents(rng, [_passage(rng, piece) for piece in chosen])
    ask = rng.choice(_LONG_SUMMARY_ASKS)
    return ask.format(text=text, n=rng.choice([4, 5, 6]), words=rng.choice([80, 120, 150])), chosen[0].source


def long_rag(rng: random.Random, m: Material) -> Built:
    pair = _pick(rng, m.qa)
    if pair is None or len(m.passages) < LONG_PASSAGES[0] - 1:
        return None
    others = [p for p in m.passages if p.text != pair.passage]
    distractors = rng.sample(others, min(len(others), rng.randint(LONG_PASSAGES[0] - 1, LONG_PASSAGES[1] - 1)))
    documents = [_passage(rng, piece) for piece in distractors]
    documents.insert(rng.randrange(len(documents) + 1), trim_words(pair.passage, rng.choice([150, 200, 250])))
    question = pair.question
    if rng.random() < 0.08 and len(m.qa) > 1:  # unanswerable from these documents: the model should say so
        question = rng.choice(m.qa).question
    ask = rng.choice(_RAG_ASKS)
    context = _long_documents(rng, documents)
    return ask.format(context=context, question=question, question_lower=_lower_first(question)), pair.source


KINDS: dict[str, Callable[[random.Random, Material], Built]] = {
    "summarization": summarization,
    "rag": rag,
    "qa": qa,
    "extraction": extraction,
    "translation": translation,
    "writing": writing,
    "roleplay": roleplay,
    "coding": coding,
    "stem": stem,
    "humanities": humanities,
    "reasoning": reasoning,
}

# Opt-in kinds (`augment --kinds longsummary,longrag --max-tokens 1400`): prompts of ~500-1,400 tokens, longer than
# the default ``--max-tokens`` and the generate stage's default ``--max-prompt-tokens`` (384).
LONG_KINDS: dict[str, Callable[[random.Random, Material], Built]] = {
    "longsummary": long_summarization,
    "longrag": long_rag,
}
