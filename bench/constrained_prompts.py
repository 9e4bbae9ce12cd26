"""Extraction and JSON prompts, each with the grammar its answer must follow, for ``bench/constrained.py``.

Each item: ``category`` (``extraction``: pull fields out of a given text; ``json``: write a record), the ``text``
of the user turn, and one grammar (``json_schema`` or ``regex``) as `SamplingParams` takes it.
"""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"}},
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
    },
    "required": ["order_id", "items", "total"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "location": {"type": "string"},
        "attendees": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "date", "location", "attendees"],
    "additionalProperties": False,
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string", "enum": ["fiction", "science", "history", "poetry"]}},
    },
    "required": ["title", "author", "year", "genres"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EMAIL = r"[a-z0-9._]+@[a-z0-9]+\.(com|org|net)"
PHONE = r"\+?[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}"
SENTIMENT = r"(positive|negative|neutral): [A-Za-z ,.']{10,80}"

PROMPTS: list[dict] = [
    {
        "category": "extraction",
        "text": "Extract the person as JSON with name, age and city: 'Maria Lopez, a 42-year-old architect, moved "
        "from Madrid to Lisbon last spring.'",
        "json_schema": PERSON,
    },
    {
        "category": "extraction",
        "text": "Turn this order into JSON (order_id, items with product and quantity, total): 'Order #A-1043: two "
        "notebooks, one pack of pens and three erasers, total 17.50 dollars.'",
        "json_schema": ORDER,
    },
    {
        "category": "extraction",
        "text": "Extract the event as JSON (title, date as YYYY-MM-DD, location, attendees): 'The design review "
        "takes place on March 4, 2025 in room 210 with Priya, Tom and Chen.'",
        "json_schema": EVENT,
    },
    {
        "category": "extraction",
        "text": "What is the date in this sentence, as YYYY-MM-DD? 'The treaty was signed on the ninth of November "
        "1989 in Berlin.'",
        "regex": DATE,
    },
    {
        "category": "extraction",
        "text": "Give only the email address found here: 'For refunds write to Support Team "
        "<help.desk@shopmail.com> within 30 days.'",
        "regex": EMAIL,
    },
    {
        "category": "extraction",
        "text": "Write the phone number in this note with its country code: 'Call the Paris office at +33 145 "
        "678 9012 before noon.'",
        "regex": PHONE,
    },
    {
        "category": "json",
        "text": "Describe a fictional character as a JSON object with name, age and city.",
        "json_schema": PERSON,
    },
    {
        "category": "json",
        "text": "Recommend one classic book as JSON with title, author, year and genres.",
        "json_schema": BOOK,
    },
    {
        "category": "json",
        "text": "Invent a team meeting and give it as JSON: title, date (YYYY-MM-DD), location and attendees.",
        "json_schema": EVENT,
    },
    {
        "category": "json",
        "text": "Classify the sentiment of this review and give a short reason: 'The battery lasts two days and "
        "the screen is gorgeous, though the speaker is weak.'",
        "regex": SENTIMENT,
    },
]
